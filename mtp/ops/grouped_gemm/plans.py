"""The ``triton`` backend of :func:`mtp.ops.grouped_gemm`: launch plans per key.

Each function keeps, per key, what its launch needs (the config of
:func:`mtp.ops.grouped_gemm.config.make_config` and the compiled launches of
:mod:`mtp.kernels.grouped_gemm_details.launch` bound to their grids), so a call costs a key, a
dictionary look-up and the launches. The key holds everything the choice and the builds depend
on: the sizes, strides and dtypes, the 16-byte alignment of every pointer (``aligned``), the
device, the epilogue, :func:`~mtp.ops.grouped_gemm.config.choice_state` (overrides and
``MTP_TRITON_TMA``) and, for fp32, PyTorch's TF32 switch.

``routing``: the :class:`~mtp.kernels.grouped_gemm_details.routing.Routing` of the counts for
this ``M`` (tile maps, expert rows), shared by the GEMMs of one op call; None builds one for the
call (the custom ops' way).
"""

from __future__ import annotations

import torch

from mtp.kernels._launch import Plans, aligned
from mtp.kernels.grouped_gemm_details import launch as _launch
from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.ops.grouped_gemm.config import choice_state, device_arch, make_config, tma_aligned
from mtp.utils import empty

__all__ = ["triton_dgrad_act", "triton_forward", "triton_forward_act", "triton_fp8_forward",
           "triton_fp8_wgrad", "triton_wgrad"]

_PLANS = Plans()
_F32 = torch.float32


def _tf32() -> bool:
    """PyTorch's TF32 switch (the fp32 pointer kernels' precision; keys read it for fp32)."""
    return torch.backends.cuda.matmul.allow_tf32


def _config(a: torch.Tensor, M: int, N: int, K: int, E: int, **choice):
    arch, sms = device_arch(a.device)
    return make_config(arch, a.dtype, M, N, K, E, sms=sms, **choice)


def triton_forward(x, w, counts, trans_b, out, bias=None, routing=None, scatter=None):
    """``x @ w[e] (+ bias[e])`` (the bias in the epilogue); ``scatter`` (``[M]``): row ``r``
    stored at ``out[scatter[r]]`` (pointer kernels). The kernels take ``w`` itself, read
    through the strides of its ``[E, K, N]`` view (no view per call)."""
    M, K = x.shape
    E, N = w.shape[0], w.shape[1] if trans_b else w.shape[2]
    if out is None:
        out = empty((M, N), dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.contiguous()
    s = scatter
    key = ("fwd", trans_b, M, N, K, E, x.stride(), w.stride(), out.stride(), x.dtype, out.dtype,
           counts.dtype, None if bias is None else bias.dtype,
           aligned(x, w, out, bias, counts, s), x.device, choice_state(),
           x.dtype is _F32 and _tf32(), None if s is None else s.dtype)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        b = w.transpose(1, 2) if trans_b else w
        tma_ok = (K > 0 and tma_aligned(x, 1) and (tma_aligned(b, 2) or tma_aligned(b, 1))
                  and out.stride(1) == 1)  # fmt: skip
        config = _config(x, M, N, K, E, bias=bias is not None, tma_ok=tma_ok,
                         gather=s is not None)  # fmt: skip
        plan = _PLANS.add(key, _launch.forward_plan(x, b, counts, out, config, bias=bias,
                                                    scatter=s))  # fmt: skip
    plan((x, w, out, out if bias is None else bias, counts if s is None else s), counts,
         routing or Routing(counts, M, E))
    return out


def triton_wgrad(a, b, counts, out, accumulate=False, routing=None, gather=None):
    """``out[e] (+)= a_e^T b_e`` (``accumulate``: added in fp32 in the epilogue); ``gather``:
    row ``r`` of ``a`` is ``a[gather[r]]``."""
    if out is None:
        out = empty((counts.shape[0], a.shape[1], b.shape[1]), dtype=a.dtype, device=a.device)
    P, (M, Q), E = a.shape[1], b.shape, out.shape[0]
    g = gather
    key = ("wgrad", a.shape, P, Q, E, a.stride(), b.stride(), out.stride(), a.dtype, b.dtype,
           out.dtype, counts.dtype, aligned(a, b, out, counts, g), a.device, accumulate,
           choice_state(), a.dtype is _F32 and _tf32(), M,
           None if g is None else g.dtype)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        tma_ok = tma_aligned(a, 1) and tma_aligned(b, 1) and out.stride(2) == 1
        config = _config(a, M, Q, P, E, gemm="wgrad", tma_ok=tma_ok, gather=g is not None)
        plan = _PLANS.add(key, _launch.wgrad_plan(a, b, counts, out, config,
                                                  accumulate=accumulate, gather=g))  # fmt: skip
    plan(a, b, counts, out, routing or Routing(counts, M, E), g)
    return out


def _probs_strides(probs, gather) -> tuple[int, int]:
    """``(stride per row, stride per expert)`` of the probabilities: ``[M]`` per row, or with a
    row gather ``[S]`` per source row or ``[S, E]`` per source row and expert."""
    if probs is None or probs.dim() == 1:
        return (1 if probs is None else probs.stride(0)), 0
    return probs.stride(0), probs.stride(1)


def triton_forward_act(x, w, counts, trans_b, h, y, act, bias, probs, limit, alpha,
                       routing=None, gather=None, row_probs=None) -> None:  # fmt: skip
    """``h = x @ w[e] + bias[e]`` and ``y = act(h) * probs`` in one launch (TMA: two); with
    ``gather``, row ``r`` reads ``x[gather[r]]`` and the probability of that source row (and
    expert), which ``row_probs`` (fp32 ``[M]``) receives."""
    K, E, (M, F) = x.shape[1], w.shape[0], y.shape
    clamped = act == "clamped_swiglu"
    g, rp = gather, row_probs
    strides = _probs_strides(probs, g)
    key = ("act", trans_b, x.shape, F, K, E, x.stride(), w.stride(), h.stride(), y.stride(),
           x.dtype, h.dtype, y.dtype, counts.dtype, None if bias is None else bias.dtype,
           None if probs is None else probs.dtype, aligned(x, w, h, y, bias, probs, counts, g, rp),
           x.device, act, (limit, alpha) if clamped else None, choice_state(),
           x.dtype is _F32 and _tf32(), M, None if g is None else g.dtype, rp is None,
           strides)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        b = w.transpose(1, 2) if trans_b else w
        tma_ok = K > 0 and not clamped and tma_aligned(x, 1) and tma_aligned(b, 2)
        config = _config(x, M, F, K, E, activation=act, bias=bias is not None, tma_ok=tma_ok,
                         gather=g is not None)  # fmt: skip
        plan = _PLANS.add(key, _launch.forward_act_plan(
            x, b, counts, h, y, config, act, bias=bias, probs=probs, limit=limit, alpha=alpha,
            gather=g, row_probs=rp, probs_strides=strides))
    plan(_launch.act_tensors(x, w, h, y, bias, probs, g, rp), counts,
         routing or Routing(counts, M, E))


def triton_dgrad_act(dy, w, counts, h, dh, act, probs, limit, alpha, routing=None, y=None):
    """``dh = (dy @ w[e]^T) * probs * act'(h)`` (``w [E, F, K]``, the weight of the GEMM after
    the activation) and the fp32 partials of ``dL/dprobs`` (None without ``probs``); ``y``
    (``[M, F]``) receives ``act(h) * probs`` again."""
    (M, K), E, F = dy.shape, w.shape[0], w.shape[1]
    clamped = act == "clamped_swiglu"
    key = ("dact", M, F, K, E, dy.stride(), w.stride(), h.stride(), dh.stride(), dy.dtype,
           h.dtype, dh.dtype, counts.dtype, None if probs is None else probs.dtype,
           aligned(dy, w, h, dh, probs, counts, y), dy.device, act,
           (limit, alpha) if clamped else None, choice_state(),
           dy.dtype is _F32 and _tf32(), None if y is None else (y.stride(), y.dtype))  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        b = w.transpose(1, 2)
        tma_ok = K > 0 and not clamped and tma_aligned(dy, 1) and tma_aligned(b, 1)
        config = _config(dy, M, F, K, E, activation=act, tma_ok=tma_ok, recompute=y is not None)
        plan = _PLANS.add(key, (_launch.dgrad_act_plan(
            dy, b, counts, h, dh, config, act, probs=probs, limit=limit, alpha=alpha, y=y),
            _launch.part_rows(config, F)))  # fmt: skip
    gemm, rows = plan
    part = None
    if probs is not None:
        part = torch.empty((rows, M), dtype=torch.float32, device=dy.device)
        if M == 0 or F == 0:
            return part.zero_()
    gemm(_launch.dact_tensors(dy, w, h, dh, probs, part, y), counts,
         routing or Routing(counts, M, E))
    return part


def _scales(t: torch.Tensor) -> torch.Tensor:
    """e8m0 scales as the bytes the kernels read."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def triton_fp8_forward(a, b, counts, out, routing=None) -> torch.Tensor:
    """``out[rows of e] = a[rows] @ b[e]`` with FP8 operands (:class:`~mtp.ops.quantize.Fp8Tensor`
    parts): ``a`` row-wise ``[M, K]``, ``b`` ``[E, K, N]`` with blocks along K (``"block"`` or
    ``"colwise"``); ``out`` BF16 (any float). ``routing`` is unused: the kernel reads the
    counts."""
    (M, K), (E, _, N) = a.data.shape, b.data.shape
    sa, sb = _scales(a.scales), _scales(b.scales)
    group_k, group_n = b.block
    key = ("fp8", a.recipe, b.layout, M, N, K, E, a.data.stride(), sa.stride(), b.data.stride(),
           sb.stride(), out.stride(), out.dtype, counts.dtype,
           aligned(a.data, sa, b.data, sb, out, counts), a.device, choice_state())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        config = _config(a.data, M, N, K, E, recipe=a.recipe)
        plan = _PLANS.add(key, _launch.fp8_forward_plan(
            a.data, sa, b.data, sb, counts, out, config, mx=a.recipe == "mxfp8",
            group_k=group_k, group_n=group_n))  # fmt: skip
    plan(a.data, sa, b.data, sb, counts, out)
    return out


def triton_fp8_wgrad(a, b, counts, out, accumulate=False) -> torch.Tensor:
    """``out[e] (+)= a_e^T b_e`` from expert-padded column-wise FP8 operands ``a [M', P]``,
    ``b [M', Q]`` (``accumulate``: added in fp32 in the epilogue)."""
    (_, P), Q, E = a.data.shape, b.data.shape[1], out.shape[0]
    sa, sb = _scales(a.scales), _scales(b.scales)
    key = ("fp8_wgrad", a.recipe, P, Q, E, a.data.stride(), sa.stride(), b.data.stride(),
           sb.stride(), out.stride(), out.dtype, counts.dtype,
           aligned(a.data, sa, b.data, sb, out, counts), a.device, accumulate,
           choice_state())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        config = _config(a.data, a.data.shape[0], Q, P, E, gemm="wgrad", recipe=a.recipe)
        plan = _PLANS.add(key, _launch.fp8_wgrad_plan(
            a.data, sa, b.data, sb, counts, out, config, mx=a.recipe == "mxfp8",
            group=a.block[0], accumulate=accumulate))  # fmt: skip
    plan(a.data, sa, b.data, sb, counts, out)
    return out
