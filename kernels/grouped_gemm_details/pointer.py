"""Pointer kernels of the grouped GEMM: any strides, fp32/fp16/bf16, the interpreter, every GPU.

- :func:`grouped_gemm_kernel`: ``c[rows of e] = a[rows of e] @ b[e] (+ bias[e])`` for ``b`` of
  shape ``[E, K, N]`` with any strides (a transposed view gives ``trans_b`` and the data
  gradient); rows past ``sum(counts)`` (the tail of a worst-case buffer) are written as zeros by
  the same launch. Tiles are expert-major, grouped by ``GROUP_M`` row tiles inside an expert so
  that neighbouring programs share the ``a`` rows and the ``b[e]`` columns in L2. The grid is the
  worst case ``cdiv(M, BLOCK_M) + E`` row tiles times the column tiles (programs without work
  exit at once), or with ``PERSISTENT`` one wave of programs striding over the tiles.
- :func:`grouped_wgrad_kernel`: ``c[e] = a_e^T @ b_e`` (the weight gradient, ragged reduction
  dimension); grid ``E x tiles of c[e]``, each program loops over its expert's rows; experts
  without rows store exact zeros (``ACCUMULATE``: leave ``c[e]`` as it was).
- :func:`grouped_gemm_act_kernel` / :func:`grouped_gemm_dact_kernel`: the forward with the
  activation epilogue and the data gradient with the activation's backward
  (:mod:`.epilogue`); SwiGLU holds two accumulators so each ``a`` tile is read once.

Row scatter (``SCATTER``): the plain forward can store row ``r`` at ``c[s[r]]`` (fc2 writing
its rows straight back in the order they arrived in, see :func:`mtp.ops.grouped_mlp`).

Row gather (``GATHER`` / ``GATHER_A``): the forward with the activation epilogue and the weight
gradient can read their ``a`` rows through a row index ``g`` (row ``r`` of the expert-major
order is row ``g[r]`` of ``a``, ``-1`` a zero row), so that a permuted copy of ``a`` is never
written: the MoE dispatch's gather fused into the first expert GEMM. The index is loaded once
per row tile; the tile maps still enumerate the expert-major rows.

All accumulate in fp32 and store in the output dtype; row offsets are int64 (``M * K`` may
exceed 2^31 elements).
"""

import triton
import triton.language as tl

from mtp.kernels.grouped_gemm_details.epilogue import (
    add_bias,
    dact_epilogue,
    dact_zero,
    fwd_epilogue,
    fwd_zero,
    gate_up,
    row_probs,
    source_rows,
)
from mtp.kernels.grouped_gemm_details.tiles import (
    expert_tile_map,
    locate_expert_tile,
    mma_loop,
    tail_tile,
    wgrad_tile,
)

__all__ = [
    "grouped_gemm_act_kernel",
    "grouped_gemm_dact_kernel",
    "grouped_gemm_kernel",
    "grouped_wgrad_kernel",
]


@triton.jit
def _store_rows(c_ptr, s_ptr, rows, mask_m, cols, mask_n, val, stride_cm, stride_cn,
                SCATTER: tl.constexpr):  # fmt: skip
    """``c[rows, cols] = val``, or with ``SCATTER`` ``c[s[rows], cols]`` (``s[r] = -1``: row
    ``r`` is not stored)."""
    dst, keep = source_rows(s_ptr, rows, mask_m, SCATTER)
    c_ptrs = c_ptr + dst[:, None] * stride_cm + cols[None, :].to(tl.int64) * stride_cn
    tl.store(c_ptrs, val.to(c_ptr.dtype.element_ty), mask=keep[:, None] & mask_n[None, :])


@triton.jit
def _gemm_tile(
    a_ptr, b_ptr, c_ptr, bias_ptr, s_ptr, expert, row0, row_end, pid_m, pid_n, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """``c[rows, cols] = a[rows, :] @ b[expert][:, cols] (+ bias[expert, cols])`` for one tile
    (rows < row_end; ``SCATTER``: row ``r`` stored at ``c[s[r]]``)."""
    rows = row0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    mask_m = rows < row_end
    mask_n = cols < N
    rows64 = rows.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = (
        b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk
        + cols[None, :].to(tl.int64) * stride_bn
    )
    acc = mma_loop(
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs,
        mask_m[:, None], mask_n[None, :], ks[None, :], ks[:, None], K,
        BLOCK_K * stride_ak, BLOCK_K * stride_bk, BLOCK_K, UPCAST_DOT, DOT_PRECISION,
    )
    if HAS_BIAS:
        acc = add_bias(acc, bias_ptr, expert, N, cols, mask_n)
    _store_rows(c_ptr, s_ptr, rows, mask_m, cols, mask_n, acc, stride_cm, stride_cn, SCATTER)


@triton.jit
def _forward_tile(
    tile, a_ptr, b_ptr, c_ptr, bias_ptr, s_ptr, counts_ptr, M, N, K,
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCATTER: tl.constexpr,
):
    if tile < expert_tiles:
        expert, row0, row_end, pid_m, pid_n = locate_expert_tile(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, BLOCK_M, GROUP_M
        )
        _gemm_tile(
            a_ptr, b_ptr, c_ptr, bias_ptr, s_ptr, expert, row0, row_end, pid_m, pid_n, N, K,
            stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT, DOT_PRECISION, HAS_BIAS, SCATTER,
        )
    else:
        # The zero tail: rows [routed, M).
        rows, cols = tail_tile(tile, expert_tiles, routed, num_n, BLOCK_M, BLOCK_N)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        _store_rows(c_ptr, s_ptr, rows, rows < M, cols, cols < N, zeros, stride_cm, stride_cn,
                    SCATTER)  # fmt: skip


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, s_ptr, counts_ptr,
    M, N, K, E,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCATTER: tl.constexpr = False,
):
    """``c[M, N]``: rows of expert ``e`` get ``a[rows] @ b[e]`` (``+ bias[e]`` with
    ``HAS_BIAS``: a contiguous ``[E, N]`` added in the epilogue); rows past the routed ones
    get 0. ``SCATTER``: row ``r`` is stored at ``c[s[r]]`` instead (``s`` an ``[M]`` row index,
    ``-1``: not stored; the fc2 of experts whose rows go back in another order).

    ``counts_ptr`` points to ``E`` int32/int64 token counts (negative counts read as 0; rows at
    or past ``M`` are never touched). Without ``PERSISTENT`` program ``p`` handles tile ``p``
    and the grid must cover the worst case (:func:`num_row_tiles_bound` times the column
    tiles); with it, tiles ``p, p + grid, ...`` up to the actual number of tiles.
    """
    pid = tl.program_id(0)
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, N, E, BLOCK_M, BLOCK_N, BLOCK_E
    )
    if PERSISTENT:
        for tile in range(pid, total, tl.num_programs(0)):
            _forward_tile(
                tile, a_ptr, b_ptr, c_ptr, bias_ptr, s_ptr, counts_ptr, M, N, K,
                lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST_DOT, DOT_PRECISION, HAS_BIAS,
                SCATTER,
            )
    else:
        # Programs past the tail find only masked-out rows (rows >= M) and store nothing.
        _forward_tile(
            pid, a_ptr, b_ptr, c_ptr, bias_ptr, s_ptr, counts_ptr, M, N, K,
            lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
            stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST_DOT, DOT_PRECISION, HAS_BIAS,
            SCATTER,
        )


@triton.jit
def _gathered_wgrad_loop(
    acc, a_ptr, b_ptr, g_ptr, row0, rows_e, ps64, mask_p, qs64, mask_q, stride_am, stride_ap,
    stride_bm, stride_bq, BLOCK_R: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``acc += a[g[rows]]^T @ b[rows]`` over the expert's ``rows_e`` rows from ``row0``:
    each step loads the next ``BLOCK_R`` row numbers, then those rows of ``a``."""
    rs = tl.arange(0, BLOCK_R)
    for i in range((rows_e + BLOCK_R - 1) // BLOCK_R):
        r = row0.to(tl.int64) + i * BLOCK_R + rs
        src, keep = source_rows(g_ptr, r, rs < rows_e - i * BLOCK_R, True)
        a = tl.load(a_ptr + src[None, :] * stride_am + ps64[:, None] * stride_ap,
                    mask=mask_p[:, None] & keep[None, :], other=0.0)
        b = tl.load(b_ptr + r[:, None] * stride_bm + qs64[None, :] * stride_bq,
                    mask=keep[:, None] & mask_q[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, counts_ptr, g_ptr,
    M, P, Q, E,
    stride_am, stride_ap,
    stride_bm, stride_bq,
    stride_ce, stride_cp, stride_cq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_P: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False,
    GATHER_A: tl.constexpr = False,
):
    """``c[e] = a[rows of e]^T @ b[rows of e]`` (``[P, Q]`` per expert); zeros for empty experts.
    With ``ACCUMULATE`` the epilogue adds the product to ``c`` instead (``c += ...``, in fp32
    before the store: Megatron's gradient-accumulation fusion into an fp32 ``main_grad``).

    ``a`` is ``[M, P]`` and ``b`` is ``[M, Q]`` (any strides); with ``GATHER_A`` row ``r`` of
    ``a`` is read as ``a[g[r]]`` (``g``: ``[M]`` int32/int64, ``-1`` a zero row; ``a`` then has
    any number of rows). Grid: ``E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q)`` programs,
    expert-major, grouped by ``GROUP_P`` inside an expert.
    """
    _, expert, pid_p, pid_q = wgrad_tile(tl.program_id(0), E, P, Q, BLOCK_P, BLOCK_Q, GROUP_P)

    lane = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + lane, mask=lane < expert, other=0).to(tl.int32)
    row0 = tl.minimum(tl.sum(tl.maximum(counts, 0), axis=0), M)
    rows_e = tl.maximum(tl.load(counts_ptr + expert).to(tl.int32), 0)
    rows_e = tl.minimum(rows_e, M - row0)  # counts summing past M (invalid) never read past M

    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    ps = tl.max_contiguous(tl.multiple_of(ps, BLOCK_P), BLOCK_P)
    qs = tl.max_contiguous(tl.multiple_of(qs, BLOCK_Q), BLOCK_Q)
    rs = tl.arange(0, BLOCK_R)
    mask_p = ps < P
    mask_q = qs < Q
    # a is read transposed: its tile is [BLOCK_P, BLOCK_R].
    ps64 = ps.to(tl.int64)
    qs64 = qs.to(tl.int64)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    if GATHER_A:
        acc = _gathered_wgrad_loop(acc, a_ptr, b_ptr, g_ptr, row0, rows_e, ps64, mask_p, qs64,
                                   mask_q, stride_am, stride_ap, stride_bm, stride_bq, BLOCK_R,
                                   UPCAST_DOT, DOT_PRECISION)  # fmt: skip
    else:
        a_ptrs = (a_ptr + (row0.to(tl.int64) + rs[None, :]) * stride_am
                  + ps64[:, None] * stride_ap)  # fmt: skip
        b_ptrs = (b_ptr + (row0.to(tl.int64) + rs[:, None]) * stride_bm
                  + qs64[None, :] * stride_bq)  # fmt: skip
        acc = mma_loop(
            acc, a_ptrs, b_ptrs, mask_p[:, None], mask_q[None, :], rs[None, :], rs[:, None],
            rows_e, BLOCK_R * stride_am, BLOCK_R * stride_bm, BLOCK_R, UPCAST_DOT, DOT_PRECISION,
        )
    c_ptrs = (
        c_ptr + expert.to(tl.int64) * stride_ce + ps64[:, None] * stride_cp
        + qs64[None, :] * stride_cq
    )
    mask_c = mask_p[:, None] & mask_q[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _dual_mma(
    a_ptr, b_ptr, expert, rows64, mask_m, cols, mask_n, up_cols, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``a[rows] @ b[expert][:, cols]`` and, when ``GATED``, ``a[rows] @ b[expert][:, up_cols]``
    (one load of each ``a`` tile for both), fp32."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
    b_base = b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk
    b_ptrs = b_base + cols[None, :].to(tl.int64) * stride_bn
    bg_ptrs = b_base + up_cols[None, :].to(tl.int64) * stride_bn
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range((K + BLOCK_K - 1) // BLOCK_K):
        left = K - i * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (ks[None, :] < left), other=0.0)
        b_mask = (ks[:, None] < left) & mask_n[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc_a = tl.dot(a, b, acc_a, input_precision=DOT_PRECISION)
        if GATED:
            bg = tl.load(bg_ptrs, mask=b_mask, other=0.0)
            if UPCAST_DOT:
                bg = bg.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
            bg_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc_a, acc_g


@triton.jit
def _tile_coords(
    tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``(expert, rows, row mask, cols, column tile)`` of ``tile``; ``expert = -1`` for the
    zero-tail tiles (rows from ``routed`` on, masked at ``M``)."""
    if tile < expert_tiles:
        expert, row0, row_end, pid_m, pid_n = locate_expert_tile(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, BLOCK_M, GROUP_M
        )
        rows = row0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rows, cols = tail_tile(tile, expert_tiles, routed, num_n, BLOCK_M, BLOCK_N)
        mask_m = rows < M
        expert = tile * 0 - 1
        pid_n = (tile - expert_tiles) % num_n
    cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
    return expert, rows, mask_m, cols, pid_n


@triton.jit
def grouped_gemm_act_kernel(
    a_ptr, b_ptr, h_ptr, y_ptr, bias_ptr, p_ptr, g_ptr, pp_ptr, counts_ptr,
    M, F, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_hm, stride_ym,
    stride_ps, stride_pe,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROB: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702, GATHER: tl.constexpr = False,
    ROW_PROBS: tl.constexpr = False,
):
    """fc1 with its epilogue: ``h[rows of e] = a @ b[e] + bias[e]`` (``[M, W]``, ``W = 2F`` for
    the gated activations, else ``F``) and ``y = act(h) * p`` (``[M, F]``); zeros past the
    routed rows (``LIMIT`` / ``ALPHA``: the clamped SwiGLU's).

    Row ``r``'s ``a`` row and probability: ``a[r]`` and ``p[r * stride_ps + e * stride_pe]``, or
    with ``GATHER`` ``a[g[r]]`` and ``p[g[r] * stride_ps + e * stride_pe]`` (``g[r] = -1``: a
    zero row of probability 0). ``ROW_PROBS``: each row's probability is stored to ``pp[r]``.
    Tiles and grid as :func:`grouped_gemm_kernel` over ``[M, F]``."""
    pid = tl.program_id(0)
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, F, E, BLOCK_M, BLOCK_N, BLOCK_E
    )
    last = total if PERSISTENT else pid + 1
    for tile in range(pid, last, tl.num_programs(0)):
        expert, rows, mask_m, cols, pid_n = _tile_coords(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
            BLOCK_M, BLOCK_N, GROUP_M,
        )
        if expert >= 0:
            gc, up = gate_up(cols, F, ACT)
            src, keep = source_rows(g_ptr, rows, mask_m, GATHER)
            acc_a, acc_g = _dual_mma(
                a_ptr, b_ptr, expert, src, keep, gc, cols < F, gc + up, K,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, ACT >= 2, UPCAST_DOT, DOT_PRECISION,
            )
            prob = row_probs(p_ptr, src, keep, expert, stride_ps, stride_pe, HAS_PROB)
            if ROW_PROBS:
                tl.store(pp_ptr + rows, prob, mask=mask_m & ((rows * 0 + pid_n) == 0))
            fwd_epilogue(acc_a, acc_g, expert, rows, mask_m, cols, cols < F, h_ptr, y_ptr,
                         bias_ptr, prob, F, stride_hm, stride_ym, ACT, HAS_BIAS, HAS_PROB,
                         LIMIT, ALPHA)  # fmt: skip
        else:  # the zero tail: rows [routed, M)
            fwd_zero(rows, mask_m, cols, F, h_ptr, y_ptr, stride_hm, stride_ym, ACT,
                     BLOCK_M, BLOCK_N)
            if ROW_PROBS:
                tl.store(pp_ptr + rows, tl.zeros((BLOCK_M,), dtype=tl.float32),
                         mask=mask_m & ((rows * 0 + pid_n) == 0))


@triton.jit
def grouped_gemm_dact_kernel(
    g_ptr, b_ptr, h_ptr, p_ptr, dh_ptr, part_ptr, y_ptr, counts_ptr,
    M, F, K, E,
    stride_gm, stride_gk, stride_be, stride_bk, stride_bn, stride_hm, stride_dm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    ACT: tl.constexpr, HAS_PROB: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702, RECOMPUTE: tl.constexpr = False,
):
    """fc2's data gradient with the activation's backward: ``dy = g[rows of e] @ b[e]``
    (``[M, F]``, ``b[e]`` is ``w2[e]^T``), ``dh = dy * p * act'(h)`` (``[M, W]``) and
    ``part[tile column, row] = sum(dy * act(h))`` over the tile's columns (``[cdiv(F, BN), M]``
    fp32, with ``HAS_PROB``); with ``RECOMPUTE`` also ``y = act(h) * p`` (``[M, F]``, the
    forward's fc1 output, for fc2's weight gradient); zeros past the routed rows."""
    pid = tl.program_id(0)
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, F, E, BLOCK_M, BLOCK_N, BLOCK_E
    )
    last = total if PERSISTENT else pid + 1
    for tile in range(pid, last, tl.num_programs(0)):
        expert, rows, mask_m, cols, pid_n = _tile_coords(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
            BLOCK_M, BLOCK_N, GROUP_M,
        )
        if expert >= 0:
            dy, _ = _dual_mma(
                g_ptr, b_ptr, expert, rows.to(tl.int64), mask_m, cols, cols < F, cols, K,
                stride_gm, stride_gk, stride_be, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, False, UPCAST_DOT, DOT_PRECISION,
            )
            dact_epilogue(dy, rows, mask_m, cols, cols < F, h_ptr, p_ptr, dh_ptr, part_ptr,
                          y_ptr, pid_n, M, F, stride_hm, stride_dm, stride_ym, ACT, HAS_PROB,
                          RECOMPUTE, LIMIT, ALPHA)  # fmt: skip
        else:  # the zero tail
            dact_zero(rows, mask_m, cols, pid_n, M, F, dh_ptr, part_ptr, y_ptr, stride_dm,
                      stride_ym, ACT, HAS_PROB, RECOMPUTE, BLOCK_M, BLOCK_N)  # fmt: skip
