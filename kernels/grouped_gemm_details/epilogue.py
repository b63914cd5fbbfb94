"""Fused epilogues of the grouped GEMM kernels (pointer and TMA alike).

- Forward (:func:`fwd_epilogue`): on the fp32 accumulator(s) of ``x @ w[e]``: ``+ bias[e]``,
  store the pre-activation ``h`` (in the output dtype, saved for the backward), apply the
  activation and the row's routing probability, store ``y = act(h) * p``.
- Data gradient of the next GEMM (:func:`dact_epilogue`): on ``dy = dL/dy`` (fp32, never
  stored): load ``h``, recompute the activation, store ``dh = dy * p * act'(h)``, the fp32
  partial of ``dL/dp = sum_cols(dy * act(h))`` of this column tile and, optionally
  (``RECOMPUTE``), the forward's ``y = act(h) * p`` again (what the next GEMM's weight gradient
  reads: the forward need not keep it).
- :func:`row_probs`: each row's probability, read directly or through a row index (a GEMM
  that gathers its rows: ``probs[source row, expert]`` of a ``[S, E]`` or ``[S]`` tensor).
- :func:`add_bias`: the plain per-expert bias of the GEMM without an activation.

The activation of the *stored* (rounded) ``h`` is taken, so the forward and the backward agree.
Activations (``ACT``): :data:`ACTIVATIONS`: ``"gelu"`` (erf), ``"gelu_tanh"``, ``"swiglu"``
(gate columns ``[0, F)``, up ``[F, 2F)``: Megatron's ``chunk(2, -1)``) with
:mod:`mtp.kernels.bias_act`'s codes and +-inf handling, and GPT-OSS's ``"clamped_swiglu"``
(interleaved gate/up columns ``2j`` / ``2j + 1``, ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha
* g)`` with ``g = min(gate, L)``).
"""

import triton
import triton.language as tl

from mtp.kernels.bias_act import ACTIVATIONS as _BIAS_ACT_CODES
from mtp.kernels.bias_act import _gelu_and_grad, _silu_and_sigmoid

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "add_bias",
    "dact_epilogue",
    "dact_zero",
    "fwd_epilogue",
    "fwd_zero",
    "gate_up",
    "row_probs",
    "source_rows",
]

#: activation name -> the kernels' ``ACT``: bias_act's codes plus GPT-OSS's clamped SwiGLU
#: (interleaved gate/up columns). Codes >= 2 are gated (``w1`` holds ``2F`` columns).
ACTIVATIONS = {**_BIAS_ACT_CODES, "clamped_swiglu": 3}
GATED = ("swiglu", "clamped_swiglu")


@triton.jit
def add_bias(acc, bias_ptr, expert, N, cols, mask_n):
    """``acc + bias[expert, cols]`` in fp32 (``bias``: a contiguous ``[E, N]``)."""
    bias = tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=mask_n, other=0.0)
    return acc + bias.to(tl.float32)[None, :]


@triton.jit
def gate_up(cols, F, ACT: tl.constexpr):
    """Where the halves of output columns ``cols`` live in ``w1`` / ``h``: the gate's columns
    and the up half's offset from them (``cols`` and ``+F`` for SwiGLU's halves; ``2 cols`` and
    ``+1`` for the clamped SwiGLU's interleaved pairs; the offset is unused otherwise)."""
    if ACT == 3:
        return 2 * cols, 1
    return cols, F


@triton.jit
def _clamped_parts(ua, ug, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """GPT-OSS's clamped SwiGLU pieces: ``g = min(ua, L)``, ``clamp(ug, -L, L) + 1``,
    ``sigmoid(ALPHA * g)``; the activation is ``(clamp(ug) + 1) * g * sigmoid(ALPHA * g)``."""
    gate = tl.where(ua > LIMIT, LIMIT, ua)
    up1 = tl.where(ug > LIMIT, LIMIT, tl.where(ug < -LIMIT, -LIMIT, ug)) + 1.0
    return gate, up1, tl.sigmoid(ALPHA * gate)


@triton.jit
def _clamped_swiglu_grad(ua, ug, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """The clamped SwiGLU and its derivatives in ``ua`` and ``ug`` (zero where the clamps cut,
    as ``torch.clamp``'s)."""
    gate, up1, sig = _clamped_parts(ua, ug, LIMIT, ALPHA)
    glu = gate * sig
    grad_a = tl.where(ua > LIMIT, 0.0, up1 * (sig + ALPHA * gate * sig * (1.0 - sig)))
    grad_g = tl.where((ug >= -LIMIT) & (ug <= LIMIT), glu, 0.0)
    return up1 * glu, grad_a, grad_g


@triton.jit
def _act(ua, ug, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """The activation of the fp32 pre-activation: ``silu(ua) * ug`` (SwiGLU), the clamped
    SwiGLU, or ``gelu(ua)``."""
    if ACT == 3:
        gate, up1, sig = _clamped_parts(ua, ug, LIMIT, ALPHA)
        return up1 * gate * sig
    if ACT == 2:
        silu, _, _ = _silu_and_sigmoid(ua)
        return silu * ug
    y, _ = _gelu_and_grad(ua, ACT == 1, False)
    return y


@triton.jit
def source_rows(g_ptr, rows, mask_m, GATHER: tl.constexpr):
    """``(source rows (int64), mask)`` of output ``rows``: the rows themselves, or with
    ``GATHER`` the row index ``g[rows]`` (``-1``: no source row, masked out and read as 0)."""
    if GATHER:
        src = tl.load(g_ptr + rows, mask=mask_m, other=-1).to(tl.int64)
        keep = mask_m & (src >= 0)
        return tl.where(keep, src, 0), keep
    return rows.to(tl.int64), mask_m


@triton.jit
def row_probs(p_ptr, src, keep, expert, stride_ps, stride_pe, HAS_PROB: tl.constexpr):
    """fp32 ``p[src * stride_ps + expert * stride_pe]`` of each row (0 where not ``keep``;
    zeros without ``HAS_PROB``)."""
    if HAS_PROB:
        offs = src * stride_ps + expert.to(tl.int64) * stride_pe
        return tl.load(p_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    return tl.zeros(src.shape, dtype=tl.float32)


@triton.jit
def fwd_epilogue(
    acc_a, acc_g, expert, rows, mask_m, cols, mask_n, h_ptr, y_ptr, bias_ptr, prob, F,
    stride_hm, stride_ym, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROB: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc1's epilogue on the fp32 accumulators (``acc_g``: the up half, gated activations
    only): + bias, store ``h``, store ``act(h) * prob`` (``prob``: the rows' fp32
    probabilities, :func:`row_probs`)."""
    rows64 = rows.to(tl.int64)
    gc, up = gate_up(cols, F, ACT)
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert.to(tl.int64) * (2 * F if ACT >= 2 else F) + gc
        acc_a += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ACT >= 2:
            acc_g += tl.load(b_ptrs + up, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + gc[None, :]
    ha = acc_a.to(h_ptr.dtype.element_ty)
    tl.store(h_ptrs, ha, mask=mask)
    hg = acc_g.to(h_ptr.dtype.element_ty)
    if ACT >= 2:
        tl.store(h_ptrs + up, hg, mask=mask)
    y = _act(ha.to(tl.float32), hg.to(tl.float32), ACT, LIMIT, ALPHA)
    if HAS_PROB:
        y = y * prob[:, None]
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def fwd_zero(rows, mask_m, cols, F, h_ptr, y_ptr, stride_hm, stride_ym, ACT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Zeros in ``h`` and ``y`` for a tile of the rows past the routed ones."""
    mask = mask_m[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=h_ptr.dtype.element_ty)
    gc, up = gate_up(cols, F, ACT)
    h_ptrs = h_ptr + rows64 * stride_hm + gc[None, :]
    tl.store(h_ptrs, zeros, mask=mask)
    if ACT >= 2:
        tl.store(h_ptrs + up, zeros, mask=mask)
    tl.store(y_ptr + rows64 * stride_ym + cols[None, :], zeros, mask=mask)


@triton.jit
def dact_epilogue(
    dy, rows, mask_m, cols, mask_n, h_ptr, p_ptr, dh_ptr, part_ptr, y_ptr, pid_n, M, F,
    stride_hm, stride_dm, stride_ym, ACT: tl.constexpr, HAS_PROB: tl.constexpr,
    RECOMPUTE: tl.constexpr, LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc2's data-gradient epilogue on ``dy = dL/dy`` (fp32): ``dh`` and the ``dL/dp``
    partial of this column tile; with ``RECOMPUTE`` also ``y = act(h) * p`` (the forward's
    output, bit-equal: the forward's fp32 operations on the same stored ``h``)."""
    rows64 = rows.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    gc, up = gate_up(cols, F, ACT)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + gc[None, :]
    dh_ptrs = dh_ptr + rows64[:, None] * stride_dm + gc[None, :]
    # The order keeps few [BLOCK_M, BLOCK_N] fp32 values alive at once (no spills).
    ua = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 3:
        ug = tl.load(h_ptrs + up, mask=mask, other=0.0).to(tl.float32)
        act, grad_a, grad_g = _clamped_swiglu_grad(ua, ug, LIMIT, ALPHA)
    elif ACT == 2:
        silu, sig, c = _silu_and_sigmoid(ua)
        dsilu = sig + c * sig * (1.0 - sig)
        ug = tl.load(h_ptrs + up, mask=mask, other=0.0).to(tl.float32)
        act, grad_a, grad_g = silu * ug, ug * dsilu, silu
    else:
        act, grad_a = _gelu_and_grad(ua, ACT == 1, True)
        grad_g = 0.0
    scaled = dy
    if HAS_PROB:
        dp = tl.sum(tl.where(mask, dy * act, 0.0), axis=1)
        tl.store(part_ptr + pid_n.to(tl.int64) * M + rows, dp, mask=mask_m)
        prob = tl.load(p_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        scaled = dy * prob[:, None]
    if ACT >= 2:
        tl.store(dh_ptrs + up, (scaled * grad_g).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs, (scaled * grad_a).to(dh_ptr.dtype.element_ty), mask=mask)
    if RECOMPUTE:  # after dh: the tile's h again (cache-hot), so no more values live at once
        ua = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        ug = ua
        if ACT >= 2:
            ug = tl.load(h_ptrs + up, mask=mask, other=0.0).to(tl.float32)
        y = _act(ua, ug, ACT, LIMIT, ALPHA)  # the forward's function: bit-equal to its y
        if HAS_PROB:
            y = y * prob[:, None]
        tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dact_zero(rows, mask_m, cols, pid_n, M, F, dh_ptr, part_ptr, y_ptr, stride_dm, stride_ym,
              ACT: tl.constexpr, HAS_PROB: tl.constexpr, RECOMPUTE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Zeros in ``dh``, the ``dL/dp`` partials (and ``y``) for a tile of the rows past the
    routed ones."""
    mask = mask_m[:, None] & (cols < F)[None, :]
    if RECOMPUTE:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                 tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=mask)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=dh_ptr.dtype.element_ty)
    gc, up = gate_up(cols, F, ACT)
    dh_ptrs = dh_ptr + rows.to(tl.int64)[:, None] * stride_dm + gc[None, :]
    tl.store(dh_ptrs, zeros, mask=mask)
    if ACT >= 2:
        tl.store(dh_ptrs + up, zeros, mask=mask)
    if HAS_PROB:
        tl.store(part_ptr + pid_n.to(tl.int64) * M + rows,
                 tl.zeros((BLOCK_M,), dtype=tl.float32), mask=mask_m)  # fmt: skip
