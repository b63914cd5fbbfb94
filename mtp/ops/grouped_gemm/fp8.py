"""FP8 operands of :func:`mtp.ops.grouped_gemm`: the custom ops (each with its fake), their
bodies on the ``triton`` and ``reference`` backends, the weight's operands and the autograd
formula.

- ``mtp::grouped_gemm_fp8_out``: ``out[rows of e] = a[rows] @ b[e]`` for the forward and the
  data gradient (``a`` row-wise ``[M, K]``, ``b`` ``[E, K, N]`` quantised along K; BF16 out).
- ``mtp::grouped_gemm_fp8_wgrad``: ``out[e] (+)= a_e^T b_e`` from the expert-padded
  column-wise operands (one launch for every expert).

The autograd function quantises a BF16 ``x`` once (row-wise for the forward and, when the
weight gradient is FP8, column-wise with each expert padded to whole blocks for it, in the same
launch), the weight once in both orientations it is read (blockwise: one set of 128 x 128
blocks in two memory layouts; MXFP8: along K and along N), and in the backward the output
gradient once for both gradient GEMMs (row-wise for the data gradient, column-wise for the
weight gradient). ``recipe.wgrad="bf16"`` keeps the BF16 ``x`` instead and runs the BF16
weight gradient.
"""

from __future__ import annotations

import torch

from mtp import settings
from mtp.ops._eager import autograd_apply, eager
from mtp.ops.grouped_gemm import eager_path as _eager_path
from mtp.ops.grouped_gemm.backends import GROUPED_GEMM_BACKENDS, _host_sizes, _reference_forward
from mtp.ops.grouped_gemm.checks import (
    check_count_values,
    check_fp8_arguments,
    check_fp8_device,
    check_main_grad,
    check_out_memory,
    fp8_data,
)
from mtp.ops.grouped_gemm.config import device_arch
from mtp.ops.grouped_gemm.ops import weight_grad
from mtp.ops.grouped_gemm.plans import triton_fp8_forward, triton_fp8_wgrad
from mtp.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_many
from mtp.ops.quantize.cache import Fp8WeightCache
from mtp.ops.quantize.tensor import as_recipe
from mtp.utils import empty, validation_mode

__all__ = ["GroupedGemmFp8Function", "fp8_call", "fp8_forward", "fp8_out", "weight_operands"]


# --------------------------------------------------------------------------------------------
# Custom ops: the device work (fakes below each)
# --------------------------------------------------------------------------------------------


def _reference_out(a: Fp8Tensor, b: Fp8Tensor, counts, out) -> None:
    """Dequantised operands, the per-expert loop in fp32 (counts on the host)."""
    y = _reference_forward(a.dequantize(), b.dequantize(), counts.cpu(), False, None)
    out.copy_(y)


def _reference_wgrad(a: Fp8Tensor, b: Fp8Tensor, counts, out, accumulate: bool) -> None:
    block, pos = a.block[0], 0
    da, db = a.dequantize(), b.dequantize()
    for e, m in enumerate(_host_sizes(counts.cpu())):
        part = da[pos : pos + m].T @ db[pos : pos + m]
        out[e].copy_(out[e].float() + part if accumulate else part)
        pos += -(-m // block) * block


def run_fp8_out(a: Fp8Tensor, b: Fp8Tensor, counts, out, backend: str) -> None:
    """The body of ``mtp::grouped_gemm_fp8_out``."""
    if backend == "reference":
        _reference_out(a, b, counts, out)
    else:
        triton_fp8_forward(a, b, counts, out)


def run_fp8_wgrad(a: Fp8Tensor, b: Fp8Tensor, counts, out, accumulate: bool,
                  backend: str) -> None:  # fmt: skip
    """The body of ``mtp::grouped_gemm_fp8_wgrad``."""
    if backend == "reference":
        _reference_wgrad(a, b, counts, out, accumulate)
    else:
        triton_fp8_wgrad(a, b, counts, out, accumulate)


@torch.library.custom_op("mtp::grouped_gemm_fp8_out", mutates_args=("out",))
def _out_op(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    recipe: str,
    b_layout: str,
    backend: str,
) -> None:
    """``out[rows of e] = a[rows] @ b[e]`` dequantised (``a`` row-wise ``[M, K]``, ``b``
    ``[E, K, N]`` in ``b_layout``), zeros past ``sum(tokens_per_expert)``."""
    run_fp8_out(Fp8Tensor(a, a_scales, recipe, "rowwise"), Fp8Tensor(b, b_scales, recipe, b_layout),
                tokens_per_expert, out, backend)  # fmt: skip


@_out_op.register_fake
def _(a, a_scales, b, b_scales, tokens_per_expert, out, recipe, b_layout, backend):
    return None


@torch.library.custom_op("mtp::grouped_gemm_fp8_wgrad", mutates_args=("out",))
def _wgrad_op(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    recipe: str,
    accumulate: bool,
    backend: str,
) -> None:
    """``out[e] (+)= a_e^T b_e`` from expert-padded column-wise operands."""
    run_fp8_wgrad(Fp8Tensor(a, a_scales, recipe, "colwise", True),
                  Fp8Tensor(b, b_scales, recipe, "colwise", True), tokens_per_expert, out,
                  accumulate, backend)  # fmt: skip


@_wgrad_op.register_fake
def _(a, a_scales, b, b_scales, tokens_per_expert, out, recipe, accumulate, backend):
    return None


# --------------------------------------------------------------------------------------------
# Calls on both paths (eager: the bodies; traced: the custom ops)
# --------------------------------------------------------------------------------------------


def fp8_out(a: Fp8Tensor, b: Fp8Tensor, counts, out, backend: str, direct: bool) -> torch.Tensor:
    """``out`` (``[M, N]``) of ``mtp::grouped_gemm_fp8_out``; ``direct``: the body."""
    if direct:
        run_fp8_out(a, b, counts, out, backend)
    else:
        torch.ops.mtp.grouped_gemm_fp8_out(a.data, a.scales, b.data, b.scales, counts, out,
                                           a.recipe, b.layout, backend)  # fmt: skip
    return out


def _fp8_wgrad(a, b, counts, out, accumulate, backend, direct) -> None:
    if direct:
        run_fp8_wgrad(a, b, counts, out, accumulate, backend)
    else:
        torch.ops.mtp.grouped_gemm_fp8_wgrad(a.data, a.scales, b.data, b.scales, counts, out,
                                             a.recipe, accumulate, backend)  # fmt: skip


def fp8_weight_grad(w, a, b, counts, backend, accumulate, direct):
    """``dW[e] = a_e^T b_e`` from FP8 operands, with :func:`~.ops.weight_grad`'s main-grad
    protocol for ``accumulate``."""
    if not accumulate:
        dw = empty((counts.shape[0], a.shape[1], b.shape[1]), dtype=w.dtype, device=w.device)
        _fp8_wgrad(a, b, counts, dw, False, backend, direct)
        return dw
    _fp8_wgrad(a, b, counts, w.main_grad, True, backend, direct)
    if hasattr(w, "grad_added_to_main_grad"):
        w.grad_added_to_main_grad = True
        return torch.empty_like(w)
    return None


def weight_operands(w, recipe: Fp8Recipe, trans_b: bool, need_dgrad: bool, backend: str):
    """``(forward operand [E, K, N], data-gradient operand [E, N, K] or None)`` of a BF16
    ``w`` (``[E, K, N]``, or ``[E, N, K]`` with ``trans_b``), each quantised along its
    reduction axis and stored with that axis contiguous, from one read of ``w``."""
    if recipe.name == "blockwise":  # one set of blocks, two memory layouts when both are read
        got = quantize_many(w, None, recipe, "block+t" if need_dgrad else "block", backend)
        same, other = got[0], (got[1] if need_dgrad else None)
        if trans_b:
            return same.mT, other
        return (other if need_dgrad else same), (same.mT if need_dgrad else None)
    layouts = "rowwise+colwise" if need_dgrad else ("rowwise" if trans_b else "colwise")
    got = {t.layout: t for t in quantize_many(w, None, recipe, layouts, backend)}
    if trans_b:  # K is w's last dim
        return got["rowwise"].mT, got.get("colwise")
    return got["colwise"], (got["rowwise"].mT if need_dgrad else None)


def cached_weight_operands(w, recipe: Fp8Recipe, trans_b: bool, need_dgrad: bool, backend: str,
                           cache: Fp8WeightCache | None):  # fmt: skip
    """:func:`weight_operands`, through ``cache`` when given (reused while ``w`` is
    unchanged: once per optimizer step; a forward without the data gradient takes the forward
    operand of an entry with it)."""
    if cache is None:
        return weight_operands(w, recipe, trans_b, need_dgrad, backend)
    key = ("grouped_gemm", recipe, trans_b, backend)
    both = None if need_dgrad else cache.lookup(w, (*key, True))
    if both is not None:
        return both[0], None
    return cache.get(w, (*key, need_dgrad),
                     lambda: weight_operands(w, recipe, trans_b, need_dgrad, backend))


def _given_weight(w: Fp8Tensor, trans_b: bool, need_dgrad: bool):
    """The operands of a pre-quantised ``w``: blockwise blocks serve both orientations."""
    fwd = w.mT if trans_b else w
    if not need_dgrad:
        return fwd, None
    if w.layout != "block":
        raise ValueError("x requires grad but w is an Fp8Tensor quantised along K only "
                         f"({w.layout!r}, {w.recipe!r}); its data gradient needs w quantised "
                         "along N: pass the BF16 w (quantised inside) or a 'block' weight")
    return fwd, fwd.mT


def fp8_forward(x, xq, wf, counts, out, backend, direct, dtype):
    """The forward GEMM into ``out`` (or a new ``[M, N]`` buffer of ``dtype``)."""
    M, N = xq.shape[0], wf.shape[2]
    if out is None:
        out = empty((M, N), dtype=dtype, device=xq.device)
    return fp8_out(xq, wf, counts, out, backend, direct)


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


def _save(ctx, *tensors) -> None:
    """Fp8Tensors and tensors (None kept) saved as their tensors."""
    flat, spec = [], []
    for t in tensors:
        if isinstance(t, Fp8Tensor):
            flat += [t.data, t.scales]
            spec.append((t.recipe, t.layout, t.padded))
        else:
            flat.append(t)
            spec.append(None)
    ctx.save_for_backward(*flat)
    ctx.spec = spec


def _saved(ctx) -> list:
    flat, out, i = ctx.saved_tensors, [], 0
    for spec in ctx.spec:
        if spec is None:
            out.append(flat[i])
            i += 1
        else:
            out.append(Fp8Tensor(flat[i], flat[i + 1], *spec))
            i += 2
    return out


class GroupedGemmFp8Function(torch.autograd.Function):
    """:func:`mtp.ops.grouped_gemm` with FP8 operands: ``apply(x, w, out, counts, call)`` with
    ``x``/``w`` the BF16 tensors (None where the caller passed an Fp8Tensor) and ``call =
    (trans_b, backend, recipe, accumulate, routing, xq, wq, dtype, cache)`` (``xq``/``wq`` the
    given Fp8Tensors; ``routing`` the eager path's, None for the custom ops; ``cache`` the
    :class:`~mtp.ops.quantize.cache.Fp8WeightCache` of ``w`` or None)."""

    @staticmethod
    def forward(ctx, x, w, out, counts, call):
        trans_b, backend, recipe, _, routing, xq, wq, dtype, cache = call
        need_dx, need_dw = ctx.needs_input_grad[:2]
        fp8_wgrad = need_dw and recipe.wgrad == "fp8"
        direct = routing is not None
        xc = None
        if x is not None:
            got = quantize_many(x, counts if fp8_wgrad else None, recipe,
                                "rowwise+colwise" if fp8_wgrad else "rowwise", backend,
                                routing)  # fmt: skip
            xq, xc = got[0], (got[1] if fp8_wgrad else None)
        if w is not None:
            wf, wd = cached_weight_operands(w, recipe, trans_b, need_dx, backend, cache)
        else:
            wf, wd = _given_weight(wq, trans_b, need_dx)
        y = fp8_forward(x, xq, wf, counts, out, backend, direct, dtype)
        if out is not None:
            ctx.mark_dirty(out)
        _save(ctx, counts, wd, xc if fp8_wgrad else (x if need_dw else None),
              w if need_dw else None)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, dy):
        trans_b, backend, recipe, accumulate, routing = ctx.call[:5]
        counts, wd, xs, w = _saved(ctx)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if routing is not None and not eager(dy):
            routing = None  # traced (compiled autograd, a mode): the custom ops
        direct = routing is not None
        dy = dy.contiguous()
        fp8_wgrad = need_dw and recipe.wgrad == "fp8"
        layouts = "+".join(n for n, on in (("rowwise", need_dx), ("colwise", fp8_wgrad)) if on)
        dq = {t.layout: t for t in quantize_many(dy, counts if fp8_wgrad else None, recipe,
                                                 layouts, backend, routing)} if layouts else {}
        dx = dw = None
        if need_dx:
            dx = fp8_forward(None, dq["rowwise"], wd, counts, None, backend, direct, dy.dtype)
        if need_dw:
            if fp8_wgrad:
                a, b = (dq["colwise"], xs) if trans_b else (xs, dq["colwise"])
                dw = fp8_weight_grad(w, a, b, counts, backend, accumulate, direct)
            else:
                a, b = (dy, xs) if trans_b else (xs, dy)
                dw = weight_grad(w, a, b, counts, backend, accumulate, routing)
        return dx, dw, None, None, None


# --------------------------------------------------------------------------------------------
# The call (from :func:`mtp.ops.grouped_gemm`)
# --------------------------------------------------------------------------------------------

_BACKENDS = ("triton", "reference")


_APPLY = autograd_apply(GroupedGemmFp8Function)  # the eager path's (C) apply


def _recipe_of(x, w, fp8_recipe) -> Fp8Recipe:
    given = [t.recipe for t in (x, w) if isinstance(t, Fp8Tensor)]
    recipe = as_recipe(fp8_recipe) or Fp8Recipe(given[0])
    if any(r != recipe.name for r in given):
        raise ValueError(f"fp8_recipe={recipe.name!r} but an operand is quantised with "
                         f"{sorted(set(given))}; they must agree")  # fmt: skip
    return recipe


def _key_of(t) -> tuple:
    """What the free checks of an operand depend on."""
    if t.__class__ is Fp8Tensor:
        return (t.data.shape, t.data.dtype, t.data.device, t.scales.shape, t.scales.dtype,
                t.recipe, t.layout)  # fmt: skip
    return (t.__class__, t.shape, t.dtype, t.device)


def fp8_call(x, w, tokens_per_expert, trans_b, backend, out, validate, fp8_recipe, accumulate,
             options, cache=None) -> torch.Tensor:  # fmt: skip
    """:func:`mtp.ops.grouped_gemm` with FP8 operands (``options``: the epilogue options
    given, refused; ``cache``: its ``fp8_weight_cache``)."""
    if cache is not None and not isinstance(cache, Fp8WeightCache):
        raise TypeError(f"fp8_weight_cache must be None or an Fp8WeightCache, got "
                        f"{type(cache).__name__}")  # fmt: skip
    recipe = _recipe_of(x, w, fp8_recipe)
    xt, wt = fp8_data(x), fp8_data(w)
    if isinstance(tokens_per_expert, (list, tuple)):
        tokens_per_expert = torch.tensor(tokens_per_expert, dtype=torch.int64)
    direct = eager(xt, wt, tokens_per_expert, out)
    key = ("fp8", recipe, trans_b, options, _key_of(x), _key_of(w), tokens_per_expert.shape,
           tokens_per_expert.dtype, tokens_per_expert.device,
           out is None or (out.shape, out.dtype, out.device))  # fmt: skip
    if not (direct and _eager_path.seen(key)):
        check_fp8_arguments(x, w, tokens_per_expert, trans_b, out, recipe.name, options)
        if direct:
            _eager_path.remember(key)
    elif out is not None:
        check_out_memory(out, xt, wt, tokens_per_expert, plain=True)
    name = _eager_path.backend_name("grouped_gemm", backend, xt.device, _BACKENDS)
    check_fp8_device(recipe.name, xt.device, device_arch(xt.device)[0])
    x_grad, w_grad = x is xt and x.requires_grad, w is wt and w.requires_grad
    if x is not xt and w_grad:
        raise ValueError("w requires grad but x is an Fp8Tensor: the weight gradient needs the "
                         "BF16 x (quantised inside); pass it, or w.requires_grad_(False)")
    if accumulate and w_grad:
        check_main_grad(w)
    mode = settings.current().validate if validate is True else validation_mode(validate)
    impl = GROUPED_GEMM_BACKENDS[name]
    if direct:
        counts, routing = _eager_path.counts_and_routing(tokens_per_expert, xt, wt.shape[0], impl,
                                                         mode)  # fmt: skip
    else:
        counts, routing = tokens_per_expert.contiguous(), None
        counts = counts if impl.device_counts else counts.to("cpu")
        check_count_values(counts, xt.shape[0], validate)
    dtype = x.dtype if x is xt else (out.dtype if out is not None else torch.bfloat16)
    call = (trans_b, name, recipe, bool(accumulate), routing, None if x is xt else x,
            None if w is wt else w, dtype, cache)  # fmt: skip
    if torch.is_grad_enabled() and (x_grad or w_grad):
        apply = _APPLY if direct else GroupedGemmFp8Function.apply  # eager: autograd's C apply
        y = apply(x if x is xt else None, w if w is wt else None, out, counts, call)
    else:
        y = _forward_only(x, w, counts, out, call, direct)
    if routing is not None and routing.head is None:
        routing.validate()
    return y


def _forward_only(x, w, counts, out, call, direct) -> torch.Tensor:
    trans_b, backend, recipe, _, routing, xq, wq, dtype, cache = call
    if xq is None:
        xq = quantize_many(x, None, recipe, "rowwise", backend, routing)[0]
    if wq is None:
        wf = cached_weight_operands(w, recipe, trans_b, False, backend, cache)[0]
    else:
        wf = _given_weight(wq, trans_b, False)[0]
    return fp8_forward(None, xq, wf, counts, out, backend, direct, dtype)
