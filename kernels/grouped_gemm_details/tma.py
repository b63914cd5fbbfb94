"""TMA kernels of the grouped GEMM (Hopper sm_90a, Blackwell sm_100a): the pointer kernels'
contracts (:mod:`.pointer`) for 16-bit operands whose last dimension is contiguous and whose
other strides are 16-byte multiples.

- :func:`grouped_gemm_tma_kernel` (after :func:`.tiles.tile_map_kernel`, so it holds no
  reductions: Hopper's automatic warp specialisation rejects them): persistent, each program
  strides over the output tiles with ``tl.range(..., flatten=FLATTEN,
  warp_specialize=WARP_SPECIALIZE)``; flattening fuses the tile loop with the K loop (the next
  tile's loads overlap this tile's epilogue), warp specialisation splits producer (TMA) and
  consumer (MMA) warps (``setmaxnreg``). ``a`` and ``b`` are read through device-side
  descriptors; ``b`` as a 3-d ``[E, K, N]`` (or ``[E, N, K]``) descriptor so a partial K tile
  never reads the next expert. A row tile may run past its expert into the next one's rows:
  those rows are computed but masked out in the epilogue. A second loop writes the zero tail.
- :func:`grouped_wgrad_tma_kernel` (after :func:`.tiles.tile_map_kernel`'s head): ``c[e] = a_e^T @
  b_e`` with per-expert descriptors whose row count ends at the expert's (or the split's) last
  row, so TMA zero-fills the rows past it. With ``SPLIT > 1`` each expert's rows are cut into
  ``SPLIT`` chunks writing fp32 partial sums that :func:`split_reduce_kernel` adds in a fixed
  order (deterministic, no atomics).
- :func:`grouped_gemm_act_tma_kernel` / :func:`grouped_gemm_dact_tma_kernel`: the fused
  activation kernels' main loop through descriptors (SwiGLU: two ``b`` tiles per K step from one
  ``[E, K, 2F]`` descriptor, gate at column ``col``, up at ``col + F``; a gate tile running past
  ``F`` reads up columns that the epilogue masks out); not warp-specialised (their epilogue keeps
  several fp32 tiles alive).

Device-side descriptors need a little global scratch per program: the launcher
(:mod:`.launch`) makes sure Triton has an allocator.
"""

import triton
import triton.language as tl

from mtp.kernels.grouped_gemm_details.epilogue import (
    add_bias,
    dact_epilogue,
    dact_zero,
    fwd_epilogue,
    fwd_zero,
    row_probs,
)
from mtp.kernels.grouped_gemm_details.tiles import map_tile, tail_tile, wgrad_tile

__all__ = [
    "grouped_gemm_act_tma_kernel",
    "grouped_gemm_dact_tma_kernel",
    "grouped_gemm_tma_kernel",
    "grouped_wgrad_tma_kernel",
    "split_reduce_kernel",
]


@triton.jit
def grouped_gemm_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, map_ptr,
    M, N, K, E,
    stride_am, stride_be, stride_bk, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TRANS_B: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MAP_OFF: tl.constexpr,
):
    """``c[M, N]``: rows of expert ``e`` get ``a[rows] @ b[e]`` (``+ bias[e]``, a contiguous
    ``[E, N]``, with ``HAS_BIAS``); rows past the routed ones get 0.

    ``a`` is ``[M, K]`` with unit column stride; ``b`` is ``[E, K, N]`` with unit N stride, or
    with ``TRANS_B`` an ``[E, N, K]`` tensor with unit K stride (``stride_bk`` / ``stride_bn``
    then name its K / N strides). ``c`` has unit column stride. ``map_ptr``: the routing buffer
    of :func:`.tiles.tile_map_kernel`, whose tile map replaces reductions here (Hopper's
    automatic warp specialisation does not take them). Any grid: program ``p`` handles tiles
    ``p, p + grid, ...``; inside an expert ``GROUP_M`` row tiles share each column tile of
    ``b[e]`` (L2 reuse).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # The tile map after the routing head, at the launch's constexpr `head_size(E)`
    # (folded into the loads' addresses: no derived pointer kept in a register).
    map_ptr = map_ptr + MAP_OFF
    a_desc = tl.make_tensor_descriptor(
        a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    if TRANS_B:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[E, N, K], strides=[stride_be, stride_bn, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )
    else:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[E, K, N], strides=[stride_be, stride_bk, 1],
            block_shape=[1, BLOCK_K, BLOCK_N],
        )
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    expert_tiles = tl.load(map_ptr) * num_n
    routed = tl.load(map_ptr + 1)
    for tile in tl.range(pid, expert_tiles, programs, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        expert, row0, rows_e, row, col = map_tile(map_ptr, tile, num_n, BLOCK_M, BLOCK_N,
                                                  GROUP_M)  # fmt: skip
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            k = kt * BLOCK_K
            a = a_desc.load([row, k])
            if TRANS_B:
                b = b_desc.load([expert, col, k]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = b_desc.load([expert, k, col]).reshape(BLOCK_K, BLOCK_N)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        # Epilogue: rows past the expert (the next expert's, or past M) are masked out.
        rows = row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc = add_bias(acc, bias_ptr, expert, N, cols, cols < N)
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        mask = (rows < tl.minimum(row0 + rows_e, M))[:, None] & (cols < N)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    # The zero tail: rows [routed, M).
    tail_tiles = (M - routed + BLOCK_M - 1) // BLOCK_M * num_n
    for tile in range(pid, tail_tiles, programs):
        rows, cols = tail_tile(tile, 0, routed, num_n, BLOCK_M, BLOCK_N)
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def grouped_wgrad_tma_kernel(
    a_ptr, b_ptr, c_ptr, rows_ptr,
    M, P, Q, E,
    stride_am, stride_bm, stride_ce, stride_cp, stride_cs,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_P: tl.constexpr, SPLIT: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, UPCAST_DOT: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):
    """``c[e] = a[rows of e]^T @ b[rows of e]`` (``[P, Q]``; zeros for empty experts).

    ``a`` is ``[M, P]`` and ``b`` ``[M, Q]``, both with unit column stride. Grid:
    ``SPLIT * E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q)``. With ``SPLIT == 1`` ``c`` is the
    ``[E, P, Q]`` output (unit last stride); otherwise an fp32 workspace ``[SPLIT, E, P, Q]``
    (``stride_cs`` its split stride) that :func:`split_reduce_kernel` sums. ``ACCUMULATE``
    (``SPLIT == 1`` only): ``c += ...`` in the epilogue.
    """
    split, expert, pid_p, pid_q = wgrad_tile(tl.program_id(0), E, P, Q, BLOCK_P, BLOCK_Q,
                                             GROUP_P)  # fmt: skip
    p0 = pid_p * BLOCK_P
    q0 = pid_q * BLOCK_Q

    # Expert rows from :func:`.tiles.tile_map_kernel`'s head (no reductions here, as in the
    # forward).
    row0 = tl.load(rows_ptr + expert)
    rows_e = tl.load(rows_ptr + E + expert)
    # This split's rows, whole BLOCK_R chunks each (the last split may get fewer or none).
    chunk = ((rows_e + SPLIT - 1) // SPLIT + BLOCK_R - 1) // BLOCK_R * BLOCK_R
    r_start = row0 + split * chunk
    r_end = tl.minimum(row0 + rows_e, r_start + chunk)
    # Descriptors whose row count ends at r_end: TMA zero-fills the next expert's rows.
    a_desc = tl.make_tensor_descriptor(
        a_ptr, shape=[tl.maximum(r_end, 1), P], strides=[stride_am, 1],
        block_shape=[BLOCK_R, BLOCK_P],
    )
    b_desc = tl.make_tensor_descriptor(
        b_ptr, shape=[tl.maximum(r_end, 1), Q], strides=[stride_bm, 1],
        block_shape=[BLOCK_R, BLOCK_Q],
    )
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r in tl.range(r_start, r_end, BLOCK_R, warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([r, p0]).T
        b = b_desc.load([r, q0])
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    ps = p0 + tl.arange(0, BLOCK_P)
    qs = q0 + tl.arange(0, BLOCK_Q)
    c_ptrs = (
        c_ptr + split.to(tl.int64) * stride_cs + expert.to(tl.int64) * stride_ce
        + ps.to(tl.int64)[:, None] * stride_cp + qs[None, :]
    )
    mask_c = (ps < P)[:, None] & (qs < Q)[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def split_reduce_kernel(
    ws_ptr, c_ptr, numel, PQ, Q, stride_ce, stride_cp, stride_cq,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):
    """``c[e, p, q] = sum_s ws[s, e, p, q]`` in split order (``ws`` contiguous fp32); with
    ``ACCUMULATE`` added to ``c``'s value (in fp32)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * numel + offs, mask=keep, other=0.0)
    e = offs // PQ
    p = (offs % PQ) // Q
    q = offs % Q
    c_ptrs = c_ptr + e * stride_ce + p * stride_cp + q * stride_cq
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=keep, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=keep)


@triton.jit
def grouped_gemm_act_tma_kernel(
    a_ptr, b_ptr, h_ptr, y_ptr, bias_ptr, p_ptr, map_ptr,
    M, F, K, E,
    stride_am, stride_be, stride_bk, stride_hm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROB: tl.constexpr,
    MAP_OFF: tl.constexpr,
):
    """fc1 with its epilogue (see :func:`.pointer.grouped_gemm_act_kernel`);
    ``a`` ``[M, K]`` and ``b`` ``[E, K, W]`` with unit last strides."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # The tile map after the routing head, at the launch's constexpr `head_size(E)`
    # (folded into the loads' addresses: no derived pointer kept in a register).
    map_ptr = map_ptr + MAP_OFF
    a_desc = tl.make_tensor_descriptor(
        a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    b_desc = tl.make_tensor_descriptor(
        b_ptr, shape=[E, K, 2 * F if ACT >= 2 else F], strides=[stride_be, stride_bk, 1],
        block_shape=[1, BLOCK_K, BLOCK_N],
    )
    num_n = (F + BLOCK_N - 1) // BLOCK_N
    expert_tiles = tl.load(map_ptr) * num_n
    routed = tl.load(map_ptr + 1)
    for tile in tl.range(pid, expert_tiles, programs, flatten=FLATTEN):
        expert, row0, rows_e, row, col = map_tile(map_ptr, tile, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range((K + BLOCK_K - 1) // BLOCK_K):
            k = kt * BLOCK_K
            a = a_desc.load([row, k])
            b = b_desc.load([expert, k, col]).reshape(BLOCK_K, BLOCK_N)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc_a = tl.dot(a, b, acc_a)
            if ACT == 2:
                bg = b_desc.load([expert, k, col + F]).reshape(BLOCK_K, BLOCK_N)
                if UPCAST_DOT:
                    bg = bg.to(tl.float32)
                acc_g = tl.dot(a, bg, acc_g)
        rows = row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        mask_m = rows < tl.minimum(row0 + rows_e, M)
        prob = row_probs(p_ptr, rows.to(tl.int64), mask_m, expert, 1, 0, HAS_PROB)
        fwd_epilogue(acc_a, acc_g, expert, rows, mask_m, cols, cols < F, h_ptr, y_ptr, bias_ptr,
                     prob, F, stride_hm, stride_ym, ACT, HAS_BIAS, HAS_PROB)  # fmt: skip
    for tile in range(pid, (M - routed + BLOCK_M - 1) // BLOCK_M * num_n, programs):
        rows, cols = tail_tile(tile, 0, routed, num_n, BLOCK_M, BLOCK_N)
        fwd_zero(rows, rows < M, cols, F, h_ptr, y_ptr, stride_hm, stride_ym, ACT,
                 BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def grouped_gemm_dact_tma_kernel(
    g_ptr, b_ptr, h_ptr, p_ptr, dh_ptr, part_ptr, y_ptr, map_ptr,
    M, F, K, E,
    stride_gm, stride_be, stride_bn, stride_hm, stride_dm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ACT: tl.constexpr, HAS_PROB: tl.constexpr, MAP_OFF: tl.constexpr,
    RECOMPUTE: tl.constexpr = False,
):
    """fc2's data gradient with the activation's backward (see
    :func:`.pointer.grouped_gemm_dact_kernel`, ``RECOMPUTE`` included); ``g`` ``[M, K]`` with a
    unit last stride and ``b_ptr`` the ``[E, F, K]`` weight ``w2`` with a unit last stride."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # The tile map after the routing head, at the launch's constexpr `head_size(E)`
    # (folded into the loads' addresses: no derived pointer kept in a register).
    map_ptr = map_ptr + MAP_OFF
    g_desc = tl.make_tensor_descriptor(
        g_ptr, shape=[M, K], strides=[stride_gm, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    w_desc = tl.make_tensor_descriptor(
        b_ptr, shape=[E, F, K], strides=[stride_be, stride_bn, 1],
        block_shape=[1, BLOCK_N, BLOCK_K],
    )
    num_n = (F + BLOCK_N - 1) // BLOCK_N
    expert_tiles = tl.load(map_ptr) * num_n
    routed = tl.load(map_ptr + 1)
    for tile in tl.range(pid, expert_tiles, programs, flatten=FLATTEN):
        expert, row0, rows_e, row, col = map_tile(map_ptr, tile, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        dy = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range((K + BLOCK_K - 1) // BLOCK_K):
            k = kt * BLOCK_K
            g = g_desc.load([row, k])
            w = w_desc.load([expert, col, k]).reshape(BLOCK_N, BLOCK_K).T
            if UPCAST_DOT:
                g = g.to(tl.float32)
                w = w.to(tl.float32)
            dy = tl.dot(g, w, dy)
        rows = row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        mask_m = rows < tl.minimum(row0 + rows_e, M)
        dact_epilogue(dy, rows, mask_m, cols, cols < F, h_ptr, p_ptr, dh_ptr, part_ptr, y_ptr,
                      col // BLOCK_N, M, F, stride_hm, stride_dm, stride_ym, ACT, HAS_PROB,
                      RECOMPUTE)  # fmt: skip
    for tile in range(pid, (M - routed + BLOCK_M - 1) // BLOCK_M * num_n, programs):
        rows, cols = tail_tile(tile, 0, routed, num_n, BLOCK_M, BLOCK_N)
        dact_zero(rows, rows < M, cols, tile % num_n, M, F, dh_ptr, part_ptr, y_ptr, stride_dm,
                  stride_ym, ACT, HAS_PROB, RECOMPUTE, BLOCK_M, BLOCK_N)  # fmt: skip
