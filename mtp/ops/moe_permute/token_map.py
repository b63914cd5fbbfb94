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
captured graph. A Triton ``unpermute`` given no map inverts ``row_id_map`` first
(:mod:`mtp.ops.moe_permute.invert`) and says so once (:func:`say_once`; a compiled call when it
is traced). :class:`Permute` and :class:`Unpermute` are the eager path's autograd functions over
the same bodies (:func:`permute_impl`, :func:`unpermute_impl`) and backwards.

Integer outputs (maps) are not differentiable; outputs a backward does not need are skipped.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mtp import settings
from mtp.kernels import moe_row_map as _map_kernels
from mtp.kernels._launch import Plans, aligned
from mtp.kernels import moe_token_major as _kernels
from mtp.ops._eager import eager
from mtp.utils import empty

__all__ = [
    "Permute",
    "TokenMap",
    "Unpermute",
    "backward_meta",
    "log_once",
    "permute_backward_impl",
    "permute_impl",
    "permute_grads",
    "permute_plan",
    "run_permute",
    "row_map_impl",
    "say_once",
    "unpermute_backward_impl",
    "unpermute_impl",
]

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


def log_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


def _log_traced(ctx) -> None:
    """Run by Dynamo while it traces :func:`say_once` (``message`` is a constant there)."""
    log_once(ctx.get_local("message").as_python_constant())


def say_once(message: str) -> None:
    """Log ``message`` at INFO once per process; under ``torch.compile`` while the call is
    traced (Dynamo's ``comptime``: no graph break, nothing left in the graph)."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_log_traced)
        return
    log_once(message)


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
    return permute_impl(tokens, routing, probs, num_out_tokens, num_experts, capacity, zero_empty)


_PLANS = Plans()


def poisoned_empty(*shape, dtype, device):
    """``torch.empty(*shape)`` (or ``torch.empty(())``) poisoned: the ``poison_outputs``
    setting."""
    return empty(shape if shape != ((),) else (), dtype=dtype, device=device)


def permute_impl(tokens, routing, probs, num_out_tokens, num_experts, capacity, zero_empty):
    """The body of ``mtp::moe_permute`` (the custom op's and the eager path's)."""
    tokens, routing = tokens.contiguous(), routing.contiguous()
    probs = None if probs is None else probs.contiguous()
    key = (tokens.shape, tokens.dtype, routing.shape, routing.dtype,
           None if probs is None else probs.dtype, num_out_tokens, num_experts, capacity,
           zero_empty, aligned(tokens, routing, probs), tokens.device)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, permute_plan(tokens, routing, probs, num_out_tokens, num_experts,
                                            capacity, zero_empty))  # fmt: skip
    return run_permute(plan, tokens, routing, probs, num_out_tokens, num_experts)


def permute_plan(tokens, routing, probs, num_out_tokens, num_experts, capacity, zero_empty):
    """The three launches of :func:`permute_impl` for contiguous arguments like these (same
    shapes, dtypes, alignment and options), for :func:`run_permute`."""
    out = _permute_outputs(tokens, routing, probs, num_out_tokens, num_experts)
    permuted, pprobs, row_id_map, rows, experts, count, ok = out
    cap = capacity if capacity >= 0 else None
    row_map = _map_kernels.row_map_plan(routing, num_experts, num_out_tokens, cap, probs,
                                        row_id_map, None, pprobs if probs is not None else None,
                                        rows, experts, count, ok)  # fmt: skip
    return row_map, _kernels.scatter_plan(tokens, rows, count, row_id_map, permuted, zero_empty)


def run_permute(plan, tokens, routing, probs, num_out_tokens, num_experts):
    """:func:`permute_impl` on contiguous arguments with their :func:`permute_plan` (its
    outputs are fresh allocations: 16-byte aligned, as the plan's were)."""
    out = _permute_outputs(tokens, routing, probs, num_out_tokens, num_experts)
    permuted, pprobs, row_id_map, rows, experts, count, ok = out
    row_map, scatter = plan
    _map_kernels.run_row_map(row_map, routing, probs, row_id_map, None,
                             pprobs if probs is not None else None, rows, experts, count, ok)
    if scatter is not None:
        _kernels.run_scatter(scatter, tokens, rows, count, row_id_map, permuted)
    return out


def _permute_outputs(tokens, routing, probs, n, num_experts) -> tuple:
    device, (num_tokens, hidden) = tokens.device, tokens.shape
    width = routing.shape[1] if routing.dtype != torch.bool else num_experts
    new = poisoned_empty if settings.current().poison_outputs else torch.empty
    i32 = torch.int32
    return (
        new(n, hidden, dtype=tokens.dtype, device=device),
        new(n if probs is not None else 0,
            dtype=probs.dtype if probs is not None else tokens.dtype, device=device),
        new(n, dtype=torch.int64, device=device),
        new(num_tokens, width, dtype=i32, device=device),
        new(num_tokens, width, dtype=i32, device=device),
        new(num_tokens, dtype=i32, device=device),
        new((), dtype=torch.bool, device=device),
    )  # fmt: skip


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
    return permute_backward_impl(grad_permuted, grad_permuted_probs, token_rows, token_experts,
                                 token_count, hidden, num_experts, dtype, probs_dtype)


def permute_backward_impl(grad_permuted, grad_permuted_probs, token_rows, token_experts,
                          token_count, hidden, num_experts, dtype, probs_dtype):
    """The body of ``mtp::moe_permute_backward``."""
    num_tokens, device = token_count.shape[0], token_count.device
    need_x, need_p = grad_permuted is not None, grad_permuted_probs is not None
    new = poisoned_empty if settings.current().poison_outputs else torch.empty
    gx = new(num_tokens, hidden if need_x else 0, dtype=dtype, device=device)
    gp = new(num_tokens, num_experts if need_p else 0, dtype=probs_dtype, device=device)
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
    ctx.meta = backward_meta(tokens, probs, num_experts)


def backward_meta(tokens, probs, num_experts) -> tuple:
    """The non-tensor arguments of ``mtp::moe_permute_backward``."""
    return (tokens.shape[1], num_experts, tokens.dtype,
            probs.dtype if probs is not None else tokens.dtype)


def _permute_backward(ctx, g_permuted, g_pprobs, *_):
    need_x = ctx.needs_input_grad[0] and g_permuted is not None
    need_p = ctx.needs_input_grad[2] and g_pprobs is not None
    if not (need_x or need_p):
        return None, None, None, None, None, None, None
    gx, gp = permute_grads(ctx.saved_tensors, ctx.meta, need_x, need_p, g_permuted, g_pprobs)
    return gx, None, gp, None, None, None, None


def permute_grads(maps, meta, need_x, need_p, g_permuted, g_pprobs):
    """``(grad of tokens, grad of probs)`` (None where not needed) of a permute's outputs, from
    its token map ``(rows, experts, count)`` and :func:`backward_meta`."""
    rows, experts, count = maps
    args = (g_permuted if need_x else None, g_pprobs if need_p else None, rows, experts, count,
            *meta)
    if _eager_backward(*args[:2]):
        gx, gp = permute_backward_impl(*args)
    else:
        gx, gp = torch.ops.mtp.moe_permute_backward(*args)
    return gx if need_x else None, gp if need_p else None


def _eager_backward(*grads) -> bool:
    """A backward may call the op bodies directly: eager (see :func:`mtp.ops._eager.eager`) and
    not building a graph of the backward (``create_graph=True`` keeps the custom ops)."""
    return not torch.is_grad_enabled() and eager(*grads)


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


class Permute(torch.autograd.Function):
    """The eager path's autograd of :func:`run_permute` (the custom op's formulas and
    bodies): ``apply(tokens, probs, (plan, routing, n, num_experts, with_p, maps))`` (contiguous
    tensors) returns ``permuted`` and appends the other six outputs to ``maps``; with
    ``with_p`` (probs needs a gradient) it returns ``(permuted, permuted_probs)`` and appends
    the other five. The token map is kept on ``ctx`` (not an input or output)."""

    @staticmethod
    def forward(ctx, tokens, probs, spec):
        plan, routing, n, num_experts, with_p, maps = spec
        out = run_permute(plan, tokens, routing, probs, n, num_experts)
        ctx.maps = out[3:6]
        ctx.meta = (tokens.shape[1], num_experts, tokens.dtype,
                    probs.dtype if probs is not None else tokens.dtype)  # backward_meta
        if with_p:
            ctx.set_materialize_grads(False)
            maps.extend(out[2:])
            return out[0], out[1]
        maps.extend(out[1:])
        return out[0]

    @staticmethod
    def backward(ctx, g_permuted, g_pprobs=None):
        need_x = ctx.needs_input_grad[0] and g_permuted is not None
        need_p = ctx.needs_input_grad[1] and g_pprobs is not None
        if not (need_x or need_p):
            return None, None, None
        return (*permute_grads(ctx.maps, ctx.meta, need_x, need_p, g_permuted, g_pprobs), None)


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
    return unpermute_impl(permuted, token_rows, token_experts, token_count, probs)


def unpermute_impl(permuted, token_rows, token_experts, token_count, probs):
    """The body of ``mtp::moe_unpermute``."""
    new = poisoned_empty if settings.current().poison_outputs else torch.empty
    out = new(token_count.shape[0], permuted.shape[1], dtype=permuted.dtype,
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
    return unpermute_backward_impl(grad, permuted, token_rows, token_experts, token_count,
                                   row_id_map, probs, need_permuted)


def unpermute_backward_impl(grad, permuted, token_rows, token_experts, token_count, row_id_map,
                            probs, need_permuted):
    """The body of ``mtp::moe_unpermute_backward``."""
    n, (num_tokens, hidden) = row_id_map.shape[0], grad.shape
    num_experts = probs.shape[1] if probs is not None else 0
    new = poisoned_empty if settings.current().poison_outputs else torch.empty
    gx = new(n if need_permuted else 0, hidden, dtype=grad.dtype, device=grad.device)
    need_p = permuted is not None and probs is not None
    gp = new(num_tokens if need_p else 0, num_experts,
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
    gx, gp = _unpermute_grads(grad, permuted, probs, (rows, experts, count, row_id_map), need_x,
                              need_p)  # fmt: skip
    return gx, None, None, None, None, gp


def _unpermute_grads(grad, permuted, probs, maps, need_x, need_p):
    """``(grad of permuted, grad of probs)`` (None where not needed) of an unpermute, from its
    ``(token_rows, token_experts, token_count, row_id_map)``."""
    if not (need_x or need_p):
        return None, None
    args = (grad, permuted if need_p else None, *maps, probs, need_x)
    if _eager_backward(grad):
        gx, gp = unpermute_backward_impl(*args)
    else:
        gx, gp = torch.ops.mtp.moe_unpermute_backward(*args)
    return gx if need_x else None, gp if need_p else None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


class Unpermute(torch.autograd.Function):
    """The eager path's autograd of :func:`unpermute_impl`: ``apply(permuted, probs,
    (token_rows, token_experts, token_count, row_id_map))``, as ``mtp::moe_unpermute`` (the
    maps kept on ``ctx``: not differentiable)."""

    @staticmethod
    def forward(ctx, permuted, probs, maps):
        ctx.maps = maps
        if probs is not None and ctx.needs_input_grad[1]:
            ctx.save_for_backward(permuted, probs)
        else:
            ctx.save_for_backward(None, probs)
        return unpermute_impl(permuted, maps[0], maps[1], maps[2], probs)

    @staticmethod
    def backward(ctx, grad):
        permuted, probs = ctx.saved_tensors
        need = ctx.needs_input_grad
        return (*_unpermute_grads(grad, permuted, probs, ctx.maps, need[0], need[1]), None)
