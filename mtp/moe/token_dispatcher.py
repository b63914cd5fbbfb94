"""Expert-parallel token dispatch and combine: :class:`AllToAllTokenDispatcher`.

``dispatch(hidden_states [T, H], probs [T, E], routing_map [T, E])`` returns the rows this rank's
experts must process, grouped by local expert, with their counts and probabilities;
``combine(expert_output)`` brings the results back and sums them per token.

Steps (``P`` expert-parallel ranks, ``L = E / P`` local experts):

1. :func:`mtp.moe.preprocess` into the dispatcher's :class:`~mtp.moe.MoEWorkspace` (counts,
   row map, permuted probs; for ``P > 1`` dropless, a device all-to-all of the per-expert counts).
2. Permute: gather the token rows in expert-major order (``mtp.ops`` permute kernel).
3. ``P > 1``: ``all_to_all_single`` of the rows and of their probabilities, then reorder the
   received rows from source-major to expert-major (index computed in step 1).
4. ``combine``: the inverse reorder, the reverse all-to-all, and :func:`mtp.ops.unpermute` (a
   deterministic per-token sum of the expert outputs).

Host synchronisation:

- ``P == 1``, or any ``P`` with ``capacity_factor``: none. With a capacity every expert owns
  ``C`` slots, so every split size is ``L * C`` rows, known on the host in advance; the whole
  dispatch is graph-safe.
- ``P > 1`` dropless: exactly **one** device-to-host copy per layer, of the ``2 * P`` split sizes
  (rows sent to and received from each rank), placed right before the token all-to-all (after
  the permutation is queued, as late as possible, like Megatron-Core's ``before_ep_alltoall``
  sync point). ``all_to_all_single`` needs the split sizes as host integers; the backward reuses
  them (no sync there).

Collectives per forward (``torch.distributed.all_to_all_single`` on the EP group): dropless 4
(counts, tokens, probs, combine), capacity 3, none for ``P == 1``; the backward runs one
all-to-all per forward token/probs/combine exchange.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from mtp.moe.preprocess import (
    MoEPreprocessResult,
    _recv_reorder,
    check_routing,
    exchange_counts,
    finish_ep_preprocess,
    local_preprocess,
    store_preprocess,
)
from mtp.moe.workspace import MoEWorkspace
from mtp.ops._backend import resolve_backend
from mtp.ops.moe_permute import unpermute
from mtp.parallel.errors import RankMismatchError
from mtp.utils import data_checks_enabled, is_capturing, is_fake

__all__ = [
    "AllToAllTokenDispatcher",
    "RankMismatchError",
    "all_to_all",
    "gather_v",
    "reduce_scatter_v",
]

logger = logging.getLogger("mtp")

_PERMUTE_BACKENDS = ("triton", "reference")


def permute_backend(backend: str, device: torch.device) -> str:
    """The permute/unpermute backend for a layer backend name (grouped-GEMM-only names such as
    ``"sequential"`` fall back to ``"auto"``)."""
    name = backend if backend in _PERMUTE_BACKENDS else "auto"
    return resolve_backend("permute", name, device, _PERMUTE_BACKENDS)


def gather_rows(x: torch.Tensor, index: torch.Tensor, backend: str) -> torch.Tensor:
    """``out[i] = x[index[i]]`` (zero row where ``index[i] < 0``); differentiable in ``x``."""
    if backend == "triton":
        return torch.ops.mtp.moe_gather_rows(x, index, None)
    valid = (index >= 0).unsqueeze(1)
    if x.shape[0] == 0:  # nothing to gather; keep the autograd link (collectives hang on it)
        x = torch.cat([x, x.new_zeros((1, x.shape[1]))])
    rows = x.index_select(0, index.clamp(min=0))
    return torch.where(valid, rows, rows.new_zeros(()))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with its adjoint as backward (the reverse exchange)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.in_rows = x.shape[0]
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        if not is_fake(x):  # tracing: shapes only
            dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_in = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        if not is_fake(grad):
            dist.all_to_all_single(
                grad_in, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group
            )
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (equal splits when None)."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


def gather_v(x: torch.Tensor, group, sizes: list[int], rank: int) -> torch.Tensor:
    """Differentiable all-gather along dim 0 of ``sizes[r]`` rows from each rank ``r`` (backward:
    the reduce-scatter), as an ``all_to_all_single`` of ``x`` sent to every rank."""
    world = len(sizes)
    return all_to_all(torch.cat([x] * world), group, list(sizes), [sizes[rank]] * world)


def reduce_scatter_v(y: torch.Tensor, group, sizes: list[int], rank: int) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0: rank ``r`` gets the sum over the ranks of their
    ``sizes[r]`` rows at offset ``sum(sizes[:r])`` (backward: :func:`gather_v`)."""
    world = len(sizes)
    mine = sizes[rank]
    out = all_to_all(y, group, [mine] * world, list(sizes))
    return out.view(world, mine, *y.shape[1:]).sum(dim=0)


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_META_NAMES = ("token count", "hidden size", "hidden_states dtype", "probs dtype")


def _dtype_name(code: int) -> str:
    for dtype, c in _DTYPE_CODES.items():
        if c == code:
            return str(dtype)
    return f"code {code}"


def rank_meta(hidden_states: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``[4]`` int64 on the device: token count, hidden size and the dtype codes of the tokens
    and the probabilities (what every rank of a token exchange must agree on)."""
    values = [
        hidden_states.shape[0],
        hidden_states.shape[1],
        _DTYPE_CODES.get(hidden_states.dtype, 0),
        _DTYPE_CODES.get(probs.dtype, 0),
    ]
    return torch.tensor(values, dtype=torch.int64).to(hidden_states.device, non_blocking=True)


def check_rank_meta(rows: list[list[int]], ranks: list[int], same_tokens: bool, what: str) -> None:
    """Raise :class:`RankMismatchError` (on every rank: each holds every row) unless the ranks
    agree on the hidden size and dtypes, and on the token count when ``same_tokens``."""
    for i, name in enumerate(_META_NAMES):
        if i == 0 and not same_tokens:
            continue
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = [_dtype_name(v) for v in values] if i >= 2 else values
            pairs = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, shown))
            raise RankMismatchError(
                f"MoE {what}: the ranks of the group disagree on the {name} ({pairs}); every "
                "rank must pass the same " + name + (
                    " (a capacity_factor makes every split static, so all ranks need the same "
                    "token count)" if i == 0 else ""
                )
            )


def _group_ranks(group, size: int) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - only for the message
        return list(range(size))


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
            all-to-all and a host sync: ``None`` (default) checks the first dispatch only, or
            every dispatch under ``MTP_CHECK_COLLECTIVES=1``; ``True`` every dispatch; ``False``
            never. Skipped while capturing or compiling.

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
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.etp_size = 1 if etp_group is None else dist.get_world_size(etp_group)
        self.etp_rank = 0 if etp_group is None else dist.get_rank(etp_group)
        self.etp_group = etp_group if self.etp_size > 1 else None
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel size "
                f"{self.ep_size}"
            )
        if topk > num_experts:
            raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
        self.num_experts, self.topk = num_experts, topk
        self.num_local_experts = num_experts // self.ep_size
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
        """Send each routed (token, expert) row to the rank that holds the expert.

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
        backend = permute_backend(self.backend, hidden_states.device)
        self._state = dict(
            ws=ws, backend=backend, num_tokens=hidden_states.shape[0], hidden=hidden_states.shape[1]
        )
        if ws.capacity is not None:
            self._check_static(hidden_states, probs)
            store_preprocess(res, ws)  # fixed-address copies; ``res`` keeps the autograd link
            self._state["res"] = res
            permuted = gather_rows(hidden_states, res.row_id_map, backend)
            return self._dispatch_static(permuted, res, ws)
        return self._dispatch_dropless(hidden_states, probs, res, ws, backend)

    def _distributed(self) -> bool:
        return self.ep_size > 1 or self.etp_size > 1

    def _check_static(self, hidden_states, probs) -> None:
        """Capacity mode: one tiny exchange of the metadata before the fixed-size all-to-alls."""
        if self.check_ranks is False or not self._distributed():
            return
        if not data_checks_enabled(True, hidden_states) or is_capturing():
            return
        every = self.check_ranks or os.environ.get("MTP_CHECK_COLLECTIVES", "0") not in ("", "0")
        if self._static_checked and not every:
            return
        self._static_checked = True
        meta = rank_meta(hidden_states, probs)
        for group, size in ((self.ep_group, self.ep_size), (self.etp_group, self.etp_size)):
            if size > 1:
                rows = all_to_all(meta.view(1, -1).expand(size, -1).contiguous(), group)
                check_rank_meta(rows.tolist(), _group_ranks(group, size), True, "dispatch")

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

    def _dispatch_dropless(self, hidden_states, probs, res, ws, backend):
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
            and data_checks_enabled(True, hidden_states)
        )
        meta = rank_meta(hidden_states, probs) if check else None
        ep_meta = etp_meta = None
        if ep > 1:
            recv_counts, ep_meta = exchange_counts(res.tokens_per_expert, ep, self.ep_group, meta)
            res = finish_ep_preprocess(res, recv_counts, ws)
            local_counts = res.local_tokens_per_expert
        else:
            local_counts = res.tokens_per_expert
        store_preprocess(res, ws)
        self._state["res"] = res
        permuted = gather_rows(hidden_states, res.row_id_map, backend)
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
