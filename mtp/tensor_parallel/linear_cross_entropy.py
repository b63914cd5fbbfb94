"""The LM head and its loss in one module: :class:`VocabParallelLinearCrossEntropy`.

Replaces ``ColumnParallelLinear(hidden, vocab)`` + ``vocab_parallel_cross_entropy`` with
:func:`mtp.ops.linear_cross_entropy`, which never holds more than ``chunk_size`` rows of
logits: only per-row statistics cross the tensor-parallel ranks (the seed's idea of fusing the
parallel output GEMM with the loss, taken to its end).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtp.ops.linear_cross_entropy import linear_cross_entropy
from mtp.utils import qualified_name

from .layers import ColumnParallelLinear
from .utils import InitMethod

__all__ = ["VocabParallelLinearCrossEntropy"]


class VocabParallelLinearCrossEntropy(nn.Module):
    """``loss = cross_entropy(hidden @ W^T + b, target)`` with ``W`` split over the vocab.

    Args:
        hidden_size: ``H``.
        vocab_size: the global (padded) vocab ``V``; must divide by the tensor-parallel size.
        bias: add an output bias (sharded like the vocab).
        sequence_parallel: ``hidden`` is this rank's chunk of the sequence (dim 0, Megatron's
            ``[s/tp, b, h]``); ``target`` is the whole ``[s, b]``.
        init_method, perform_initialization, group, dtype, device: as
            :class:`~mtp.tensor_parallel.ColumnParallelLinear` (the same master-then-shard
            initialisation, so the module equals an ``nn.Linear`` head built from the same seed).
        label_smoothing, ignore_index, z_loss_weight, reduction, chunk_size, validate,
            backend: see :func:`mtp.ops.linear_cross_entropy` (``backend="auto"``: the Triton
            loss kernels on CUDA, PyTorch maths on CPU).

    Parameters: ``weight`` ``[V/tp, H]`` and ``bias`` ``[V/tp]`` (Megatron's
    ``tensor_model_parallel`` attributes set, partition dim 0).

    Forward: ``(hidden [..., H], target [...]) -> fp32 loss`` (scalar, or ``target``'s shape
    with ``reduction="none"``).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        perform_initialization: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        z_loss_weight: float = 0.0,
        reduction: str = "mean",
        chunk_size: int | None = None,
        validate: bool | str = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        head = ColumnParallelLinear(
            hidden_size, vocab_size, bias=bias, sequence_parallel=sequence_parallel,
            init_method=init_method, perform_initialization=perform_initialization, group=group,
            dtype=dtype, device=device,
        )  # fmt: skip
        self._adopt(head)
        self.loss_kwargs = dict(
            label_smoothing=label_smoothing, ignore_index=ignore_index,
            z_loss_weight=z_loss_weight, reduction=reduction, chunk_size=chunk_size,
            validate=validate, backend=backend,
        )  # fmt: skip

    def _adopt(self, head: ColumnParallelLinear) -> None:
        self.weight = head.weight
        self.bias = head.bias
        self.group = head.group
        self.tp_size = head.tp_size
        self.hidden_size, self.vocab_size = head.input_size, head.output_size
        self.sequence_parallel = head.sequence_parallel

    @classmethod
    def from_column_parallel(cls, head: ColumnParallelLinear, **loss_kwargs):
        """Wrap an existing LM head (its parameters are shared, not copied).

        ``head`` must not gather its output, add its bias outside, or fuse several blocks, and
        with ``sequence_parallel`` its ``seq_dim`` must be 0.
        """
        if not isinstance(head, ColumnParallelLinear):
            raise TypeError(
                "head must be a mtp.tensor_parallel.ColumnParallelLinear, got "
                f"{qualified_name(head)}"
            )
        if head.gather_output or head.skip_bias_add or len(head._blocks) != 1:
            raise ValueError(
                "head must have gather_output=False, skip_bias_add=False and stride=1 to be "
                "fused with the loss"
            )
        if head.sequence_parallel and head.seq_dim != 0:
            raise ValueError("head: sequence_parallel with seq_dim != 0 is not supported here")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._adopt(head)
        defaults = dict(
            label_smoothing=0.0, ignore_index=-100, z_loss_weight=0.0, reduction="mean",
            chunk_size=None, validate=True, backend="auto",
        )  # fmt: skip
        unknown = set(loss_kwargs) - set(defaults)
        if unknown:
            raise TypeError(f"unexpected loss arguments: {sorted(unknown)}")
        self.loss_kwargs = defaults | loss_kwargs
        return self

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        group = self.group if self.tp_size > 1 else None
        return linear_cross_entropy(
            hidden, self.weight, target, group=group, bias=self.bias,
            sequence_parallel=self.sequence_parallel, **self.loss_kwargs,
        )  # fmt: skip

    def extra_repr(self) -> str:
        kw = self.loss_kwargs
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
            f"reduction={kw['reduction']!r}, chunk_size={kw['chunk_size']}"
        )
