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

import torch
import torch.distributed as dist

from mtp.moe.preprocess import (
    MoEPreprocessResult,
    _recv_reorder,
    check_routing,
    compute_preprocess,
    store_preprocess,
)
from mtp.moe.workspace import MoEWorkspace
from mtp.ops._backend import resolve_backend
from mtp.ops.moe_permute import unpermute
from mtp.utils import is_fake

__all__ = ["AllToAllTokenDispatcher", "all_to_all"]

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
    ) -> None:
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
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
        new = MoEWorkspace(
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
        if ws is not None:
            logger.info(
                "MoE dispatcher: rebuilding the workspace for %d tokens (was %d): %s",
                num_tokens,
                ws.num_tokens,
                new,
            )
        self.workspace = new
        return new

    def _workspace_for(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> MoEWorkspace:
        args = (hidden_states.shape[0], hidden_states.shape[1], hidden_states.dtype, probs.dtype)
        if is_fake(hidden_states):
            # Tracing with fake tensors: a throwaway workspace (never keep fake buffers).
            return MoEWorkspace(
                args[0],
                args[1],
                self.num_experts,
                self.topk,
                ep_size=self.ep_size,
                capacity_factor=self.capacity_factor,
                dtype=args[2],
                probs_dtype=args[3],
                device=hidden_states.device,
            )
        return self.get_workspace(*args, device=hidden_states.device)

    # -- dispatch / combine -------------------------------------------------------------------

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
            ``L * P * C`` (capacity) or the received count (dropless ``P > 1``).
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
        res = compute_preprocess(routing_map, probs, ws, self.ep_group)
        store_preprocess(res, ws)
        backend = permute_backend(self.backend, hidden_states.device)
        permuted = gather_rows(hidden_states, res.row_id_map, backend)
        self._state = dict(
            ws=ws,
            res=res,
            backend=backend,
            num_tokens=hidden_states.shape[0],
            hidden=hidden_states.shape[1],
        )
        if self.ep_size == 1:
            return permuted, res.tokens_per_expert, res.permuted_probs
        if ws.capacity is not None:
            return self._dispatch_static(permuted, res, ws)
        return self._dispatch_dropless(permuted, res, backend)

    def _dispatch_static(self, permuted, res: MoEPreprocessResult, ws: MoEWorkspace):
        ep, local, cap = self.ep_size, self.num_local_experts, ws.capacity
        recv = all_to_all(permuted, self.ep_group)
        recv_probs = all_to_all(res.permuted_probs, self.ep_group)
        tokens = recv.view(ep, local, cap, -1).transpose(0, 1).reshape(local * ep * cap, -1)
        probs = recv_probs.view(ep, local, cap).transpose(0, 1).reshape(-1)
        return tokens, res.local_tokens_per_expert, probs

    def _dispatch_dropless(self, permuted, res: MoEPreprocessResult, backend: str):
        ep = self.ep_size
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "dropless expert parallelism reads the all-to-all split sizes on the host (one "
                "sync per layer) and cannot be captured in a CUDA graph; set capacity_factor "
                "for a static, capturable dispatch (or capture only up to the dispatch)"
            )
        # The one device-to-host sync of the layer: split sizes for the token all-to-all.
        splits = torch.cat([res.send_counts, res.recv_counts.sum(dim=1)]).tolist()
        send, recv_sizes = splits[:ep], splits[ep:]
        received = sum(recv_sizes)
        recv = all_to_all(permuted, self.ep_group, recv_sizes, send)
        recv_probs = all_to_all(res.permuted_probs, self.ep_group, recv_sizes, send)
        order, inverse = res.recv_order[:received], res.recv_inverse[:received]
        if received > res.recv_order.shape[0]:
            # Another rank routed more tokens than this one (the workspace's worst case assumes
            # at most T per rank): reorder for the actual count, now known on the host.
            order, inverse = _recv_reorder(res.recv_counts, received)
        self._state.update(send=send, recv_sizes=recv_sizes, received=received, inverse=inverse)
        tokens = gather_rows(recv, order, backend)
        probs = recv_probs.index_select(0, order)
        return tokens, res.local_tokens_per_expert, probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Return the expert outputs to their tokens and sum them: ``[T, H]``.

        Args:
            expert_output: ``[M, H]``, rows as returned by :meth:`dispatch` (already scaled by
                the probabilities, as :class:`~mtp.moe.GroupedMLP` does).
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
        y = expert_output
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
