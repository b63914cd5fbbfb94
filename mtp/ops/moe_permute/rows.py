"""The rows of a permutation whose token map is known: :func:`scatter_rows`.

``scatter_rows(tokens, token_map, row_id_map)`` is the data half of :func:`~mtp.ops.permute`
for a row map built earlier (the MoE dispatchers' preprocess builds it with
:func:`~mtp.ops.moe_permute.moe_permute_row_map` and its
:class:`~mtp.ops.moe_permute.token_map.TokenMap`): each token row is read once and written to
its rows, the rows holding no token are zero (one launch); the backward is a per-token fp32 sum
of the row gradients in ascending row order (one launch), the order and result of
``mtp::moe_gather_rows``' backward without its sort. ``mtp::moe_scatter_rows`` (fake, autograd)
is what ``torch.compile`` sees; eager calls run the body under :class:`ScatterRows`.
"""

from __future__ import annotations

import torch

from mtp import settings
from mtp.kernels import moe_token_major as _kernels
from mtp.ops._eager import autograd_apply, eager, needs_grad
from mtp.ops.moe_permute.token_map import TokenMap, backward_meta, permute_grads, poisoned_empty

__all__ = ["ScatterRows", "scatter_rows"]


@torch.library.custom_op("mtp::moe_scatter_rows", mutates_args=())
def _scatter_rows_op(
    tokens: torch.Tensor,
    token_rows: torch.Tensor,
    token_experts: torch.Tensor,
    token_count: torch.Tensor,
    row_id_map: torch.Tensor,
) -> torch.Tensor:
    """``out[token_rows[t, j]] = tokens[t]``, zero rows where ``row_id_map < 0``."""
    return scatter_rows_impl(tokens, token_rows, token_count, row_id_map)


def scatter_rows_impl(tokens, token_rows, token_count, row_id_map):
    """The body of ``mtp::moe_scatter_rows``."""
    tokens = tokens.contiguous()
    new = poisoned_empty if settings.current().poison_outputs else torch.empty
    out = new(row_id_map.shape[0], tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
    _kernels.scatter_tokens(tokens, token_rows.contiguous(), token_count.contiguous(),
                            row_id_map.contiguous(), out, zero_empty=True)  # fmt: skip
    return out


@_scatter_rows_op.register_fake
def _(tokens, token_rows, token_experts, token_count, row_id_map):
    return tokens.new_empty((row_id_map.shape[0], tokens.shape[1]))


def _setup(ctx, inputs, output):
    tokens, rows, experts, count, _ = inputs
    ctx.save_for_backward(rows, experts, count)
    ctx.meta = backward_meta(tokens, None, 1)


def _backward(ctx, grad):
    gx, _ = permute_grads(ctx.saved_tensors, ctx.meta, True, False, grad, None)
    return gx, None, None, None, None


_scatter_rows_op.register_autograd(_backward, setup_context=_setup)


class ScatterRows(torch.autograd.Function):
    """The eager path's autograd of :func:`scatter_rows_impl`: ``apply(tokens, (token_rows,
    token_experts, token_count, row_id_map))``."""

    @staticmethod
    def forward(ctx, tokens, maps):
        ctx.maps, ctx.meta = maps[:3], backward_meta(tokens, None, 1)
        return scatter_rows_impl(tokens, maps[0], maps[2], maps[3])

    @staticmethod
    def backward(ctx, grad):
        return permute_grads(ctx.maps, ctx.meta, True, False, grad, None)[0], None


_SCATTER_APPLY = autograd_apply(ScatterRows)  # the eager path's (C) apply


def scatter_rows(tokens: torch.Tensor, token_map: TokenMap, row_id_map: torch.Tensor):
    """``[N, H]`` rows of ``tokens [T, H]`` in the order of ``row_id_map [N]`` (int64, the
    token of each row, ``-1`` for none: a zero row), whose token-major map is ``token_map``
    (the Triton backend's; not checked against it). Differentiable in ``tokens``."""
    tm = token_map
    if eager(tokens, row_id_map) and tokens.device.type != "meta":
        if needs_grad(tokens):
            return _SCATTER_APPLY(tokens, (tm.rows, tm.experts, tm.count, row_id_map))
        return scatter_rows_impl(tokens, tm.rows, tm.count, row_id_map)
    return torch.ops.mtp.moe_scatter_rows(tokens, tm.rows, tm.experts, tm.count, row_id_map)
