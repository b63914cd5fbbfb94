"""Tile maps of the grouped GEMM kernels, written once for the pointer and the TMA kernels.

The interpreter re-patches ``triton.language`` on every call of a ``@triton.jit`` function
(``tl.sum`` and ``tl.cumsum`` included), which dominates its run time: these helpers keep such
calls per program to a handful and do the integer ceil-divisions inline.
"""

import triton
import triton.language as tl

__all__ = [
    "MAP_FIELDS",
    "MAP_HEADER",
    "expert_tile_map",
    "head_size",
    "locate_expert_tile",
    "map_tile",
    "mma_loop",
    "routing_map",
    "tail_tile",
    "tile_map_kernel",
    "tile_map_size",
    "wgrad_tile",
]


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


# --------------------------------------------------------------------------------------------
# Forward tiles, pointer kernels: computed in every program from the device counts
# --------------------------------------------------------------------------------------------


@triton.jit
def expert_tile_map(
    counts_ptr, M, N, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """The per-call tile map of the pointer forward kernels, from the device counts.

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


# --------------------------------------------------------------------------------------------
# Forward tiles, TMA kernels: a map built by its own small kernel (Hopper's automatic warp
# specialisation rejects kernels that hold reductions)
# --------------------------------------------------------------------------------------------

#: Tile map layout (int32): ``[expert row tiles, routed rows, then per row tile r:
#: expert, first row of the expert, rows of the expert, first row tile of the expert]``.
MAP_HEADER = tl.constexpr(2)
MAP_FIELDS = tl.constexpr(4)


def tile_map_size(M: int, E: int, block_m: int) -> int:
    """int32 entries of the tile map for the worst case ``cdiv(M, BM) + E`` row tiles."""
    return MAP_HEADER.value + MAP_FIELDS.value * (triton.cdiv(M, block_m) + E)


def head_size(E: int) -> int:
    """int32 entries of the routing head (``2E`` expert rows and the status word), rounded up
    to 16 bytes so that the tile map stored after it stays 16-byte aligned."""
    return (2 * E + 4) // 4 * 4


@triton.jit
def routing_map(buf_ptr, E):
    """The tile map in a routing buffer of :func:`tile_map_kernel` (after the head)."""
    return buf_ptr + (2 * E + 4) // 4 * 4


@triton.jit
def tile_map_kernel(
    counts_ptr, head_ptr, M, E, row_tiles,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The routing buffer of one counts tensor (grid ``max(1, cdiv(row_tiles, BLOCK_T))``): the
    head, then the tile map (:func:`routing_map`).

    Program 0 writes the head: ``head[e]`` the first row of expert ``e`` and ``head[E + e]`` its
    rows, both clamped to ``[0, M]`` (negative counts read as 0; what the TMA weight gradient
    reads), and the status word ``head[2E]``: 1 when the counts are non-negative and sum to at
    most ``M``, else 0. Every program writes its ``BLOCK_T`` entries of the tile -> expert map
    for ``BLOCK_M``-row tiles: row tile ``r`` of the expert-major order belongs to the expert
    whose prefix sum of row tiles passes ``r``; entries past the experts' tiles are never read.
    ``row_tiles == 0``: the head only."""
    map_ptr = routing_map(head_ptr, E)
    lane = tl.arange(0, BLOCK_E)
    raw = tl.load(counts_ptr + lane, mask=lane < E, other=0)
    counts = tl.maximum(raw.to(tl.int32), 0)
    starts = tl.cumsum(counts, axis=0) - counts  # first row of each expert
    if tl.program_id(0) == 0:
        first = tl.minimum(starts, M)
        tl.store(head_ptr + lane, first, mask=lane < E)
        tl.store(head_ptr + E + lane, tl.minimum(counts, M - first), mask=lane < E)
        valid = (tl.min(raw, axis=0) >= 0) & (tl.sum(raw.to(tl.int64), axis=0) <= M)
        tl.store(head_ptr + 2 * E, valid.to(tl.int32))
    if row_tiles > 0:
        m_tiles = (counts + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(m_tiles, axis=0)
        if tl.program_id(0) == 0:
            tl.store(map_ptr, tl.sum(m_tiles, axis=0))
            tl.store(map_ptr + 1, tl.minimum(tl.sum(counts, axis=0), M))
        r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        expert = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1)
        pick = lane[None, :] == expert[:, None]
        base = map_ptr + MAP_HEADER + r * MAP_FIELDS
        keep = r < row_tiles
        tl.store(base, expert, mask=keep)
        tl.store(base + 1, tl.sum(tl.where(pick, starts[None, :], 0), axis=1), mask=keep)
        tl.store(base + 2, tl.sum(tl.where(pick, counts[None, :], 0), axis=1), mask=keep)
        tl.store(base + 3, tl.sum(tl.where(pick, (ends - m_tiles)[None, :], 0), axis=1),
                 mask=keep)


@triton.jit
def map_tile(map_ptr, tile, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             GROUP_M: tl.constexpr):  # fmt: skip
    """``(expert, its first row, its rows, tile's first row, tile's first column)`` of expert
    tile ``tile`` from the map of :func:`tile_map_kernel` (:func:`routing_map`); inside an
    expert ``GROUP_M`` row tiles share each column tile of ``b[e]`` (L2 reuse)."""
    entry = map_ptr + MAP_HEADER + (tile // num_n) * MAP_FIELDS
    expert = tl.load(entry)
    row0 = tl.load(entry + 1)
    rows_e = tl.load(entry + 2)
    local = tile - tl.load(entry + 3) * num_n
    first_m = (local // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum((rows_e + BLOCK_M - 1) // BLOCK_M - first_m, GROUP_M)
    within = local % (GROUP_M * num_n)
    return expert, row0, rows_e, row0 + (first_m + within % size_m) * BLOCK_M, (
        within // size_m) * BLOCK_N


# --------------------------------------------------------------------------------------------
# Weight-gradient tiles
# --------------------------------------------------------------------------------------------


@triton.jit
def wgrad_tile(pid, E, P, Q, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
               GROUP_P: tl.constexpr):  # fmt: skip
    """``(split, expert, pid_p, pid_q)`` of weight-gradient program ``pid``: split-major, then
    expert-major, and inside an expert ``GROUP_P`` row tiles of ``c[e]`` share each column tile
    (L2 reuse of the ``b`` rows). Without a split the grid is one split."""
    num_p = (P + BLOCK_P - 1) // BLOCK_P
    num_q = (Q + BLOCK_Q - 1) // BLOCK_Q
    per_split = E * num_p * num_q
    split = pid // per_split
    pid = pid % per_split
    expert = pid // (num_p * num_q)
    local = pid % (num_p * num_q)
    per_group = GROUP_P * num_q
    first_p = (local // per_group) * GROUP_P
    size_p = tl.minimum(num_p - first_p, GROUP_P)
    return split, expert, first_p + (local % per_group) % size_p, (local % per_group) // size_p
