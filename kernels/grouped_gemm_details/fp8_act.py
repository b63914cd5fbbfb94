"""FP8 kernels of the fused expert MLP (:func:`mtp.ops.grouped_mlp` with ``fp8_recipe``).

- :func:`grouped_gemm_fp8_act_kernel` (fc1): ``h = a[rows] @ b[e]`` from a row-wise FP8 ``a``
  (its rows, and their scales, read directly or through a row index: the MoE dispatch's gather
  fused into fc1, the tokens quantised once at their source rows) and an FP8 ``b`` quantised
  along K; the epilogue stores the pre-activation ``h`` (the activation dtype, for the
  backward) and writes ``y = act(h) * p`` **quantised**: e4m3 data and the row-wise scales of
  the recipe (``GROUP_Q`` columns per scale: 128 for blockwise, so a 128-column tile is one
  group; 32 for MXFP8, a tile holds ``BLOCK_N / 32`` groups). ``y`` is first rounded to the
  activation dtype, so the bytes equal :func:`mtp.ops.quantize` of the activation the BF16
  kernel would have stored (:mod:`mtp.kernels.quantize`'s scale, division and rounding).
  Gated activations hold two accumulators (gate and up columns) fed by one load of each ``a``
  tile.
- :func:`grouped_gemm_fp8_dact_kernel` (fc2's data gradient): ``dy = dout_q[rows] @ w2[e]^T``
  (FP8, never stored) with :func:`.epilogue.dact_epilogue`: ``dh``, the probabilities'
  partial sums and (``RECOMPUTE``) ``y = act(h) * p`` again for fc2's weight gradient.

Tiles as :mod:`.fp8`'s forward (device counts, a tile never spans two experts, a zero tail past
the routed rows); one launch each, no host work besides it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mtp.kernels.grouped_gemm_details.epilogue import (
    _act,
    dact_epilogue,
    dact_zero,
    gate_up,
    row_probs,
    source_rows,
)
from mtp.kernels.grouped_gemm_details.fp8 import _fp8_mma, _scaled_step
from mtp.kernels.grouped_gemm_details.pointer import _tile_coords
from mtp.kernels.grouped_gemm_details.tiles import expert_tile_map
from mtp.kernels.quantize import _absmax, _divide, _e4m3, _finite, _scale

__all__ = ["grouped_gemm_fp8_act_kernel", "grouped_gemm_fp8_dact_kernel", "row_tiles_bound"]


def row_tiles_bound(M: int, E: int, block_m: int) -> int:
    """Worst-case row tiles of ``M`` expert-grouped rows (each expert adds a partial tile)."""
    return triton.cdiv(M, block_m) + E


@triton.jit
def _dual_fp8_mma(
    a_ptr, sa_ptr, b_ptr, sb_ptr, expert, src, keep, gc, uc, mask_n, K,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, GROUP_N: tl.constexpr, MX: tl.constexpr, GATED: tl.constexpr,
):
    """fp32 ``a[src] @ b[expert][:, gc]`` and (``GATED``) ``a[src] @ b[expert][:, uc]``,
    dequantised, one load of each ``a`` tile (and its scales) for both."""
    ks = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    ca = gc.to(tl.int64)
    cg = uc.to(tl.int64)
    a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :] * stride_ak
    b_base = b_ptr + e64 * stride_be + ks[:, None] * stride_bk
    b_ptrs = b_base + ca[None, :] * stride_bn
    bg_ptrs = b_base + cg[None, :] * stride_bn
    sb_base = sb_ptr + e64 * stride_sbe
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range((K + BLOCK_K - 1) // BLOCK_K):
        k0 = kt * BLOCK_K
        left = K - k0
        a = tl.load(a_ptrs, mask=keep[:, None] & (ks[None, :] < left), other=0.0)
        kmask = (ks[:, None] < left) & mask_n[None, :]
        b = tl.load(b_ptrs, mask=kmask, other=0.0)
        if MX:
            js = tl.arange(0, BLOCK_K // 32)
            blk = k0 // 32 + js
            kk = js * 32 < left
            sa_ptrs = sa_ptr + src[:, None] * stride_sam + blk[None, :] * stride_sak
            sa_mask = keep[:, None] & kk[None, :]
            sb_mask = mask_n[:, None] & kk[None, :]
            sb_row = sb_base + blk[None, :] * stride_sbk
            acc_a = _scaled_step(acc_a, a, b, sa_ptrs, sb_row + ca[:, None] * stride_sbn,
                                 sa_mask, sb_mask, MX)  # fmt: skip
            if GATED:
                bg = tl.load(bg_ptrs, mask=kmask, other=0.0)
                acc_g = _scaled_step(acc_g, a, bg, sa_ptrs, sb_row + cg[:, None] * stride_sbn,
                                     sa_mask, sb_mask, MX)  # fmt: skip
        else:
            sa_ptrs = sa_ptr + src * stride_sam + (k0 // GROUP_K) * stride_sak
            sb_row = sb_base + (k0 // GROUP_K) * stride_sbk
            acc_a = _scaled_step(acc_a, a, b, sa_ptrs, sb_row + (ca // GROUP_N) * stride_sbn,
                                 keep, mask_n, MX)  # fmt: skip
            if GATED:
                bg = tl.load(bg_ptrs, mask=kmask, other=0.0)
                acc_g = _scaled_step(acc_g, a, bg, sa_ptrs,
                                     sb_row + (cg // GROUP_N) * stride_sbn, keep, mask_n, MX)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        bg_ptrs += BLOCK_K * stride_bk
    return acc_a, acc_g


@triton.jit
def _stored_value(y, dtype: tl.constexpr, SOFT_CVT: tl.constexpr):
    """fp32 ``y`` rounded to ``dtype`` and read back as the quantiser reads a stored tensor
    (``SOFT_CVT``: bf16 widened by its bits; ``+-inf`` as ``+-FLT_MAX``)."""
    v = y.to(dtype)
    if SOFT_CVT and dtype == tl.bfloat16:
        return _finite((v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32,
                                                                             bitcast=True))
    return _finite(v.to(tl.float32))


@triton.jit
def _quantize_groups(y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     SCALE: tl.constexpr, SOFT_CVT: tl.constexpr):  # fmt: skip
    """``(e4m3 [BLOCK_M, BLOCK_N], stored scales [BLOCK_M, BLOCK_N / GROUP])`` of fp32 ``y`` in
    ``1 x GROUP`` groups (:mod:`mtp.kernels.quantize`'s rules)."""
    y3 = tl.reshape(y, (BLOCK_M, BLOCK_N // GROUP, GROUP))
    scale, stored = _scale(_absmax(y3, 2), SCALE)
    q = _e4m3(_divide(y3, scale[:, :, None], SCALE), SOFT_CVT)
    return tl.reshape(q, (BLOCK_M, BLOCK_N)), stored


@triton.jit
def _act_store(
    acc_a, acc_g, prob, rows, mask_m, cols, pid_n, F, h_ptr, q_ptr, s_ptr,
    stride_hm, stride_qm, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_Q: tl.constexpr, ACT: tl.constexpr,
    HAS_PROB: tl.constexpr, SCALE: tl.constexpr, SOFT_CVT: tl.constexpr,
    LIMIT: tl.constexpr, ALPHA: tl.constexpr,
):
    """Store ``h`` (both halves when gated), then ``act(h) * prob`` quantised: data into ``q``
    and one scale per ``GROUP_Q`` columns into ``s``."""
    rows64 = rows.to(tl.int64)
    mask_n = cols < F
    mask = mask_m[:, None] & mask_n[None, :]
    gc, up = gate_up(cols, F, ACT)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + gc[None, :]
    ha = acc_a.to(h_ptr.dtype.element_ty)
    tl.store(h_ptrs, ha, mask=mask)
    hg = acc_g.to(h_ptr.dtype.element_ty)
    if ACT >= 2:
        tl.store(h_ptrs + up, hg, mask=mask)
    y = _act(ha.to(tl.float32), hg.to(tl.float32), ACT, LIMIT, ALPHA)
    if HAS_PROB:
        y = y * prob[:, None]
    y = tl.where(mask, _stored_value(y, h_ptr.dtype.element_ty, SOFT_CVT), 0.0)
    q, stored = _quantize_groups(y, BLOCK_M, BLOCK_N, GROUP_Q, SCALE, SOFT_CVT)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=mask)
    NG: tl.constexpr = BLOCK_N // GROUP_Q
    groups = pid_n * NG + tl.arange(0, NG)
    tl.store(s_ptr + rows64[:, None] * stride_sm + groups[None, :], stored,
             mask=mask_m[:, None] & (groups * GROUP_Q < F)[None, :])  # fmt: skip


@triton.jit
def grouped_gemm_fp8_act_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, h_ptr, q_ptr, s_ptr, p_ptr, g_ptr, pp_ptr, counts_ptr,
    M, F, K, E,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn,
    stride_hm, stride_qm, stride_sm, stride_ps, stride_pe,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, GROUP_K: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_Q: tl.constexpr, MX: tl.constexpr, ACT: tl.constexpr,
    HAS_PROB: tl.constexpr, GATHER: tl.constexpr, ROW_PROBS: tl.constexpr,
    SCALE: tl.constexpr, SOFT_CVT: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc1 in FP8 with its epilogue: ``h [M, W]`` (``W = 2F`` gated, else ``F``) and the
    quantised ``y = act(h) * p``: ``q [M, F]`` e4m3, ``s [M, cdiv(F, GROUP_Q)]`` (fp32, or e8m0
    bytes for ``SCALE = 2``); zeros (and the scale of a zero group) past the routed rows.

    ``a [S, K]`` e4m3 row-wise with scales ``sa [S, cdiv(K, GROUP_K)]``; row ``r`` reads
    ``a[r]`` or with ``GATHER`` ``a[g[r]]`` (``-1``: a zero row of probability 0) and the
    probability ``p[src * stride_ps + e * stride_pe]`` (``ROW_PROBS``: stored to ``pp[r]``).
    ``b [E, K, W]`` e4m3 with scales ``sb`` as :func:`.fp8.grouped_gemm_fp8_kernel`'s.
    ``BLOCK_N`` is a multiple of ``GROUP_Q``. Grid: the worst-case tiles over ``[M, F]``
    (:func:`row_tiles_bound` times ``cdiv(F, BLOCK_N)``)."""
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, F, E, BLOCK_M, BLOCK_N, BLOCK_E)
    expert, rows, mask_m, cols, pid_n = _tile_coords(
        tl.program_id(0), counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, expert_tiles,
        routed, BLOCK_M, BLOCK_N, GROUP_M)
    if expert >= 0:
        src, keep = source_rows(g_ptr, rows, mask_m, GATHER)
        gc, up = gate_up(cols, F, ACT)
        acc_a, acc_g = _dual_fp8_mma(
            a_ptr, sa_ptr, b_ptr, sb_ptr, expert, src, keep, gc, gc + up, cols < F, K,
            stride_am, stride_ak, stride_sam, stride_sak, stride_be, stride_bk, stride_bn,
            stride_sbe, stride_sbk, stride_sbn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_K, GROUP_N,
            MX, ACT >= 2)
    else:  # the zero tail: rows [routed, M)
        src = rows.to(tl.int64) * 0
        keep = rows < 0
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prob = row_probs(p_ptr, src, keep, tl.maximum(expert, 0), stride_ps, stride_pe, HAS_PROB)
    if ROW_PROBS:
        tl.store(pp_ptr + rows, prob, mask=mask_m & ((rows * 0 + pid_n) == 0))
    _act_store(acc_a, acc_g, prob, rows, mask_m, cols, pid_n, F, h_ptr, q_ptr, s_ptr,
               stride_hm, stride_qm, stride_sm, BLOCK_M, BLOCK_N, GROUP_Q, ACT, HAS_PROB,
               SCALE, SOFT_CVT, LIMIT, ALPHA)  # fmt: skip


@triton.jit
def grouped_gemm_fp8_dact_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, h_ptr, p_ptr, dh_ptr, part_ptr, y_ptr, counts_ptr,
    M, F, K, E,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn,
    stride_hm, stride_dm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, GROUP_K: tl.constexpr,
    GROUP_N: tl.constexpr, MX: tl.constexpr, ACT: tl.constexpr, HAS_PROB: tl.constexpr,
    RECOMPUTE: tl.constexpr, LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc2's FP8 data gradient with the activation's backward: ``dy = a[rows] @ b[e]`` (``a``
    the row-wise output gradient ``[M, K]``, ``b [E, K, F]`` fc2's weight quantised along
    ``K = H``), then :func:`.epilogue.dact_epilogue` on ``dy``: ``dh [M, W]``, the fp32
    partials ``part [cdiv(F, BLOCK_N), M]`` of ``dL/dp`` (``HAS_PROB``; ``p`` per row) and
    with ``RECOMPUTE`` ``y [M, F] = act(h) * p``; zeros past the routed rows."""
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, F, E, BLOCK_M, BLOCK_N, BLOCK_E)
    expert, rows, mask_m, cols, pid_n = _tile_coords(
        tl.program_id(0), counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, expert_tiles,
        routed, BLOCK_M, BLOCK_N, GROUP_M)
    if expert >= 0:
        dy = _fp8_mma(
            a_ptr, sa_ptr, b_ptr, sb_ptr, expert, rows.to(tl.int64), mask_m, cols, cols < F, K,
            stride_am, stride_ak, stride_sam, stride_sak, stride_be, stride_bk, stride_bn,
            stride_sbe, stride_sbk, stride_sbn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_K, GROUP_N, MX)
        dact_epilogue(dy, rows, mask_m, cols, cols < F, h_ptr, p_ptr, dh_ptr, part_ptr, y_ptr,
                      pid_n, M, F, stride_hm, stride_dm, stride_ym, ACT, HAS_PROB, RECOMPUTE,
                      LIMIT, ALPHA)  # fmt: skip
    else:
        dact_zero(rows, mask_m, cols, pid_n, M, F, dh_ptr, part_ptr, y_ptr, stride_dm,
                  stride_ym, ACT, HAS_PROB, RECOMPUTE, BLOCK_M, BLOCK_N)  # fmt: skip
