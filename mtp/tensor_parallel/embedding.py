"""The vocab-parallel embedding: ``nn.Embedding`` with the vocabulary split over the
tensor-parallel ranks (initialisation and argument checks as the linear layers of
:mod:`mtp.tensor_parallel.layers`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.parallel.agreement import collective_region
from mtp.parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mtp.utils import check_tensor, check_values, data_checks_enabled, validation_mode

from .utils import (
    InitMethod,
    VocabUtility,
    check_layer_args,
    check_positive_int,
    group_rank_and_size,
    master_then_shard,
    pad_vocab_size,
    set_tensor_model_parallel_attributes,
)

__all__ = ["VocabParallelEmbedding", "VocabRangeError"]


class VocabRangeError(ValueError, IndexError):
    """Token ids outside ``[0, num_embeddings)`` (a ``ValueError``, and an ``IndexError`` like
    ``nn.Embedding``'s)."""


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary split over the tensor-parallel ranks.

    Rank ``r`` holds rows ``[r * V/tp, (r + 1) * V/tp)``. Each rank looks up the ids in its
    range, writes zeros for the others, and the partial embeddings are summed over the group
    (all-reduce), or reduce-scattered along ``seq_dim`` with ``sequence_parallel``.

    Args:
        num_embeddings: the full vocabulary size ``V`` (divisible by tp; see
            :func:`pad_vocab_size`).
        embedding_dim: ``h``.
        init_method: ``fn(weight)`` on the full ``[V, h]`` weight; default ``nn.Embedding``'s
            (standard normal).
        padding_idx: as ``nn.Embedding``: that row starts at zero and gets no gradient.
        sequence_parallel, seq_dim: reduce-scatter the output along ``seq_dim`` (the ids'
            sequence dimension: 0 for ``[s, b]`` ids, 1 for ``[b, s]``).
        validate: check that every id is in ``[0, V)``: ``True`` (default) on the device, no
            host sync (a device-side assert on CUDA; on CPU a ``RuntimeError`` at once);
            ``"sync"`` (or ``MTP_VALIDATE=sync``) raises :class:`VocabRangeError` (a
            ``ValueError`` and an ``IndexError``) naming the values, at the cost of a host
            sync; ``False`` off. Skipped while tracing or capturing a CUDA graph.
        perform_initialization, group, dtype, device: as for :class:`ColumnParallelLinear`.

    Forward: integer ids of any shape -> ``[*ids.shape, h]`` (the sequence chunk under
    sequence parallel). One all-reduce (or reduce-scatter) forward, none backward.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None = None,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        validate: bool | str = True,
        perform_initialization: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        name = "VocabParallelEmbedding"
        validation_mode(validate)  # a bad value fails here, naming validate
        check_positive_int(name, "num_embeddings", num_embeddings)
        check_positive_int(name, "embedding_dim", embedding_dim)
        check_layer_args(
            name,
            flags={
                "sequence_parallel": sequence_parallel,
                "perform_initialization": perform_initialization,
            },
            seq_dim=seq_dim,
            init_methods={"init_method": init_method},
            group=group,
            dtype=dtype,
            device=device,
        )
        if padding_idx is not None and (
            isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
        ):
            raise TypeError(f"{name}: padding_idx must be an int or None, got {padding_idx!r}")
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(
                f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the vocabulary "
                f"[0, {num_embeddings})"
            )
        self.group, self.tp_rank, self.tp_size = group_rank_and_size(group)
        if num_embeddings % self.tp_size:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings ({num_embeddings}) must be divisible by "
                f"the tensor parallel size ({self.tp_size}); pad the vocabulary, e.g. to "
                f"mtp.tensor_parallel.pad_vocab_size({num_embeddings}, {self.tp_size}) = "
                f"{pad_vocab_size(num_embeddings, self.tp_size)}"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.sequence_parallel, self.seq_dim, self.validate = sequence_parallel, seq_dim, validate
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, self.tp_rank, self.tp_size
            )
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        factory = {"dtype": dtype, "device": device}
        if perform_initialization:

            def init(w):
                (init_method or nn.init.normal_)(w)
                if self.padding_idx is not None:
                    w[self.padding_idx].zero_()

            weight = master_then_shard(
                (num_embeddings, embedding_dim),
                0,
                [num_embeddings],
                self.tp_rank,
                self.tp_size,
                init,
                factory,
            )
        else:
            weight = torch.empty((self.num_embeddings_per_partition, embedding_dim), **factory)
        self.weight = nn.Parameter(weight)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def _local_padding_idx(self) -> int | None:
        p = self.padding_idx
        if p is None or not self.vocab_start_index <= p < self.vocab_end_index:
            return None
        return p - self.vocab_start_index

    def _validate(self, ids: torch.Tensor) -> None:
        check_tensor("input_", ids, dtypes=(torch.int32, torch.int64))
        mode = validation_mode(self.validate)
        if not ids.numel() or mode == "off" or not data_checks_enabled(True, ids):
            return
        outside = (ids < 0) | (ids >= self.num_embeddings)
        if mode == "sync":
            if bool(outside.any()):
                raise VocabRangeError(
                    f"VocabParallelEmbedding: input_ ids must be in [0, {self.num_embeddings}), "
                    f"got values in [{int(ids.min())}, {int(ids.max())}]"
                )
            return
        check_values(
            ~outside.any(),
            f"VocabParallelEmbedding: input_ ids must be in [0, {self.num_embeddings}) "
            "(validate='sync' or MTP_VALIDATE=sync names the values)",
            validate=mode,
            tensors=(ids,),
        )

    @collective_region("VocabParallelEmbedding.forward")
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        self._validate(input_)
        if self.sequence_parallel:
            seq_dim = self.seq_dim % (input_.dim() + 1)
            if input_.dim() == 0 or seq_dim >= input_.dim():
                raise ValueError(
                    f"VocabParallelEmbedding: seq_dim={self.seq_dim} is not a dimension of the "
                    f"ids of shape {tuple(input_.shape)}"
                )
        if self.tp_size == 1:
            return F.embedding(input_, self.weight, self.padding_idx)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight, self._local_padding_idx())
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(
                partial, self.group, seq_dim=self.seq_dim
            )
        return reduce_from_tensor_model_parallel_region(partial, self.group, inplace=True)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"vocab_range=[{self.vocab_start_index}, {self.vocab_end_index}), "
            f"sequence_parallel={self.sequence_parallel}"
        )
