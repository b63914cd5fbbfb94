"""The all-gather token dispatcher (Megatron-Core's ``allgather`` type), for small EP.

Every rank of the expert-parallel group (and of the expert-tensor-parallel group) all-gathers
all tokens, their probabilities and routing, keeps the rows routed to its own experts, and after
the experts reduce-scatters the outputs back: rank ``r`` gets the sum, over every rank's experts
(and expert-TP shards), for its own tokens. Same results as :class:`AllToAllTokenDispatcher`.

Every shape is static: the local rows are laid out for the worst case ``T_all * min(k, L)``
(``T_all = P * Q * T``), unused rows at the end hold no token and probability 0. So there is no
host sync, dropless or not, and the dispatch is graph-safe; the cost is moving all tokens to
every rank (good when ``P`` is small, or tokens are few). All ranks need the same token count.
With a capacity the router has already dropped the tokens; the dispatcher keeps what it routed.
"""

from __future__ import annotations

import dataclasses

import torch

from mtp.moe.comm import (
    all_to_all,
    gather_v,
    permute_backend,
    permute_rows,
    rank_meta,
    reduce_scatter_v,
)
from mtp.moe.dispatcher_base import TokenDispatcherBase
from mtp.ops.moe_permute import TokenMap, moe_permute_row_map, select_probs, unpermute
from mtp.parallel.agree import group_ranks
from mtp.parallel.groups import group_description

__all__ = ["AllGatherDispatchMetadata", "AllGatherTokenDispatcher"]


@dataclasses.dataclass(frozen=True)
class AllGatherDispatchMetadata:
    """What one :meth:`AllGatherTokenDispatcher.dispatch` leaves for its ``combine``: the row
    map of the gathered tokens (and its token-major map), their ``[T_all, H]`` shape and the
    permute backend."""

    row_id_map: torch.Tensor
    shape: tuple[int, int]
    backend: str
    token_map: TokenMap | None = None


class AllGatherTokenDispatcher(TokenDispatcherBase):
    """All-gather dispatch / reduce-scatter combine (see the module docstring).

    Construction as :class:`~mtp.moe.AllToAllTokenDispatcher` (a
    :class:`~mtp.moe.config.DispatcherConfig` and a :class:`~mtp.parallel.dims.ParallelDims`,
    or the flat form); ``capacity_factor`` is accepted (the router drops); ``check_ranks``: the
    ranks' token count, hidden size and dtypes are checked with one tiny all-to-all on the first
    dispatch, or on every one with ``True`` or ``MTP_CHECK_COLLECTIVES=1``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workspace = None  # no workspace: every buffer is per call
        self._megatron_metadata: AllGatherDispatchMetadata | None = None

    def _check(self, hidden_states, probs) -> None:
        if not self.should_check_ranks(hidden_states):
            return
        spec = rank_meta(hidden_states, probs, what="MoE all-gather dispatch")
        row = spec.tensor(hidden_states.device)
        for group, size, _ in self.groups():
            rows = all_to_all(row.view(1, -1).expand(size, -1).contiguous(), group)
            spec.check_rows(rows.tolist(), group_ranks(group, size), where=group_description(group))

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllGatherDispatchMetadata]:
        """``(tokens [N, H], tokens_per_expert [L], permuted_probs [N], metadata)`` for this
        rank's experts, ``N = P * Q * T * min(k, L)`` (trailing rows unused); ``metadata``
        goes to :meth:`combine`."""
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be [T, H], got {tuple(hidden_states.shape)}")
        if tuple(routing_map.shape) != (hidden_states.shape[0], self.num_experts):
            raise ValueError(
                f"routing_map must be [{hidden_states.shape[0]}, {self.num_experts}], got "
                f"{tuple(routing_map.shape)}"
            )
        if routing_map.dtype != torch.bool:
            raise TypeError(f"routing_map must be bool, got {routing_map.dtype}")
        if probs.shape != routing_map.shape or not probs.is_floating_point():
            raise ValueError(
                f"probs must be a float [T, E] tensor like routing_map, got {tuple(probs.shape)}"
            )
        self._check(hidden_states, probs)
        x, both = hidden_states, torch.cat([probs, routing_map.to(probs.dtype)], dim=1)
        for group, size, rank in self.groups():
            x = gather_v(x, group, [x.shape[0]] * size, rank)
            both = gather_v(both, group, [both.shape[0]] * size, rank)
        first, local = self.local_expert_indices[0], self.num_local_experts
        all_probs = both[:, first : first + local]
        local_map = both[:, self.num_experts + first : self.num_experts + first + local] > 0
        rows = x.shape[0] * min(self.topk, local)
        backend = permute_backend(self.backend, hidden_states.device)
        row_map = moe_permute_row_map(local_map, rows, token_map=True)
        meta = AllGatherDispatchMetadata(row_map.row_id_map, tuple(x.shape), backend,
                                         row_map.token_map)  # fmt: skip
        tokens = permute_rows(x, row_map.row_id_map, backend, row_map.token_map)
        counts = local_map.sum(dim=0, dtype=torch.int64)
        return tokens, counts, select_probs(all_probs, row_map.pair), meta

    def combine(
        self, expert_output: torch.Tensor, metadata: AllGatherDispatchMetadata
    ) -> torch.Tensor:
        """Sum the expert outputs per token and reduce-scatter them back: ``[T, H]``."""
        if not isinstance(metadata, AllGatherDispatchMetadata):
            raise TypeError(
                f"combine() takes the metadata dispatch() returned, got {type(metadata).__name__}"
            )
        if expert_output.dim() != 2 or expert_output.shape[1] != metadata.shape[1]:
            raise ValueError(
                f"expert_output must be [M, {metadata.shape[1]}], got "
                f"{tuple(expert_output.shape)}"
            )
        y = unpermute(
            expert_output, metadata.row_id_map, metadata.shape, backend=metadata.backend,
            validate=False, token_map=metadata.token_map,
        )  # fmt: skip
        for group, size, rank in reversed(self.groups()):
            y = reduce_scatter_v(y, group, [y.shape[0] // size] * size, rank)
        return y

    def token_permutation(self, hidden_states, probs, routing_map):
        """Megatron-Core's stateful :meth:`dispatch`: the first three outputs; the metadata is
        kept for :meth:`token_unpermutation`."""
        *out, self._megatron_metadata = self.dispatch(hidden_states, probs, routing_map)
        return tuple(out)

    def token_unpermutation(self, hidden_states: torch.Tensor, bias=None):
        """Megatron-Core's stateful :meth:`combine`; returns ``(output [T, H], None)``."""
        if bias is not None:
            raise ValueError("token_unpermutation: bias is not supported (add it in the experts)")
        meta, self._megatron_metadata = self._megatron_metadata, None
        if meta is None:
            raise RuntimeError("token_unpermutation() needs a token_permutation() first")
        return self.combine(hidden_states, meta), None
