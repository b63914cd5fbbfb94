"""The fused permute / unpermute custom ops and the token-major map they share.

``mtp::moe_permute`` builds the row map on the device (two launches of
:mod:`mtp.kernels.moe_row_map`: count per expert, then scan + place; no sort) and scatters each
token row once to its rows (one launch). Besides Megatron's ``row_id_map`` it returns a
token-major map (the rows of each token, ascending, and their experts): a :class:`TokenMap`,
which the caller carries next to ``row_id_map`` (``permute(..., return_token_map=True)``,
``moe_permute_row_map(..., token_map=True)``) and hands back (``unpermute(...,
token_map=...)``), so that ``unpermute`` and both backwards reuse it instead of inverting the
row map again:

- ``mtp::moe_unpermute``: per-token gather-sum, weights ``probs[t, e_j]`` read token-major
  (one launch);
- permute backward (``mtp::moe_permute_backward``): per-token sum of the row gradients and the
  probs gradient in the same launch;
- unpermute backward (``mtp::moe_unpermute_backward``): each token reads its output gradient
  once and writes its rows' gradients and the probs gradient (one launch).

The map is an ordinary value: it works the same eagerly, under ``torch.compile`` and in a
captured graph. A Triton ``unpermute`` given no map inverts ``row_id_map`` with a sort and says
so once (:func:`say_once`; a compiled call when it is traced).

Integer outputs (maps) are not differentiable; outputs a backward does not need are skipped.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mtp.kernels import moe_permute as _kernels
from mtp.kernels import moe_row_map as _map_kernels
from mtp.utils import empty

__all__ = ["TokenMap", "say_once"]

logger = logging.getLogger("mtp")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenMap:
    """Token-major view of a permutation, built together with its ``row_id_map``: token ``t``
    owns ``count[t]`` rows ``rows[t, :count[t]]`` (ascending) of experts
    ``experts[t, :count[t]]`` (all int32; ``rows``/``experts`` are ``[T, W]``, ``W`` the
    routing's width). ``num_experts``: ``E``; ``drop_and_pad``: the rows are ``E`` blocks of
    ``capacity`` slots. It describes the ``row_id_map`` it came with, as long as that tensor is
    not modified."""

    rows: torch.Tensor
    experts: torch.Tensor
    count: torch.Tensor
    num_experts: int
    drop_and_pad: bool

    @property
    def num_tokens(self) -> int:
        return self.count.shape[0]


_SAID: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


def _log_traced(ctx) -> None:
    """Run by Dynamo while it traces :func:`say_once` (``message`` is a constant there)."""
    _log_once(ctx.get_local("message").as_python_constant())


def say_once(message: str) -> None:
    """Log ``message`` at INFO once per process; under ``torch.compile`` while the call is
    traced (Dynamo's ``comptime``: no graph break, nothing left in the graph)."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_log_traced)
        return
    _log_once(message)


# --------------------------------------------------------------------------------------------
# mtp::moe_permute
# --------------------------------------------------------------------------------------------


def _map_width(routing: torch.Tensor, num_experts: int) -> int:
    return routing.shape[1] if routing.dtype != torch.bool else num_experts


@torch.library.custom_op("mtp::moe_permute", mutates_args=())
def _permute_op(
    tokens: torch.Tensor,
    routing: torch.Tensor,
    probs: torch.Tensor | None,
    num_out_tokens: int,
    num_experts: int,
    capacity: int,
    zero_empty: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """``(permuted, permuted_probs ([0] without probs), row_id_map, token_rows, token_experts,
    token_count, ok)``; ``capacity < 0``: dropless."""
    device, (num_tokens, hidden), n = tokens.device, tokens.shape, num_out_tokens
    width = _map_width(routing, num_experts)
    row_id_map = empty((n,), dtype=torch.int64, device=device)
    pprobs = empty((n if probs is not None else 0,),
                   dtype=probs.dtype if probs is not None else tokens.dtype, device=device)
    rows = empty((num_tokens, width), dtype=torch.int32, device=device)
    experts = empty((num_tokens, width), dtype=torch.int32, device=device)
    count = empty((num_tokens,), dtype=torch.int32, device=device)
    ok = empty((), dtype=torch.bool, device=device)
    _map_kernels.build_row_map(
        routing.contiguous(), num_experts, n, capacity=capacity if capacity >= 0 else None,
        probs=None if probs is None else probs.contiguous(), row_id_map=row_id_map, pair=None,
        permuted_probs=pprobs if probs is not None else None, token_rows=rows,
        token_experts=experts, token_count=count, status=ok,
    )  # fmt: skip
    permuted = empty((n, hidden), dtype=tokens.dtype, device=device)
    _kernels.scatter_tokens(tokens.contiguous(), rows, count, row_id_map, permuted,
                            zero_empty=zero_empty)
    return permuted, pprobs, row_id_map, rows, experts, count, ok


@_permute_op.register_fake
def _(tokens, routing, probs, num_out_tokens, num_experts, capacity, zero_empty):
    n, (num_tokens, hidden) = num_out_tokens, tokens.shape
    width = _map_width(routing, num_experts)
    i32 = dict(dtype=torch.int32)
    return (
        tokens.new_empty((n, hidden)),
        tokens.new_empty((n if probs is not None else 0,),
                         dtype=probs.dtype if probs is not None else tokens.dtype),
        tokens.new_empty((n,), dtype=torch.int64),
        tokens.new_empty((num_tokens, width), **i32),
        tokens.new_empty((num_tokens, width), **i32),
        tokens.new_empty((num_tokens,), **i32),
        tokens.new_empty((), dtype=torch.bool),
    )  # fmt: skip


@torch.library.custom_op("mtp::moe_permute_backward", mutates_args=())
def _permute_backward_op(
    grad_permuted: torch.Tensor | None,
    grad_permuted_probs: torch.Tensor | None,
    token_rows: torch.Tensor,
    token_experts: torch.Tensor,
    token_count: torch.Tensor,
    hidden: int,
    num_experts: int,
    dtype: torch.dtype,
    probs_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_tokens [T, H] (or [T, 0]), grad_probs [T, E] (or [T, 0]))`` in one launch."""
    num_tokens, device = token_count.shape[0], token_count.device
    need_x, need_p = grad_permuted is not None, grad_permuted_probs is not None
    gx = empty((num_tokens, hidden if need_x else 0), dtype=dtype, device=device)
    gp = empty((num_tokens, num_experts if need_p else 0), dtype=probs_dtype, device=device)
    src = grad_permuted.contiguous() if need_x else gx
    _kernels.combine_tokens(
        src, token_rows, token_experts, token_count, gx,
        grad_permuted_probs=grad_permuted_probs.contiguous() if need_p else None,
        grad_probs=gp if need_p else None,
    )  # fmt: skip
    return gx, gp


@_permute_backward_op.register_fake
def _(grad_permuted, grad_permuted_probs, token_rows, token_experts, token_count, hidden,
      num_experts, dtype, probs_dtype):
    num_tokens = token_count.shape[0]
    return (
        token_count.new_empty((num_tokens, hidden if grad_permuted is not None else 0),
                              dtype=dtype),
        token_count.new_empty((num_tokens, num_experts if grad_permuted_probs is not None
                               else 0), dtype=probs_dtype),
    )  # fmt: skip


def _permute_setup(ctx, inputs, output):
    tokens, _, probs, _, num_experts, _, _ = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[3:6])
    ctx.meta = (tokens.shape[1], num_experts, tokens.dtype,
                probs.dtype if probs is not None else tokens.dtype)


def _permute_backward(ctx, g_permuted, g_pprobs, *_):
    rows, experts, count = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0] and g_permuted is not None
    need_p = ctx.needs_input_grad[2] and g_pprobs is not None
    if not (need_x or need_p):
        return None, None, None, None, None, None, None
    gx, gp = torch.ops.mtp.moe_permute_backward(
        g_permuted if need_x else None, g_pprobs if need_p else None, rows, experts, count,
        *ctx.meta,
    )
    return gx if need_x else None, None, gp if need_p else None, None, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("mtp::moe_row_map", mutates_args=())
def _row_map_op(
    routing_map: torch.Tensor, num_out_tokens: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_id_map, pair, token_rows, token_experts, token_count)`` of a ``[T, E]`` bool
    routing map (``capacity < 0``: dropless); two launches, no checks."""
    device, (num_tokens, num_experts), n = routing_map.device, routing_map.shape, num_out_tokens
    row_id_map = empty((n,), dtype=torch.int64, device=device)
    pair = empty((n,), dtype=torch.int64, device=device)
    rows = empty((num_tokens, num_experts), dtype=torch.int32, device=device)
    experts = empty((num_tokens, num_experts), dtype=torch.int32, device=device)
    count = empty((num_tokens,), dtype=torch.int32, device=device)
    ok = empty((), dtype=torch.bool, device=device)
    _map_kernels.build_row_map(
        routing_map.contiguous(), num_experts, n, capacity=capacity if capacity >= 0 else None,
        probs=None, row_id_map=row_id_map, pair=pair, permuted_probs=None, token_rows=rows,
        token_experts=experts, token_count=count, status=ok,
    )  # fmt: skip
    return row_id_map, pair, rows, experts, count


@_row_map_op.register_fake
def _(routing_map, num_out_tokens, capacity):
    (num_tokens, num_experts), n = routing_map.shape, num_out_tokens
    i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
    return (
        routing_map.new_empty((n,), **i64),
        routing_map.new_empty((n,), **i64),
        routing_map.new_empty((num_tokens, num_experts), **i32),
        routing_map.new_empty((num_tokens, num_experts), **i32),
        routing_map.new_empty((num_tokens,), **i32),
    )


# --------------------------------------------------------------------------------------------
# mtp::moe_unpermute
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("mtp::moe_unpermute", mutates_args=())
def _unpermute_op(
    permuted: torch.Tensor,
    token_rows: torch.Tensor,
    token_experts: torch.Tensor,
    token_count: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
) -> torch.Tensor:
    """``out[t] = sum_j probs[t, e_j] * permuted[r_j]`` (fp32, ascending rows), one launch."""
    out = empty((token_count.shape[0], permuted.shape[1]), dtype=permuted.dtype,
                device=permuted.device)
    _kernels.combine_tokens(permuted.contiguous(), token_rows, token_experts, token_count, out,
                            probs=None if probs is None else probs.contiguous())
    return out


@_unpermute_op.register_fake
def _(permuted, token_rows, token_experts, token_count, row_id_map, probs):
    return permuted.new_empty((token_count.shape[0], permuted.shape[1]))


@torch.library.custom_op("mtp::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(
    grad: torch.Tensor,
    permuted: torch.Tensor | None,
    token_rows: torch.Tensor,
    token_experts: torch.Tensor,
    token_count: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    need_permuted: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_permuted [N, H] (or [0, H]), grad_probs [T, E] (or [0, E]))``, one launch;
    ``grad_probs`` needs ``permuted`` (pass None to skip it)."""
    n, (num_tokens, hidden) = row_id_map.shape[0], grad.shape
    num_experts = probs.shape[1] if probs is not None else 0
    gx = empty((n if need_permuted else 0, hidden), dtype=grad.dtype, device=grad.device)
    need_p = permuted is not None and probs is not None
    gp = empty((num_tokens if need_p else 0, num_experts),
               dtype=probs.dtype if probs is not None else grad.dtype, device=grad.device)
    _kernels.unpermute_backward(
        grad.contiguous(), permuted.contiguous() if need_p else grad, token_rows,
        token_experts, token_count, row_id_map,
        probs=None if probs is None else probs.contiguous(),
        grad_x=gx if need_permuted else None, grad_probs=gp if need_p else None,
    )  # fmt: skip
    return gx, gp


@_unpermute_backward_op.register_fake
def _(grad, permuted, token_rows, token_experts, token_count, row_id_map, probs,
      need_permuted):
    n, (num_tokens, hidden) = row_id_map.shape[0], grad.shape
    num_experts = probs.shape[1] if probs is not None else 0
    need_p = permuted is not None and probs is not None
    return (
        grad.new_empty((n if need_permuted else 0, hidden)),
        grad.new_empty((num_tokens if need_p else 0, num_experts),
                       dtype=probs.dtype if probs is not None else grad.dtype),
    )  # fmt: skip


def _unpermute_setup(ctx, inputs, output):
    permuted, rows, experts, count, row_id_map, probs = inputs
    need_p = probs is not None and ctx.needs_input_grad[5]
    ctx.save_for_backward(permuted if need_p else None, rows, experts, count, row_id_map, probs)


def _unpermute_backward(ctx, grad):
    permuted, rows, experts, count, row_id_map, probs = ctx.saved_tensors
    need_x, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[5]
    if not (need_x or need_p):
        return None, None, None, None, None, None
    gx, gp = torch.ops.mtp.moe_unpermute_backward(
        grad, permuted if need_p else None, rows, experts, count, row_id_map, probs, need_x
    )
    return gx if need_x else None, None, None, None, None, gp if need_p else None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
