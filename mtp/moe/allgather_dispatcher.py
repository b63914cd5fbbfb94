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

import torch
import torch.distributed as dist

from mtp.moe.comm import (
    _group_ranks,
    all_to_all,
    check_rank_meta,
    gather_rows,
    gather_v,
    permute_backend,
    rank_meta,
    reduce_scatter_v,
    set_dispatch_groups,
)
from mtp import settings
from mtp.ops.moe_permute import moe_permute_row_map, select_probs, unpermute
from mtp.utils import data_checks_enabled, is_capturing

__all__ = ["AllGatherTokenDispatcher"]


class AllGatherTokenDispatcher:
    """All-gather dispatch / reduce-scatter combine (see the module docstring).

    Args: as :class:`~mtp.moe.AllToAllTokenDispatcher` (``ep_group``, ``num_experts``,
    ``topk``, ``capacity_factor`` (accepted; the router drops), ``backend``, ``etp_group``,
    ``check_ranks``: the ranks' token count, hidden size and dtypes are checked with one tiny
    all-to-all on the first dispatch, or on every one with ``True`` or
    ``MTP_CHECK_COLLECTIVES=1``).
    """

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None,
        num_experts: int,
        topk: int,
        *,
        capacity_factor: float | None = None,
        backend: str = "auto",
        etp_group: dist.ProcessGroup | None = None,
        check_ranks: bool | None = None,
    ) -> None:
        set_dispatch_groups(self, ep_group, etp_group, num_experts, topk)
        if check_ranks not in (None, True, False):
            raise TypeError(f"check_ranks must be None, True or False, got {check_ranks!r}")
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.capacity_factor, self.backend, self.check_ranks = capacity_factor, backend, check_ranks
        self.workspace = None  # no workspace: every buffer is per call
        self._checked = False
        self._state: dict | None = None

    def _groups(self):
        return [(g, s, r) for g, s, r in (
            (self.ep_group, self.ep_size, self.ep_rank),
            (self.etp_group, self.etp_size, self.etp_rank),
        ) if s > 1]

    def _check(self, hidden_states, probs) -> None:
        if self.check_ranks is False or not self._groups():
            return
        if not data_checks_enabled(True, hidden_states) or is_capturing():
            return
        every = self.check_ranks or settings.current().check_collectives
        if self._checked and not every:
            return
        self._checked = True
        meta = rank_meta(hidden_states, probs)
        for group, size, _ in self._groups():
            rows = all_to_all(meta.view(1, -1).expand(size, -1).contiguous(), group)
            check_rank_meta(rows.tolist(), _group_ranks(group, size), True, "all-gather dispatch")

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [N, H], tokens_per_expert [L], permuted_probs [N])`` for this rank's
        experts, ``N = P * Q * T * min(k, L)`` (trailing rows unused)."""
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
        for group, size, rank in self._groups():
            x = gather_v(x, group, [x.shape[0]] * size, rank)
            both = gather_v(both, group, [both.shape[0]] * size, rank)
        first, local = self.local_expert_indices[0], self.num_local_experts
        all_probs = both[:, first : first + local]
        local_map = both[:, self.num_experts + first : self.num_experts + first + local] > 0
        rows = x.shape[0] * min(self.topk, local)
        row_id_map, pair = moe_permute_row_map(local_map, rows)
        backend = permute_backend(self.backend, hidden_states.device)
        self._state = dict(row_id_map=row_id_map, shape=tuple(x.shape), backend=backend)
        tokens = gather_rows(x, row_id_map, backend)
        return tokens, local_map.sum(dim=0, dtype=torch.int64), select_probs(all_probs, pair)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Sum the expert outputs per token and reduce-scatter them back: ``[T, H]``."""
        state = self._state
        if state is None:
            raise RuntimeError("combine() needs a dispatch() first")
        if expert_output.dim() != 2 or expert_output.shape[1] != state["shape"][1]:
            raise ValueError(
                f"expert_output must be [M, {state['shape'][1]}], got {tuple(expert_output.shape)}"
            )
        self._state = None
        y = unpermute(
            expert_output, state["row_id_map"], state["shape"], backend=state["backend"],
            validate=False,
        )
        for group, size, rank in reversed(self._groups()):
            y = reduce_scatter_v(y, group, [y.shape[0] // size] * size, rank)
        return y

    token_permutation = dispatch

    def token_unpermutation(self, hidden_states: torch.Tensor, bias=None):
        """Megatron-Core's name for :meth:`combine`; returns ``(output [T, H], None)``."""
        if bias is not None:
            raise ValueError("token_unpermutation: bias is not supported (add it in the experts)")
        return self.combine(hidden_states), None
