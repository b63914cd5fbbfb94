"""Device helpers shared by the grouped GEMM kernels (:mod:`mtp.kernels.grouped_gemm`,
:mod:`mtp.kernels.grouped_gemm_act`): the masked MMA loop and the per-call tile map that turns
the device token counts into (expert, row tile, column tile) for each program, plus the zero
tail past the routed rows. No host code.

The interpreter re-patches ``triton.language`` on every call of a ``@triton.jit`` function
(``tl.sum`` and ``tl.cumsum`` included), which dominates its run time: these helpers keep such
calls per program to a handful and do the integer ceil-divisions inline.
"""

import triton
import triton.language as tl

__all__ = ["expert_tile_map", "locate_expert_tile", "mma_loop", "tail_tile"]


@triton.jit
def mma_loop(
    acc, a_ptrs, b_ptrs, a_keep, b_keep, a_red, b_red, length, a_step, b_step,
    BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``acc += a @ b`` over a reduction of ``length``, ``BLOCK`` at a time.

    ``a_ptrs`` is a ``[rows, BLOCK]`` tile and ``b_ptrs`` a ``[BLOCK, cols]`` tile; ``a_red`` /
    ``b_red`` are the reduction indices broadcast to them, ``a_keep`` / ``b_keep`` the masks of
    the other dimension; each step advances the pointers by ``a_step`` / ``b_step``.
    """
    for i in range((length + BLOCK - 1) // BLOCK):
        left = length - i * BLOCK
        a = tl.load(a_ptrs, mask=a_keep & (a_red < left), other=0.0)
        b = tl.load(b_ptrs, mask=(b_red < left) & b_keep, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def expert_tile_map(
    counts_ptr, M, N, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """The per-call tile map of the grouped forward kernels, computed from the device counts.

    Returns ``(lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total)``: the
    clamped counts and row tiles per expert, their prefix sum (in row tiles), the column tiles,
    the experts' tiles, the routed rows (at most ``M``) and all tiles with the zero tail.
    """
    lane = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + lane, mask=lane < E, other=0).to(tl.int32)
    counts = tl.maximum(counts, 0)
    m_tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(m_tiles, axis=0)  # in row tiles
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    expert_tiles = tl.sum(m_tiles, axis=0) * num_n
    routed = tl.minimum(tl.sum(counts, axis=0), M)
    total = expert_tiles + (M - routed + BLOCK_M - 1) // BLOCK_M * num_n
    return lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total


@triton.jit
def locate_expert_tile(
    tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``(expert, row0, row_end, pid_m, pid_n)`` of expert tile ``tile`` (< the experts' tiles):
    expert-major, and inside an expert ``GROUP_M`` row tiles share each column tile."""
    # The tiles of one expert are contiguous: find the expert from the row-tile index.
    expert = tl.sum((tile_ends <= tile // num_n).to(tl.int32), axis=0)
    before = lane < expert
    row0 = tl.sum(tl.where(before, counts, 0), axis=0)
    first = tl.sum(tl.where(before, m_tiles, 0), axis=0) * num_n
    rows_e = tl.maximum(tl.load(counts_ptr + expert).to(tl.int32), 0)
    num_m = (rows_e + BLOCK_M - 1) // BLOCK_M
    local = tile - first
    per_group = GROUP_M * num_n
    first_m = (local // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    within = local % per_group
    row_end = tl.minimum(row0 + rows_e, M)
    return expert, row0, row_end, first_m + within % size_m, within // size_m


@triton.jit
def tail_tile(tile, expert_tiles, routed, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows and columns of zero-tail tile ``tile`` (>= the experts' tiles): rows from
    ``routed`` on (mask them with ``< M``)."""
    local = tile - expert_tiles
    rows = routed + (local // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (local % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols
