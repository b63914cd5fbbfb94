"""FP8 kernels of the grouped GEMM: e4m3 operands with block scales (``mtp.ops.quantize``),
fp32 accumulation, output in the output buffer's dtype (BF16).

Two recipes (``MX`` constexpr):

- blockwise (DeepSeek-V3): ``a`` scaled per ``1 x GROUP_K`` row block, ``b`` per
  ``GROUP_K x GROUP_N`` block (``GROUP_N`` 128 for 128 x 128 weight blocks, 1 for column-wise
  ones). ``BLOCK_K`` divides ``GROUP_K``, so each K step's ``tl.dot`` (fp32, a fresh
  accumulator: the promotion out of the tensor cores' narrower FP8 accumulation) is scaled by
  the outer product of its row and column scales and added to the fp32 accumulator. On sm_90a
  the dot is the FP8 wgmma (``QGMMA``), on sm_100a ``tcgen05.mma kind::f8f6f4``.
- mxfp8 (OCP MX): every operand scaled per 32 elements along K with e8m0 bytes;
  ``tl.dot_scaled`` applies them (sm_100a: the block-scaled ``tcgen05.mma``, ``UTCQMMA``).

Both address memory with pointers and strides (any layout; the op stores the reduction axis
contiguously, as the tensor cores read FP8), so ragged groups need no alignment: the forward
takes its tiles from the device counts like :mod:`.pointer` (a row tile never spans two
experts; rows past ``sum(counts)`` get zeros), and the weight gradient reads column-wise
operands whose experts start on whole scale blocks (the padded layout of
``mtp.ops.quantize(..., tokens_per_expert=...)``), one launch for every expert.
"""

import triton
import triton.language as tl

from mtp.kernels.grouped_gemm_details.tiles import (
    expert_tile_map,
    locate_expert_tile,
    tail_tile,
    wgrad_tile,
)

__all__ = ["grouped_gemm_fp8_kernel", "grouped_wgrad_fp8_kernel"]


@triton.jit
def _scaled_step(acc, a, b, sa_ptrs, sb_ptrs, sa_mask, sb_mask, MX: tl.constexpr):
    """``acc + (a * sa) @ (b * sb)`` for one K step: ``MX`` e8m0 scales ``[rows, BK/32]`` and
    ``[cols, BK/32]`` through ``tl.dot_scaled``; else fp32 scales per row and per column."""
    if MX:
        sa = tl.load(sa_ptrs, mask=sa_mask, other=127)
        sb = tl.load(sb_ptrs, mask=sb_mask, other=127)
        acc = tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)
    else:
        sa = tl.load(sa_ptrs, mask=sa_mask, other=0.0)
        sb = tl.load(sb_ptrs, mask=sb_mask, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def _fp8_mma(
    a_ptr, sa_ptr, b_ptr, sb_ptr, expert, rows64, mask_m, cols, mask_n, K,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, GROUP_N: tl.constexpr, MX: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_N]``: ``a[rows, :] @ b[expert][:, cols]``, dequantised."""
    ks = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    cols64 = cols.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + e64 * stride_be + ks[:, None] * stride_bk + cols64[None, :] * stride_bn
    sb_base = sb_ptr + e64 * stride_sbe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range((K + BLOCK_K - 1) // BLOCK_K):
        k0 = kt * BLOCK_K
        left = K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (ks[None, :] < left), other=0.0)
        b = tl.load(b_ptrs, mask=(ks[:, None] < left) & mask_n[None, :], other=0.0)
        if MX:
            js = tl.arange(0, BLOCK_K // 32)
            blk = k0 // 32 + js
            keep = js * 32 < left
            sa_ptrs = sa_ptr + rows64[:, None] * stride_sam + blk[None, :] * stride_sak
            sb_ptrs = sb_base + blk[None, :] * stride_sbk + cols64[:, None] * stride_sbn
            acc = _scaled_step(acc, a, b, sa_ptrs, sb_ptrs, mask_m[:, None] & keep[None, :],
                               mask_n[:, None] & keep[None, :], MX)  # fmt: skip
        else:
            sa_ptrs = sa_ptr + rows64 * stride_sam + (k0 // GROUP_K) * stride_sak
            sb_ptrs = sb_base + (k0 // GROUP_K) * stride_sbk + (cols64 // GROUP_N) * stride_sbn
            acc = _scaled_step(acc, a, b, sa_ptrs, sb_ptrs, mask_m, mask_n, MX)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _fp8_tile(
    tile, a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, counts_ptr, M, N, K,
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUP_K: tl.constexpr, GROUP_N: tl.constexpr, MX: tl.constexpr,
):
    """One output tile: an expert's (the GEMM), or one of the zero tail past the routed rows."""
    if tile < expert_tiles:
        expert, row0, row_end, pid_m, pid_n = locate_expert_tile(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, BLOCK_M, GROUP_M)
        rows = row0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
        mask_m = rows < row_end
        mask_n = cols < N
        rows64 = rows.to(tl.int64)
        acc = _fp8_mma(
            a_ptr, sa_ptr, b_ptr, sb_ptr, expert, rows64, mask_m, cols, mask_n, K,
            stride_am, stride_ak, stride_sam, stride_sak, stride_be, stride_bk, stride_bn,
            stride_sbe, stride_sbk, stride_sbn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_K, GROUP_N, MX)
        c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:
        rows, cols = tail_tile(tile, expert_tiles, routed, num_n, BLOCK_M, BLOCK_N)
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def grouped_gemm_fp8_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, counts_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn,
    stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, GROUP_K: tl.constexpr,
    GROUP_N: tl.constexpr, MX: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """``c[M, N]`` (unit column stride): rows of expert ``e`` get ``a[rows] @ b[e]``, both
    dequantised; rows past the routed ones get 0.

    ``a [M, K]`` e4m3 with scales ``sa [M, cdiv(K, GROUP_K)]``; ``b [E, K, N]`` e4m3 with
    scales ``sb [E, cdiv(K, GROUP_K), cdiv(N, GROUP_N)]`` (fp32; ``MX``: e8m0 bytes and
    ``GROUP_K = 32``, ``GROUP_N = 1``); any strides. ``counts_ptr``: ``E`` int32/int64 counts.
    Grid and ``PERSISTENT`` as :func:`.pointer.grouped_gemm_kernel`'s.
    """
    pid = tl.program_id(0)
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, N, E, BLOCK_M, BLOCK_N, BLOCK_E)
    if PERSISTENT:
        for tile in range(pid, total, tl.num_programs(0)):
            _fp8_tile(tile, a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, counts_ptr, M, N, K,
                      lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
                      stride_am, stride_ak, stride_sam, stride_sak, stride_be, stride_bk,
                      stride_bn, stride_sbe, stride_sbk, stride_sbn, stride_cm,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, GROUP_K, GROUP_N, MX)  # fmt: skip
    else:
        _fp8_tile(pid, a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, counts_ptr, M, N, K,
                  lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
                  stride_am, stride_ak, stride_sam, stride_sak, stride_be, stride_bk,
                  stride_bn, stride_sbe, stride_sbk, stride_sbn, stride_cm,
                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, GROUP_K, GROUP_N, MX)  # fmt: skip


@triton.jit
def _padded_rows(counts_ptr, expert, BLOCK_E: tl.constexpr, GROUP: tl.constexpr):
    """``(first row, rows)`` of ``expert`` in a padded column-wise operand: the experts before
    it take whole ``GROUP``-row blocks each."""
    lane = tl.arange(0, BLOCK_E)
    counts = tl.maximum(tl.load(counts_ptr + lane, mask=lane < expert, other=0).to(tl.int32), 0)
    first = tl.sum((counts + GROUP - 1) // GROUP, axis=0) * GROUP
    return first, tl.maximum(tl.load(counts_ptr + expert).to(tl.int32), 0)


@triton.jit
def grouped_wgrad_fp8_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, counts_ptr,
    P, Q, E,
    stride_am, stride_ap, stride_sam, stride_sap,
    stride_bm, stride_bq, stride_sbm, stride_sbq,
    stride_ce, stride_cp, stride_cq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_P: tl.constexpr, GROUP: tl.constexpr, MX: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """``c[e] = a_e^T @ b_e`` (``[P, Q]``; zeros for empty experts; ``ACCUMULATE``: added to
    ``c`` in fp32), both dequantised, one launch for every expert.

    ``a [M', P]`` and ``b [M', Q]`` are column-wise e4m3 operands with ``GROUP x 1`` blocks
    (scales ``[M' / GROUP, P]`` and ``[M' / GROUP, Q]``) in the padded layout: expert ``e``'s
    rows start at a multiple of ``GROUP`` (:func:`_padded_rows`) and its padding holds zeros.
    ``BLOCK_R`` divides ``GROUP`` (blockwise: a step never straddles two scale blocks, nor the
    expert's padded end) or is a multiple of 32 (``MX``: the rows are masked). Grid:
    ``E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q)``.
    """
    _, expert, pid_p, pid_q = wgrad_tile(tl.program_id(0), E, P, Q, BLOCK_P, BLOCK_Q, GROUP_P)
    start, rows_e = _padded_rows(counts_ptr, expert, BLOCK_E, GROUP)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    mask_p = ps < P
    mask_q = qs < Q
    ps64 = ps.to(tl.int64)
    qs64 = qs.to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    start64 = start.to(tl.int64)
    a_ptrs = a_ptr + (start64 + rs)[None, :] * stride_am + ps64[:, None] * stride_ap
    b_ptrs = b_ptr + (start64 + rs)[:, None] * stride_bm + qs64[None, :] * stride_bq
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for i in range((rows_e + BLOCK_R - 1) // BLOCK_R):
        left = rows_e - i * BLOCK_R
        if MX:  # a step of 128 rows may reach the next expert's 32-row blocks
            a = tl.load(a_ptrs, mask=mask_p[:, None] & (rs[None, :] < left), other=0.0)
            b = tl.load(b_ptrs, mask=(rs[:, None] < left) & mask_q[None, :], other=0.0)
        else:  # the expert's padding (zeros) ends on a multiple of GROUP: no row mask
            a = tl.load(a_ptrs, mask=mask_p[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_q[None, :], other=0.0)
        if MX:
            js = tl.arange(0, BLOCK_R // 32)
            blk = (start64 + i * BLOCK_R) // 32 + js
            jkeep = js * 32 < left
            acc = _scaled_step(acc, a, b, sa_ptr + blk[None, :] * stride_sam
                               + ps64[:, None] * stride_sap, sb_ptr + blk[None, :] * stride_sbm
                               + qs64[:, None] * stride_sbq, mask_p[:, None] & jkeep[None, :],
                               mask_q[:, None] & jkeep[None, :], MX)  # fmt: skip
        else:
            blk = (start64 + i * BLOCK_R) // GROUP
            acc = _scaled_step(acc, a, b, sa_ptr + blk * stride_sam + ps64 * stride_sap,
                               sb_ptr + blk * stride_sbm + qs64 * stride_sbq, mask_p, mask_q,
                               MX)  # fmt: skip
        a_ptrs += BLOCK_R * stride_am
        b_ptrs += BLOCK_R * stride_bm
    c_ptrs = (c_ptr + expert.to(tl.int64) * stride_ce + ps64[:, None] * stride_cp
              + qs64[None, :] * stride_cq)  # fmt: skip
    mask_c = mask_p[:, None] & mask_q[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)
