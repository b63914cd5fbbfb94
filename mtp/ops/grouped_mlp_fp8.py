"""The FP8 expert MLP: :func:`mtp.ops.grouped_mlp` with ``fp8_recipe`` (:func:`fp8_mlp`).

Forward, three launches past the weights' (cached) quantisation:

1. the tokens quantised once, row-wise, at their rows (with ``gather_index``: the ``S`` source
   rows, not the ``M`` expert-major ones; without it and with an FP8 weight gradient, the
   column-wise, expert-padded copy fc1's weight gradient reads comes from the same launch);
2. fc1 (``mtp::grouped_mlp_fp8_fc1``): the FP8 grouped GEMM reading its rows (and their scales)
   through the row index, with the activation epilogue: ``h`` stored for the backward and
   ``act(h) * p`` written as FP8 data + row-wise scales (no BF16 activation, no second
   quantisation, no permuted copy of the tokens);
3. fc2: :mod:`mtp.ops.grouped_gemm.fp8`'s forward kernel on that :class:`Fp8Tensor`.

Backward: the output gradient quantised once (row-wise for fc2's data gradient, column-wise
padded for fc2's weight gradient); fc2's FP8 data gradient with the activation's backward and
the probabilities' gradient in its epilogue (``mtp::grouped_mlp_fp8_dact``: ``dh`` and, for
fc2's weight gradient, ``y = act(h) * p`` recomputed from ``h``), ``y`` quantised column-wise,
fc2's weight gradient, ``dh`` quantised once for fc1's data and weight gradients, those two
GEMMs, and with ``gather_index`` the per-source-row sums (and the ``[S, E]`` probability
gradient) of :mod:`mtp.ops.moe_permute.token_map`. With a row gather fc1's weight gradient
reads the gathered rows quantised column-wise in the backward (``recipe.wgrad="bf16"``: the BF16
tokens through the index, nothing gathered). Saved: the column-wise tokens (or the tokens),
``h``, the rows' probabilities and the weights' data-gradient operands.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mtp import settings
from mtp.ops._eager import autograd_apply, eager, needs_grad
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS
from mtp.ops.grouped_gemm import eager_path as _eager_gemm
from mtp.ops.grouped_gemm.checks import (
    ACTIVATIONS,
    COUNT_DTYPES,
    FLOAT_DTYPES,
    check_count_values,
    check_fp8_device,
    check_rows,
    check_index_values,
    check_main_grad,
)
from mtp.ops.grouped_gemm.config import device_arch
from mtp.ops.grouped_gemm.fp8 import (
    _save,
    _saved,
    cached_weight_operands,
    fp8_forward,
    fp8_weight_grad,
)
from mtp.ops.grouped_gemm.ops import weight_grad
from mtp.ops.grouped_mlp_fp8_ops import fc1, fp8_dact, gathered_rows
from mtp.ops.moe_permute.token_map import permute_grads
from mtp.ops.quantize import Fp8Recipe, quantize_many
from mtp.ops.quantize.cache import Fp8WeightCache
from mtp.ops.quantize.tensor import as_recipe
from mtp.utils import check_tensor, validation_mode

__all__ = ["Fp8GroupedMLP", "fp8_mlp"]

_BACKENDS = ("triton", "reference")
_GATED = ("swiglu", "clamped_swiglu")


def _forward(x, w1, w2, counts, probs, gather, call, need):
    """``(out, saved)``: the three forward launches (module doc); ``need = (dx, dw1, dw2,
    dprobs)`` what the backward will compute (nothing: no saved operands)."""
    act, recipe, backend, _, routing, cache = call[:6]
    direct = routing is not None
    need_dh = need[0] or need[1] or need[3]
    col_x = need[1] and recipe.wgrad == "fp8" and gather is None
    got = quantize_many(x, counts if col_x else None, recipe,
                        "rowwise+colwise" if col_x else "rowwise", backend, routing)  # fmt: skip
    w1f, w1d = cached_weight_operands(w1, recipe, False, need[0], backend, cache)
    w2f, w2d = cached_weight_operands(w2, recipe, False, need_dh or need[2], backend, cache)
    rows = x.shape[0] if gather is None else gather.shape[0]
    F = w2.shape[1]
    h, yq, p = fc1(got[0], w1f, counts, probs, gather, act[0], recipe.scale_kind, act[1], act[2],
                   backend, direct, x.dtype, rows, F)  # fmt: skip
    out = fp8_forward(None, yq, w2f, counts, None, backend, direct, x.dtype)
    keep_x = need[1] and (recipe.wgrad == "bf16" or gather is not None)
    saved = (got[1] if col_x else None, x if keep_x else None, h, p, w1d, w2d)
    return out, saved


def _dh_and_dw2(dout, w2, w2d, h, p, counts, call, need):
    """``(dh, dL/dp, dW2)``: ``dout`` quantised once, fc2's data gradient with the activation's
    backward (``y`` recomputed for fc2's weight gradient), fc2's weight gradient."""
    act, recipe, backend, accumulate, routing = call[:5]
    direct = routing is not None
    fp8_w2 = need[2] and recipe.wgrad == "fp8"
    dq = {t.layout: t for t in quantize_many(
        dout, counts if fp8_w2 else None, recipe, "rowwise+colwise" if fp8_w2 else "rowwise",
        backend, routing)}  # fmt: skip
    dh, dprobs, y = fp8_dact(dq["rowwise"], w2d, counts, h, p, *act, need[2], backend, direct)
    dw2 = None
    if fp8_w2:
        yc = quantize_many(y, counts, recipe, "colwise", backend, routing)[0]
        dw2 = fp8_weight_grad(w2, yc, dq["colwise"], counts, backend, accumulate, direct)
    elif need[2]:
        dw2 = weight_grad(w2, y, dout, counts, backend, accumulate, routing)
    return dh, dprobs, dw2


def _fc1_grads(x, xc, w1, w1d, dh, counts, gather, call, need):
    """``(dx of the expert-major rows, dW1)`` from ``dh`` quantised once."""
    act, recipe, backend, accumulate, routing = call[:5]
    direct = routing is not None
    fp8_w1 = need[1] and recipe.wgrad == "fp8"
    layouts = "+".join(n for n, on in (("rowwise", need[0]), ("colwise", fp8_w1)) if on)
    dq = {t.layout: t for t in quantize_many(dh, counts if fp8_w1 else None, recipe, layouts,
                                             backend, routing)} if layouts else {}  # fmt: skip
    dx = dw1 = None
    if need[0]:
        dx = fp8_forward(None, dq["rowwise"], w1d, counts, None, backend, direct, dh.dtype)
    if fp8_w1:
        if xc is None:  # gathered rows: quantised column-wise here (the forward kept x)
            xc = quantize_many(gathered_rows(x, None, gather, counts)[0], counts, recipe,
                               "colwise", backend, routing)[0]  # fmt: skip
        dw1 = fp8_weight_grad(w1, xc, dq["colwise"], counts, backend, accumulate, direct)
    elif need[1]:
        if gather is not None and backend == "reference":
            x, gather = gathered_rows(x, None, gather, counts)[0], None
        dw1 = weight_grad(w1, x, dh, counts, backend, accumulate, routing, gather)
    return dx, dw1


class Fp8GroupedMLP(torch.autograd.Function):
    """``apply(x, w1, w2, probs, counts, gather, token_rows, token_experts, token_count, call)``
    with ``call = ((activation, limit, alpha), recipe, backend, accumulate, routing, cache,
    probs_width)`` (``routing``: the eager path's, None for the custom ops)."""

    @staticmethod
    def forward(ctx, x, w1, w2, probs, counts, gather, rows, experts, count, call):
        need = ctx.needs_input_grad[:4]
        out, saved = _forward(x, w1, w2, counts, probs, gather, call, need)
        _save(ctx, *saved, w1, w2, counts, gather, rows, experts, count)
        ctx.call = call
        ctx.dtypes = (x.dtype, None if probs is None else probs.dtype, x.shape[1])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        xc, x, h, p, w1d, w2d, w1, w2, counts, gather, rows, experts, count = _saved(ctx)
        call, need = ctx.call, ctx.needs_input_grad[:4]
        if call[4] is not None and not eager(dout):
            call = (*call[:4], None, *call[5:])  # traced (compiled autograd): the custom ops
        dh, dprobs, dw2 = _dh_and_dw2(dout.contiguous(), w2, w2d, h, p, counts, call, need)
        dx_rows, dw1 = _fc1_grads(x, xc, w1, w1d, dh, counts, gather, call, need)
        x_dtype, p_dtype, hidden = ctx.dtypes
        dx = dp = None
        if gather is None:
            dx, dp = dx_rows, (dprobs.to(p_dtype) if need[3] else None)
        elif need[0] or need[3]:  # per source row: its rows' sums, and the [S, E] probs grad
            meta = (hidden, call[6], x_dtype, p_dtype or x_dtype)
            dx, dp = permute_grads((rows, experts, count), meta, need[0], need[3], dx_rows,
                                   dprobs)  # fmt: skip
        return dx, dw1, dw2, dp, *(None,) * 6


_APPLY = autograd_apply(Fp8GroupedMLP)


# --------------------------------------------------------------------------------------------
# The call (from :func:`mtp.ops.grouped_mlp`)
# --------------------------------------------------------------------------------------------


def _check(x, w1, w2, counts, probs, bias1, bias2, activation, gather, token_map) -> None:
    """The free checks of an FP8 call (the weights in any float dtype: they are quantised)."""
    if bias1 is not None or bias2 is not None:
        raise ValueError("grouped_mlp: bias1 / bias2 cannot be combined with fp8_recipe yet "
                         "(the FP8 experts have no biases)")  # fmt: skip
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight1", w1, ndim=3, dtypes=FLOAT_DTYPES, device=x.device)
    check_tensor("weight2", w2, ndim=3, dtypes=FLOAT_DTYPES, device=x.device)
    check_tensor("tokens_per_expert", counts, ndim=1, dtypes=COUNT_DTYPES)
    E, H, W = w1.shape
    F = W // 2 if activation in _GATED else W
    if H != x.shape[1]:
        raise ValueError(f"weight1 must be [E, {x.shape[1]}, W] (x's {x.shape[1]} columns), "
                         f"got {tuple(w1.shape)}")  # fmt: skip
    if activation in _GATED and W % 2:
        raise ValueError(f"weight1 [E, H, 2F] holds the gate and up columns for {activation!r}: "
                         f"its last dim must be even, got {tuple(w1.shape)}")  # fmt: skip
    if tuple(w2.shape) != (E, F, H):
        raise ValueError(f"weight2 must be [{E}, {F}, {H}] (experts, F, H) for weight1 "
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")  # fmt: skip
    if counts.shape[0] != E:
        raise ValueError(f"tokens_per_expert must be [{E}] (one count per expert), got "
                         f"{tuple(counts.shape)}")  # fmt: skip
    check_rows(x, w1, probs, gather, token_map)


def _recipe(fp8_recipe, cache) -> Fp8Recipe:
    if cache is not None and not isinstance(cache, Fp8WeightCache):
        raise TypeError(f"fp8_weight_cache must be None or an Fp8WeightCache, got "
                        f"{type(cache).__name__}")  # fmt: skip
    recipe = as_recipe(fp8_recipe)
    if recipe is None:
        raise ValueError("fp8_weight_cache is for FP8 experts: pass fp8_recipe too")
    return recipe


def fp8_mlp(x, w1, w2, tokens_per_expert, probs, bias1, bias2, activation, limit, alpha,
            accumulate, backend, validate, gather, token_map, fp8_recipe, cache):  # fmt: skip
    """:func:`mtp.ops.grouped_mlp` with ``fp8_recipe`` (its arguments, resolved)."""
    recipe = _recipe(fp8_recipe, cache)
    t = tokens_per_expert
    if isinstance(t, (list, tuple)):
        t = torch.tensor(t, dtype=torch.int64)
    _check(x, w1, w2, t, probs, bias1, bias2, activation, gather, token_map)
    name = _eager_gemm.backend_name("grouped_mlp", backend, x.device, _BACKENDS)
    check_fp8_device(recipe.name, x.device, device_arch(x.device)[0])
    if accumulate:
        for w in (w1, w2):
            if w.requires_grad:
                check_main_grad(w)
    mode = settings.current().validate if validate is True else validation_mode(validate)
    rows = x.shape[0] if gather is None else gather.shape[0]
    impl = GROUPED_GEMM_BACKENDS[name]
    direct = eager(x, w1, w2, t, probs, gather)
    if direct:
        counts, routing = _eager_gemm.counts_and_routing(t, x, w1.shape[0], impl, mode, rows)
    else:
        counts, routing = t.contiguous(), None
        counts = counts if impl.device_counts else counts.to("cpu")
        check_count_values(counts, rows, validate)
    if gather is not None:
        check_index_values(gather, x.shape[0], None, rows, mode)
    if name == "reference" and gather is not None:  # materialised rows, autograd through them
        x, probs = gathered_rows(x, probs, gather, counts)
        gather = token_map = None
    tm = (None,) * 3 if token_map is None else (token_map.rows, token_map.experts,
                                                token_map.count)  # fmt: skip
    width = 1 if probs is None or probs.dim() == 1 else probs.shape[1]
    call = ((activation, limit, alpha), recipe, name, bool(accumulate), routing,
            cache, width)  # fmt: skip
    probs = None if probs is None else probs.contiguous()
    if needs_grad(x, w1, w2, probs):
        apply = _APPLY if direct else Fp8GroupedMLP.apply
        out = apply(x, w1, w2, probs, counts, gather, *tm, call)
    else:
        out = _forward(x, w1, w2, counts, probs, gather, call, (False,) * 4)[0]
    if routing is not None and routing.head is None:
        routing.validate()
    return out
