"""The row-kernel custom ops behind :func:`mtp.ops.unpermute` when no token map is given and
behind the MoE dispatchers' row gathers: ``mtp::moe_gather_rows`` (``out[i] = scale[i] *
x[index[i]]``), ``mtp::moe_combine_rows`` (per-token gather-sum of the rows mapped to each
token, after inverting ``index`` on the device with a sort) and ``mtp::moe_gather_rows_dot``
(their shared backward); each the other's adjoint, with fakes and autograd."""

from __future__ import annotations

import torch

from mtp.kernels import moe_permute as _kernels
from mtp.utils import empty

__all__: list[str] = []


# --------------------------------------------------------------------------------------------
# Custom ops: the two data movements, each the other's adjoint
# --------------------------------------------------------------------------------------------


def _token_major(index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert ``index`` (row -> token): ``rows`` grouped by token, ascending row within a token,
    and ``offsets[T + 1]`` (token ``t`` owns ``rows[offsets[t]:offsets[t + 1]]``). Rows whose
    index is outside ``[0, T)`` are left out. Static shapes, no host sync."""
    index = index.to(torch.int64)
    valid = (index >= 0) & (index < num_tokens)
    keys = torch.where(valid, index, torch.full_like(index, num_tokens))
    sorted_keys, rows = torch.sort(keys, stable=True)
    bounds = torch.arange(num_tokens + 1, device=index.device, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_keys, bounds)
    return rows, offsets


@torch.library.custom_op("mtp::moe_gather_rows", mutates_args=())
def _gather_rows_op(x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``out[i] = scale[i] * x[index[i]]`` (zero row where ``index[i]`` is outside ``[0, M)``)."""
    x = x.contiguous()
    out = empty((index.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _kernels.gather_rows(
        x, index.contiguous(), out, scale=None if scale is None else scale.contiguous()
    )
    return out


@_gather_rows_op.register_fake
def _(x, index, scale):
    return x.new_empty((index.shape[0], x.shape[1]))


@torch.library.custom_op("mtp::moe_combine_rows", mutates_args=())
def _combine_rows_op(
    x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, num_tokens: int
) -> torch.Tensor:
    """``out[t] = sum_{i: index[i] == t} weight[i] * x[i]``: per-token gather, fp32 sum in
    ascending ``i``, deterministic."""
    x = x.contiguous()
    rows, offsets = _token_major(index, num_tokens)
    out = empty((num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    _kernels.combine_rows(
        x, rows, offsets, out, weight=None if weight is None else weight.contiguous()
    )
    return out


@_combine_rows_op.register_fake
def _(x, index, weight, num_tokens):
    return x.new_empty((num_tokens, x.shape[1]))


@torch.library.custom_op("mtp::moe_gather_rows_dot", mutates_args=())
def _gather_rows_dot_op(
    x: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor | None,
    other: torch.Tensor,
    write_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward helper: ``(scale[i] * x[index[i]] or an empty [0, H], dot[i] = <x[index[i]],
    other[i]>)``, the dot in fp32."""
    x = x.contiguous()
    n = index.shape[0]
    out = empty((n if write_out else 0, x.shape[1]), dtype=x.dtype, device=x.device)
    dot = empty((n,), dtype=torch.float32, device=x.device)
    _kernels.gather_rows(
        x,
        index.contiguous(),
        out if write_out else None,
        scale=None if scale is None else scale.contiguous(),
        other=other.contiguous(),
        dot=dot,
    )
    return out, dot


@_gather_rows_dot_op.register_fake
def _(x, index, scale, other, write_out):
    n = index.shape[0]
    return x.new_empty((n if write_out else 0, x.shape[1])), x.new_empty((n,), dtype=torch.float32)


def _gather_setup(ctx, inputs, output):
    x, index, scale = inputs
    ctx.num_rows = x.shape[0]
    ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, index, scale)


def _gather_backward(ctx, grad):
    x, index, scale = ctx.saved_tensors
    grad_x = grad_scale = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.mtp.moe_combine_rows(grad, index, scale, ctx.num_rows)
    if ctx.needs_input_grad[2]:
        _, dot = torch.ops.mtp.moe_gather_rows_dot(x, index, None, grad, False)
        grad_scale = dot.to(scale.dtype)
    return grad_x, None, grad_scale


_gather_rows_op.register_autograd(_gather_backward, setup_context=_gather_setup)


def _combine_setup(ctx, inputs, output):
    x, index, weight, _ = inputs
    ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, index, weight)


def _combine_backward(ctx, grad):
    x, index, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_x = grad_w = None
    if need_w:
        grad_x, dot = torch.ops.mtp.moe_gather_rows_dot(grad, index, weight, x, need_x)
        grad_w = dot.to(weight.dtype)
        grad_x = grad_x if need_x else None
    elif need_x:
        grad_x = torch.ops.mtp.moe_gather_rows(grad, index, weight)
    return grad_x, None, grad_w, None


_combine_rows_op.register_autograd(_combine_backward, setup_context=_combine_setup)
