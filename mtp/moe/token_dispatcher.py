"""Expert-parallel token dispatch and combine: :class:`AllToAllTokenDispatcher`.

``dispatch(hidden_states [T, H], probs [T, E], routing_map [T, E])`` returns the rows this rank's
experts must process, grouped by local expert, with their counts and probabilities;
``combine(expert_output)`` brings the results back and sums them per token. The dispatcher owns
the whole flow; the preprocess pieces it calls (:mod:`mtp.moe.preprocess`) are functions of the
routing and the workspace, and the workspace only holds the fixed buffers.

Steps (``P`` expert-parallel ranks, ``L = E / P`` local experts, ``Q`` expert-tensor-parallel
ranks):

1. :func:`~mtp.moe.preprocess.local_preprocess` (counts, row map, permuted probs), copied into
   the :class:`~mtp.moe.MoEWorkspace`; dropless ``P > 1``: a device all-to-all of the
   per-expert counts, which also carries each rank's token count, hidden size and dtypes.
2. Permute: gather the token rows in expert-major order.
3. ``P > 1``: ``all_to_all_single`` of the rows and of their probabilities, then reorder the
   received rows from source-major to expert-major.
4. ``Q > 1``: all-gather the rows (and probabilities) of the ``Q`` ranks sharing the experts
   (each holds ``F / Q`` of their features) and reorder them expert-major again.
5. ``combine``: the inverse of each step (the expert-TP partial outputs are reduce-scattered),
   then :func:`mtp.ops.unpermute` (a deterministic per-token sum of the expert outputs).

``dispatch()`` is ``token_dispatch(*dispatch_preprocess(...))``: the local part of step 1 and
step 2 (no communication or host sync: graph-safe for every ``P``), then the rest.

Host synchronisation:

- ``P == Q == 1``, or any ``P``/``Q`` with ``capacity_factor``: none (every split size is known
  in advance; graph-safe). The rank-agreement check of a capacity dispatch (see
  ``check_ranks``) is a tiny all-to-all and a device-side assert, no host sync.
- Dropless ``P > 1`` or ``Q > 1``: exactly **one** device-to-host copy per layer, of the split
  sizes (and the ranks' metadata, checked there: a :class:`RankMismatchError` on every rank when
  they disagree), placed right before the token all-to-all (after the permutation is queued, as
  late as possible, like Megatron-Core's ``before_ep_alltoall`` sync point). The backward
  reuses the sizes (no sync there).

Collectives per forward on the EP group (``all_to_all_single``): dropless 4 (counts + metadata,
tokens, probs, combine), capacity 3 (+1 tiny one on the first dispatch), none for ``P == 1``;
with ``Q > 1`` three more on the expert-TP group (counts, tokens, probs; capacity: two) and one
in the combine. The backward runs one all-to-all per forward token/probs/combine exchange.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from mtp.moe.preprocess import (
    _RESULT_FIELDS,
    MoEPreprocessResult,
    _recv_reorder,
    check_routing,
    exchange_counts,
    finish_ep_preprocess,
    local_preprocess,
    store_preprocess,
)
from mtp.moe.comm import (  # noqa: F401 - all_to_all & co. re-exported (their first home)
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
from mtp.moe.workspace import MoEWorkspace
from mtp.ops.moe_permute import unpermute
from mtp.parallel.errors import RankMismatchError
from mtp.utils import check_values, data_checks_enabled, is_capturing, is_fake, validation_mode

__all__ = [
    "AllToAllTokenDispatcher",
    "RankMismatchError",
    "all_to_all",
    "gather_v",
    "reduce_scatter_v",
]

logger = logging.getLogger("mtp")

# What the dropless EP exchange adds to the local preprocess (stored into the workspace).
_EP_FIELDS = ("recv_counts", "local_tokens_per_expert", "recv_order", "recv_inverse")


class AllToAllTokenDispatcher:
    """Dispatch tokens to experts over the expert-parallel group and combine the results.

    Args:
        ep_group: the expert-parallel process group (``P`` ranks); None for ``P = 1``.
        num_experts: ``E``, all experts; rank ``r`` of the group holds experts
            ``[r * L, (r + 1) * L)``.
        topk: experts per token.
        capacity_factor: None for dropless; else every expert has
            ``C = min(ceil(T * topk / E * capacity_factor), T)`` slots (padded with empty rows),
            which makes every shape and split static (no host sync, graph-safe). All ranks of
            the group must then see the same token count ``T``.
        backend: for the permute/unpermute kernels: ``"auto"``, ``"triton"`` or
            ``"reference"`` (other names: ``"auto"``).
        etp_group: expert tensor parallelism (``Q`` ranks holding shards of the same experts,
            Megatron's expert-TP group): after the EP all-to-all the rows of the ``Q`` ranks are
            all-gathered so that each shard sees every row of its experts, and the partial
            outputs are reduce-scattered back in :meth:`combine` (Megatron-Core's order).
        check_ranks: check that the ranks agree on the hidden size, the dtypes and (with a
            capacity) the token count before exchanging tokens, raising
            :class:`RankMismatchError` on every rank instead of letting the collective fail.
            Dropless folds the check into the count exchange and its one host sync (free, every
            dispatch). With a capacity (no count exchange, no host sync) it costs one tiny
            all-to-all and a device-side assert (no host sync; on CPU it raises at once;
            ``MTP_VALIDATE=sync`` gives :class:`RankMismatchError` naming the values after a
            sync): ``None`` (default) checks the first dispatch only, or every dispatch under
            ``MTP_CHECK_COLLECTIVES=1``; ``True`` every dispatch; ``False`` never. Skipped
            while capturing or compiling.

    The :class:`~mtp.moe.MoEWorkspace` is built on the first :meth:`dispatch` for its token
    count, dtype and device and rebuilt (with an INFO log line) when they change.
    Megatron-Core's method names work too: :meth:`token_permutation`,
    :meth:`token_unpermutation`.
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
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.capacity_factor = capacity_factor
        self.backend = backend
        if check_ranks not in (None, True, False):
            raise TypeError(f"check_ranks must be None, True or False, got {check_ranks!r}")
        self.check_ranks = check_ranks
        self._static_checked = False
        self.workspace: MoEWorkspace | None = None
        self._state: dict | None = None

    # -- workspace ----------------------------------------------------------------------------

    def get_workspace(
        self,
        num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        probs_dtype: torch.dtype,
        device: torch.device,
    ) -> MoEWorkspace:
        """The workspace for these sizes: the current one, or a new one (logged)."""
        ws = self.workspace
        if (
            ws is not None
            and ws.matches(num_tokens, self.num_experts, hidden_size, dtype, device)
            and ws.probs_dtype == probs_dtype
        ):
            return ws
        new = self._new_workspace(num_tokens, hidden_size, dtype, probs_dtype, device)
        if ws is not None:
            logger.info(
                "MoE dispatcher: rebuilding the workspace for %d tokens (was %d): %s",
                num_tokens,
                ws.num_tokens,
                new,
            )
        self.workspace = new
        return new

    def _new_workspace(self, num_tokens, hidden_size, dtype, probs_dtype, device):
        return MoEWorkspace(
            num_tokens,
            hidden_size,
            self.num_experts,
            self.topk,
            ep_size=self.ep_size,
            capacity_factor=self.capacity_factor,
            dtype=dtype,
            probs_dtype=probs_dtype,
            device=device,
        )

    def _workspace_for(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> MoEWorkspace:
        args = (hidden_states.shape[0], hidden_states.shape[1], hidden_states.dtype, probs.dtype)
        if is_fake(hidden_states):
            # Tracing with fake tensors: a throwaway workspace (never keep fake buffers).
            return self._new_workspace(*args, hidden_states.device)
        return self.get_workspace(*args, device=hidden_states.device)

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Send each routed (token, expert) row to the rank that holds the expert:
        :meth:`dispatch_preprocess` then :meth:`token_dispatch`.

        Args:
            hidden_states: ``[T, H]``.
            probs: ``[T, E]`` routing probabilities (differentiable).
            routing_map: ``[T, E]`` bool.

        Returns:
            ``(tokens [M, H], tokens_per_expert [L] int64 (device), permuted_probs [M])``: the
            rows of this rank's ``L`` experts, expert-major; ``M`` is ``T * topk`` (``P = 1``),
            ``L * P * C`` (capacity) or the received count (dropless ``P > 1``), times ``Q``
            with expert tensor parallelism.
        """
        return self.token_dispatch(*self.dispatch_preprocess(hidden_states, probs, routing_map))

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank-local, graph-safe first half of :meth:`dispatch` (Megatron-Core's
        ``dispatch_preprocess``): :func:`~mtp.moe.preprocess.local_preprocess` into the
        workspace and the permutation of the rows; no communication, no host sync.

        Returns ``(permuted_tokens [N, H], permuted_probs [N])`` (``N`` = ``T * topk``, or
        ``E * C`` with a capacity), differentiable in ``hidden_states`` and ``probs``. The other
        tensors :meth:`token_dispatch` and :meth:`combine` read are
        :meth:`preprocess_tensors`: a CUDA graph that stops here outputs them, and
        :meth:`restore_preprocess` puts a replay's copies back.
        """
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be [T, H], got {tuple(hidden_states.shape)}")
        if routing_map.dim() == 2 and routing_map.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"routing_map has {routing_map.shape[0]} rows but hidden_states has "
                f"{hidden_states.shape[0]} tokens"
            )
        ws = self._workspace_for(hidden_states, probs)
        check_routing(routing_map, probs, ws, validate=False)
        res = local_preprocess(routing_map, probs, ws)
        store_preprocess(res, ws)  # fixed-address copies; ``res`` keeps the autograd link
        self._set_state(ws, res, *hidden_states.shape, hidden_states.device)
        permuted = gather_rows(hidden_states, res.row_id_map, self._state["backend"])
        return permuted, res.permuted_probs

    def _set_state(self, ws, res, num_tokens, hidden, device) -> None:
        backend = permute_backend(self.backend, device)
        self._state = dict(ws=ws, backend=backend, num_tokens=num_tokens, hidden=hidden, res=res)

    def preprocess_tensors(self) -> dict[str, torch.Tensor]:
        """After :meth:`dispatch_preprocess`: the preprocess tensors (besides the permuted
        tokens and probabilities) that :meth:`token_dispatch` and :meth:`combine` read, by
        :class:`~mtp.moe.preprocess.MoEPreprocessResult` field name (Megatron-Core's
        ``cudagraph_attrs``)."""
        if self._state is None:
            raise RuntimeError("preprocess_tensors() needs a dispatch_preprocess() first")
        res = self._state["res"]
        return {
            name: getattr(res, name)
            for name in _RESULT_FIELDS
            if name != "permuted_probs" and getattr(res, name) is not None
        }

    def restore_preprocess(self, num_tokens: int, permuted_tokens, permuted_probs, tensors) -> None:
        """Set the state :meth:`dispatch_preprocess` leaves, from tensors a replayed graph
        produced (``tensors`` as :meth:`preprocess_tensors` named them, for ``num_tokens``
        tokens), so that :meth:`token_dispatch` and :meth:`combine` can follow eagerly."""
        hidden, dev, dtype = permuted_tokens.shape[1], permuted_tokens.device, permuted_tokens.dtype
        ws = self.get_workspace(num_tokens, hidden, dtype, permuted_probs.dtype, dev)
        res = MoEPreprocessResult(permuted_probs=permuted_probs, **tensors)
        self._set_state(ws, res, num_tokens, hidden, dev)

    def token_dispatch(
        self, permuted_tokens: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The second half of :meth:`dispatch` (Megatron-Core's ``token_dispatch`` and
        ``dispatch_postprocess``): dropless ``P > 1``: the count exchange, its one host sync
        and the token all-to-all; with a capacity the fixed-size all-to-alls; then the
        expert-TP gather. Takes what :meth:`dispatch_preprocess` returned; returns what
        :meth:`dispatch` returns."""
        state = self._state
        if state is None or "res" not in state:
            raise RuntimeError("token_dispatch() needs a dispatch_preprocess() first")
        res, ws = state["res"], state["ws"]
        res.permuted_probs = permuted_probs
        if ws.capacity is not None:
            self._check_static(permuted_tokens, permuted_probs, state["num_tokens"])
            return self._dispatch_static(permuted_tokens, res, ws)
        return self._dispatch_dropless(permuted_tokens, res, ws, state["backend"])

    def _distributed(self) -> bool:
        return self.ep_size > 1 or self.etp_size > 1

    def _check_static(self, hidden_states, probs, num_tokens: int) -> None:
        """Capacity mode: one tiny exchange of the metadata before the fixed-size all-to-alls."""
        if self.check_ranks is False or not self._distributed():
            return
        if not data_checks_enabled(True, hidden_states) or is_capturing():
            return
        every = self.check_ranks or settings.current().check_collectives
        if self._static_checked and not every:
            return
        self._static_checked = True
        meta = rank_meta(hidden_states, probs, num_tokens)
        sync = validation_mode(True) == "sync"
        for group, size in ((self.ep_group, self.ep_size), (self.etp_group, self.etp_size)):
            if size > 1:
                rows = all_to_all(meta.view(1, -1).expand(size, -1).contiguous(), group)
                ranks = _group_ranks(group, size)
                if sync:  # typed error naming the values, at the cost of a host sync
                    check_rank_meta(rows.tolist(), ranks, True, "dispatch")
                    continue
                check_values(  # no host sync: a device-side assert (CPU: raises at once)
                    (rows == rows[:1]).all(),
                    f"MoE dispatch: the ranks {ranks} disagree on the token count, hidden size "
                    "or dtypes (a capacity_factor makes every split static, so all ranks need "
                    "the same token count); MTP_VALIDATE=sync names the values",
                    validate=True,
                    error=RankMismatchError,
                    tensors=(rows,),
                )

    def _dispatch_static(self, permuted, res: MoEPreprocessResult, ws: MoEWorkspace):
        local, cap = self.num_local_experts, ws.capacity
        tokens, probs, counts = permuted, res.permuted_probs, res.tokens_per_expert
        rows = cap
        if self.ep_size > 1:
            ep = self.ep_size
            recv = all_to_all(permuted, self.ep_group)
            recv_probs = all_to_all(res.permuted_probs, self.ep_group)
            tokens = recv.view(ep, local, cap, -1).transpose(0, 1).reshape(local * ep * cap, -1)
            probs = recv_probs.view(ep, local, cap).transpose(0, 1).reshape(-1)
            counts, rows = res.local_tokens_per_expert, ep * cap
        if self.etp_size > 1:
            q = self.etp_size
            n = tokens.shape[0]
            tokens = gather_v(tokens, self.etp_group, [n] * q, self.etp_rank)
            probs = gather_v(probs, self.etp_group, [n] * q, self.etp_rank)
            tokens = tokens.view(q, local, rows, -1).transpose(0, 1).reshape(q * n, -1)
            probs = probs.view(q, local, rows).transpose(0, 1).reshape(-1)
            counts = torch.full_like(counts, q * rows)
            self._state["etp_rows"] = rows
        return tokens, counts, probs

    def _dispatch_dropless(self, permuted, res, ws, backend):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self._distributed() and capturing:
            raise RuntimeError(
                "dropless expert parallelism reads the all-to-all split sizes on the host (one "
                "sync per layer) and cannot be captured in a CUDA graph; set capacity_factor "
                "for a static, capturable dispatch (or capture only up to the dispatch)"
            )
        ep, q = self.ep_size, self.etp_size
        check = (
            self.check_ranks is not False
            and self._distributed()
            and data_checks_enabled(True, permuted)
        )
        meta = rank_meta(permuted, res.permuted_probs, self._state["num_tokens"]) if check else None
        ep_meta = etp_meta = None
        if ep > 1:
            recv_counts, ep_meta = exchange_counts(res.tokens_per_expert, ep, self.ep_group, meta)
            res = finish_ep_preprocess(res, recv_counts, ws)
            store_preprocess(res, ws, _EP_FIELDS)
            self._state["res"] = res
            local_counts = res.local_tokens_per_expert
        else:
            local_counts = res.tokens_per_expert
        if q > 1:
            mine = local_counts if meta is None else torch.cat([local_counts, meta])
            gathered = all_to_all(mine.view(1, -1).expand(q, -1).contiguous(), self.etp_group)
            etp_counts = gathered[:, : self.num_local_experts]
            if meta is not None:
                etp_meta = gathered[:, self.num_local_experts :]
        if not self._distributed():
            return permuted, res.tokens_per_expert, res.permuted_probs
        # The one device-to-host sync of the layer: split sizes (and the ranks' metadata).
        host = self._read_sizes(res, ep_meta, etp_counts if q > 1 else None, etp_meta)
        tokens, probs, counts = permuted, res.permuted_probs, res.tokens_per_expert
        if ep > 1:
            tokens, probs = self._ep_exchange(permuted, res, host, backend)
            counts = res.local_tokens_per_expert
        if q > 1:
            sizes = host["etp_sizes"]
            total = sum(sizes)
            tokens = gather_v(tokens, self.etp_group, sizes, self.etp_rank)
            probs = gather_v(probs, self.etp_group, sizes, self.etp_rank)
            order, inverse = _recv_reorder(etp_counts, total)
            self._state.update(etp_sizes=sizes, etp_inverse=inverse)
            tokens = gather_rows(tokens, order, backend)
            probs = probs.index_select(0, order)
            counts = etp_counts.sum(dim=0)
        return tokens, counts, probs

    def _read_sizes(self, res, ep_meta, etp_counts, etp_meta) -> dict:
        ep, q = self.ep_size, self.etp_size
        parts = []
        if ep > 1:
            parts += [res.send_counts, res.recv_counts.sum(dim=1)]
        if etp_counts is not None:
            parts.append(etp_counts.sum(dim=1))
        for m in (ep_meta, etp_meta):
            if m is not None:
                parts.append(m.reshape(-1))
        flat = torch.cat(parts).tolist()
        host, i = {}, 0
        if ep > 1:
            host["send"], host["recv"] = flat[:ep], flat[ep : 2 * ep]
            i = 2 * ep
        if etp_counts is not None:
            host["etp_sizes"] = flat[i : i + q]
            i += q
        for m, size, group in ((ep_meta, ep, self.ep_group), (etp_meta, q, self.etp_group)):
            if m is not None:
                width = m.shape[1]
                rows = [flat[i + r * width : i + (r + 1) * width] for r in range(size)]
                i += size * width
                check_rank_meta(rows, _group_ranks(group, size), False, "dispatch")
        return host

    def _ep_exchange(self, permuted, res, host, backend):
        send, recv_sizes = host["send"], host["recv"]
        received = sum(recv_sizes)
        recv = all_to_all(permuted, self.ep_group, recv_sizes, send)
        recv_probs = all_to_all(res.permuted_probs, self.ep_group, recv_sizes, send)
        order, inverse = res.recv_order[:received], res.recv_inverse[:received]
        if received > res.recv_order.shape[0]:
            # Another rank routed more tokens than this one (the workspace's worst case assumes
            # at most T per rank): reorder for the actual count, now known on the host.
            order, inverse = _recv_reorder(res.recv_counts, received)
        self._state.update(send=send, recv_sizes=recv_sizes, inverse=inverse)
        return gather_rows(recv, order, backend), recv_probs.index_select(0, order)

    # -- combine ------------------------------------------------------------------------------

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Return the expert outputs to their tokens and sum them: ``[T, H]``.

        Args:
            expert_output: ``[M, H]``, rows as returned by :meth:`dispatch` (already scaled by
                the probabilities, as :class:`~mtp.moe.GroupedMLP` does; partial sums over the
                expert-tensor-parallel shards with ``Q > 1``).
        """
        state = self._state
        if state is None:
            raise RuntimeError("combine() needs a dispatch() first")
        res, ws, backend = state["res"], state["ws"], state["backend"]
        shape = (state["num_tokens"], state["hidden"])
        if expert_output.dim() != 2 or expert_output.shape[1] != shape[1]:
            raise ValueError(
                f"expert_output must be [M, {shape[1]}], got {tuple(expert_output.shape)}"
            )
        y = self._combine_etp(expert_output, state, ws, backend)
        if self.ep_size > 1 and ws.capacity is not None:
            ep, local, cap = self.ep_size, self.num_local_experts, ws.capacity
            y = y.view(local, ep, cap, -1).transpose(0, 1).reshape(ep * local * cap, -1)
            y = all_to_all(y, self.ep_group)
        elif self.ep_size > 1:
            y = gather_rows(y, state["inverse"], backend)
            y = all_to_all(y, self.ep_group, state["send"], state["recv_sizes"])
        self._state = None
        out = unpermute(y, res.row_id_map, shape, backend=backend, validate=False)
        if shape[0] == 0 and y.requires_grad and not out.requires_grad:
            # No token here: keep the autograd link anyway, so that this rank's backward still
            # joins the all-to-alls the other ranks run.
            out = out + y.sum() * 0
        return out

    def _combine_etp(self, y, state, ws, backend):
        """``Q > 1``: sum the shards' partial outputs and give each rank its own rows back."""
        q = self.etp_size
        if q == 1:
            return y
        if ws.capacity is not None:
            local, rows = self.num_local_experts, state["etp_rows"]
            y = y.view(local, q, rows, -1).transpose(0, 1).reshape(q * local * rows, -1)
            n = local * rows
            return reduce_scatter_v(y, self.etp_group, [n] * q, self.etp_rank)
        y = gather_rows(y, state["etp_inverse"], backend)
        return reduce_scatter_v(y, self.etp_group, state["etp_sizes"], self.etp_rank)

    # -- Megatron-Core names ------------------------------------------------------------------

    def token_permutation(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron-Core's name for :meth:`dispatch` (``hidden_states`` may be ``[..., H]``)."""
        return self.dispatch(hidden_states.reshape(-1, hidden_states.shape[-1]), probs, routing_map)

    def token_unpermutation(
        self, hidden_states: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """Megatron-Core's name for :meth:`combine`; returns ``(output [T, H], None)``."""
        if bias is not None:
            raise ValueError("token_unpermutation: bias is not supported (add it in the experts)")
        return self.combine(hidden_states), None
