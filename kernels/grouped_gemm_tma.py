"""Grouped GEMM with TMA tensor descriptors (Hopper sm_90a and Blackwell sm_100a).

Same contract as :mod:`mtp.kernels.grouped_gemm` (rows of ``a`` grouped by expert, counts read
on the device, zeros written past the routed rows) for 16-bit inputs whose last dimension is
contiguous and whose other strides are 16-byte multiples; the launchers there fall back to the
pointer kernels otherwise.

- :func:`tile_map_kernel` + :func:`grouped_gemm_tma_kernel` (two launches per call). The first
  turns the device counts into the tile -> expert map (per row tile of the expert-major order:
  expert, its first row, its rows, its first row tile), so the GEMM kernel holds no reductions
  (Hopper's automatic warp specialisation rejects kernels with them). The GEMM kernel is
  persistent: each program strides over the output tiles with
  ``tl.range(..., flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE)``; flattening fuses the tile
  loop with the K loop (the next tile's loads overlap this tile's epilogue), warp specialisation
  splits producer (TMA) and consumer (MMA) warps (``setmaxnreg``). ``a`` and ``b`` are read
  through device-side descriptors (``tl.make_tensor_descriptor``); ``b`` as a 3-d ``[E, K, N]``
  (or ``[E, N, K]``) descriptor so a partial K tile never reads the next expert. A row tile may
  run past its expert into the next one's rows: those rows are computed but masked out in the
  epilogue store. A second loop writes the zero tail (rows past the routed ones).
- :func:`expert_rows_kernel` + :func:`grouped_wgrad_tma_kernel` (warp-specialised reduction
  loop): ``c[e] = a_e^T @ b_e`` with per-expert descriptors whose row
  count ends at the expert's (or the split's) last row, so TMA zero-fills the rows past it. With
  ``SPLIT > 1`` (few output tiles for the SMs) each expert's rows are cut into ``SPLIT`` chunks
  that write fp32 partial sums to a workspace, and :func:`split_reduce_kernel` adds them in a
  fixed order (deterministic, no atomics).

Device-side descriptors need a little global scratch per program: the launchers install a torch
allocator with ``triton.set_allocator`` when none is set.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from mtp.kernels._common import interpreting, next_power_of_2
from mtp.kernels.grouped_tiles import tail_tile

__all__ = [
    "FORWARD_TABLE",
    "WGRAD_TABLE",
    "TmaGemmConfig",
    "TmaWgradConfig",
    "build_tile_map",
    "map_tile",
    "grouped_gemm_tma_kernel",
    "expert_rows_kernel",
    "grouped_wgrad_tma_kernel",
    "split_reduce_kernel",
    "supports_warp_specialize",
    "tile_map_kernel",
    "tma_forward_config",
    "tma_wgrad_config",
    "use_tma",
]


def supports_warp_specialize() -> bool:
    """Whether this Triton's ``tl.range`` takes ``warp_specialize`` and ``flatten`` (3.4+)."""
    params = inspect.signature(tl.range.__init__).parameters
    return "warp_specialize" in params and "flatten" in params


#: Tile map layout (int32): ``[expert row tiles, routed rows, then per row tile r:
#: expert, first row of the expert, rows of the expert, first row tile of the expert]``.
MAP_HEADER = tl.constexpr(2)
MAP_FIELDS = tl.constexpr(4)


def tile_map_size(M: int, E: int, block_m: int) -> int:
    """int32 entries of the tile map for the worst case ``cdiv(M, BM) + E`` row tiles."""
    return MAP_HEADER.value + MAP_FIELDS.value * (triton.cdiv(M, block_m) + E)


@triton.jit
def tile_map_kernel(
    counts_ptr, map_ptr, M, E, row_tiles,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The tile -> expert map of one call (grid ``cdiv(row_tiles, BLOCK_T)``): row tile ``r``
    of the expert-major order belongs to the expert whose prefix sum of row tiles passes ``r``.
    Entries past the experts' tiles are never read."""
    lane = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + lane, mask=lane < E, other=0).to(tl.int32)
    counts = tl.maximum(counts, 0)
    starts = tl.cumsum(counts, axis=0) - counts  # first row of each expert
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
    tl.store(base + 3, tl.sum(tl.where(pick, (ends - m_tiles)[None, :], 0), axis=1), mask=keep)


@triton.jit
def map_tile(map_ptr, tile, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             GROUP_M: tl.constexpr):  # fmt: skip
    """``(expert, its first row, its rows, tile's first row, tile's first column)`` of expert
    tile ``tile`` from the map of :func:`tile_map_kernel`; inside an expert ``GROUP_M`` row
    tiles share each column tile of ``b[e]`` (L2 reuse)."""
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


@triton.jit
def grouped_gemm_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, map_ptr,
    M, N, K, E,
    stride_am, stride_be, stride_bk, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TRANS_B: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """``c[M, N]``: rows of expert ``e`` get ``a[rows] @ b[e]`` (``+ bias[e]``, a contiguous
    ``[E, N]``, with ``HAS_BIAS``); rows past the routed ones get 0.

    ``a`` is ``[M, K]`` with unit column stride; ``b`` is ``[E, K, N]`` with unit N stride, or
    with ``TRANS_B`` an ``[E, N, K]`` tensor with unit K stride (``stride_bk`` / ``stride_bn``
    then name its K / N strides). ``c`` has unit column stride. ``map_ptr``: the tile map of
    :func:`tile_map_kernel` (no reductions here: Hopper's automatic warp specialisation does
    not take them). Any grid: program ``p`` handles tiles ``p, p + grid, ...``; inside an expert
    ``GROUP_M`` row tiles share each column tile of ``b[e]`` (L2 reuse).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
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
            bias = tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=cols < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
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
    pid = tl.program_id(0)
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
    p0 = (first_p + (local % per_group) % size_p) * BLOCK_P
    q0 = ((local % per_group) // size_p) * BLOCK_Q

    # Expert rows from :func:`expert_rows_kernel` (no reductions here, as in the forward).
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
def expert_rows_kernel(counts_ptr, rows_ptr, M, E, BLOCK_E: tl.constexpr):
    """``rows[e]`` = first row of expert ``e``, ``rows[E + e]`` = its rows, both clamped to
    ``[0, M]`` (negative counts read as 0). One program."""
    lane = tl.arange(0, BLOCK_E)
    counts = tl.maximum(tl.load(counts_ptr + lane, mask=lane < E, other=0).to(tl.int32), 0)
    starts = tl.minimum(tl.cumsum(counts, axis=0) - counts, M)
    tl.store(rows_ptr + lane, starts, mask=lane < E)
    tl.store(rows_ptr + E + lane, tl.minimum(counts, M - starts), mask=lane < E)


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


# --------------------------------------------------------------------------------------------
# Configuration (per architecture and group-size regime) and launchers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TmaGemmConfig:
    """Tiles and launch options of :func:`grouped_gemm_tma_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    warp_specialize: bool = True
    flatten: bool = True


@dataclasses.dataclass(frozen=True)
class TmaWgradConfig:
    """Tiles and launch options of :func:`grouped_wgrad_tma_kernel` (``split`` row chunks)."""

    block_p: int
    block_q: int
    block_r: int
    group_p: int = 8
    num_warps: int = 4
    num_stages: int = 3
    warp_specialize: bool = True
    split: int = 1


# Forward tiles by (architecture, regime), shared by fp16 and bf16 (same element size, same MMA
# rates; fp32 keeps the pointer kernels). Regime: average rows per expert
# M / E < 128 ("small": 64-row tiles waste at most 63 rows per expert), < 1024 ("medium") or
# more ("large": 128 x 256 tiles, the widest that fit 3 TMA stages in shared memory). UNTUNED:
# chosen from the wgmma / tcgen05 shapes and the shared-memory budget, not measured (no GPU was
# available when they were written); bench/bench_grouped_gemm.py is the place to tune them.
# Warp specialisation: Triton 3.6 / 3.9 specialise the persistent loop on sm_100a with or without
# flattening. On sm_90a their (separate) Hopper pass only acts on an unflattened loop in a 4-warp
# kernel (one consumer warpgroup) and aborts on reductions in the kernel, hence the tile map
# computed by its own kernel; 128 x 256 tiles need two consumer warpgroups (8 warps), which that
# pass leaves unspecialised, so Hopper's large tiles take the flattened loop instead.
FORWARD_TABLE: dict[tuple[int, str], TmaGemmConfig] = {
    (9, "small"): TmaGemmConfig(64, 128, 64, num_warps=4, num_stages=4, flatten=False),
    # 8 warps: with 4, triton 3.6's warp-specialised loop on sm_90a stores only half of each
    # 128-row tile (the rest stays unwritten; H200, tools/gpu_diag_tma.py). 8 warps were right
    # and fastest there (0.053 / 0.206 ms vs 0.089 / 0.209 without warp specialisation).
    (9, "medium"): TmaGemmConfig(128, 128, 64, num_warps=8, num_stages=4, flatten=False),
    (9, "large"): TmaGemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=False),
    (10, "small"): TmaGemmConfig(64, 128, 64, num_warps=4, num_stages=4),
    (10, "medium"): TmaGemmConfig(128, 128, 64, num_warps=4, num_stages=4),
    (10, "large"): TmaGemmConfig(128, 256, 64, num_warps=8, num_stages=3),
}
# Weight-gradient tiles by architecture (also untuned); warp-specialised on both (4 warps: the
# form Hopper's pass takes; 8 on sm_100, where the epilogue's TMEM loads then need fewer
# registers per thread).
WGRAD_TABLE: dict[int, TmaWgradConfig] = {
    # No warp specialisation on sm_90a: with it (4 warps) half of each 128-row tile stayed
    # unwritten on an H200 under triton 3.6; without it right and as fast or faster
    # (0.113 vs 0.157 ms with 8 warps on the mixed test shape, 0.365 vs 0.370 at Qwen3's).
    9: TmaWgradConfig(128, 128, 64, num_warps=4, num_stages=3, warp_specialize=False),
    10: TmaWgradConfig(128, 128, 64, num_warps=8, num_stages=3),
}
_MAX_SPLIT = 16
_MIN_ROWS_PER_SPLIT = 256


def regime(M: int, E: int) -> str:
    """Group-size regime from the host-known sizes: average rows per expert ``M / E``."""
    avg = M / max(E, 1)
    return "small" if avg < 128 else ("medium" if avg < 1024 else "large")


def _fit(block: int, size: int) -> int:
    return max(16, min(block, next_power_of_2(size)))


def tma_forward_config(arch: int, M: int, N: int, K: int, E: int) -> TmaGemmConfig:
    """The table's tiles for ``arch`` (9 or 10: the major compute capability), shrunk to narrow
    N / K; warp specialisation only where this Triton supports it."""
    cfg = FORWARD_TABLE[(min(max(arch, 9), 10), regime(M, E))]
    ok = supports_warp_specialize()
    return dataclasses.replace(cfg, block_n=_fit(cfg.block_n, N), block_k=_fit(cfg.block_k, K),
                               warp_specialize=cfg.warp_specialize and ok,
                               flatten=cfg.flatten and ok)


def tma_wgrad_config(arch: int, M: int, P: int, Q: int, E: int, sms: int) -> TmaWgradConfig:
    """The table's tiles, with ``split`` row chunks per expert when ``E`` times the output
    tiles leave SMs idle and experts average at least 2 x 256 rows."""
    cfg = WGRAD_TABLE[min(max(arch, 9), 10)]
    cfg = dataclasses.replace(cfg, block_p=_fit(cfg.block_p, P), block_q=_fit(cfg.block_q, Q))
    tiles = max(E, 1) * triton.cdiv(P, cfg.block_p) * triton.cdiv(Q, cfg.block_q)
    split = min(_MAX_SPLIT, sms // tiles, M // (max(E, 1) * _MIN_ROWS_PER_SPLIT))
    return dataclasses.replace(cfg, split=max(1, split))


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Persistent programs: one per SM (4 under the interpreter, to exercise the loop)."""
    return _sms(device) if device.type == "cuda" else 4


def use_tma(requested: bool | None, device: torch.device, eligible: bool) -> bool:
    """Whether a launch takes the TMA kernels.

    ``MTP_TRITON_TMA=0`` turns them off, ``=1`` turns them on wherever the operands are eligible
    (under the interpreter too: descriptors run there). Otherwise ``requested`` (True: ValueError
    when not eligible) or, by default, on CUDA devices of compute capability 9.0 and later.
    """
    env = os.environ.get("MTP_TRITON_TMA", "")
    if requested is None:
        if env in ("0", "1"):
            return env == "1" and eligible
        return (eligible and device.type == "cuda" and not interpreting()
                and _capability(device) >= 9)
    if requested and not eligible:
        raise ValueError("tma=True needs fp16/bf16 operands with a unit last stride, 16-byte "
                         "aligned base pointers and 16-byte aligned other strides")
    return requested


def forward_default(device, M, N, K, E) -> TmaGemmConfig:
    if device.type != "cuda":  # interpreter: small tiles, several per expert
        return TmaGemmConfig(16, 16, 16, warp_specialize=False, flatten=False)
    return tma_forward_config(_capability(device), M, N, K, E)


def wgrad_default(device, M, P, Q, E) -> TmaWgradConfig:
    if device.type != "cuda":
        return TmaWgradConfig(16, 16, 16, group_p=2)
    return tma_wgrad_config(_capability(device), M, P, Q, E, _sms(device))


def _ensure_allocator() -> None:
    """Device-side descriptors need global scratch: install a torch allocator if none is set."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(
            lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda")
        )


def _aligned(t: torch.Tensor, unit_dim: int) -> bool:
    """TMA operand: 16-byte aligned base, unit stride in ``unit_dim``, 16-byte other strides."""
    es = t.element_size()
    return (
        t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0
        and all((s * es) % 16 == 0 for d, s in enumerate(t.stride()) if d != unit_dim)
    )


def forward_eligible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA forward kernel can read these operands (16-bit, TMA-aligned)."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _aligned(a, 1) and (_aligned(b, 2) or _aligned(b, 1)) and out.stride(1) == 1


def wgrad_eligible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA weight-gradient kernel can read these operands."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _aligned(a, 1) and _aligned(b, 1) and out.stride(2) == 1


def forward_warp_specialize(config: TmaGemmConfig, has_bias: bool) -> bool:
    """Whether the forward runs warp-specialised: as configured, except that a bias epilogue
    on a tile wider than 128 x 128 (the large-group sm_100a config) would spill registers in
    the epilogue warps (20 B measured), so that case takes the plain persistent loop."""
    return config.warp_specialize and (
        not has_bias or config.block_m * config.block_n <= 128 * 128
    )


def build_tile_map(counts: torch.Tensor, M: int, E: int, block_m: int,
                   device: torch.device) -> torch.Tensor:  # fmt: skip
    """One launch of :func:`tile_map_kernel`: the int32 tile map for ``block_m``-row tiles
    (also installs the descriptor scratch allocator on CUDA)."""
    if device.type == "cuda":
        _ensure_allocator()
    row_tiles = triton.cdiv(M, block_m) + E
    tile_map = torch.empty(tile_map_size(M, E, block_m), dtype=torch.int32, device=device)
    block_e = next_power_of_2(E)
    block_t = max(2, min(32, 4096 // block_e))  # [BLOCK_T, BLOCK_E] compares without spills
    tile_map_kernel[(triton.cdiv(row_tiles, block_t),)](
        counts, tile_map, M, E, row_tiles, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_T=block_t,
    )
    return tile_map


def launch_forward(a, b, counts, out, config: TmaGemmConfig, programs: int, upcast: bool,
                   bias=None):
    """Two launches: :func:`tile_map_kernel`, then the persistent TMA forward on ``programs``
    programs (see :func:`grouped_gemm_tma_kernel`; ``bias``: contiguous ``[E, N]`` or None)."""
    M, K = a.shape
    E, _, N = b.shape
    trans_b = not (b.stride(2) == 1 and _aligned(b, 2))
    tile_map = build_tile_map(counts, M, E, config.block_m, a.device)
    grouped_gemm_tma_kernel[(programs,)](
        a, b, out, out if bias is None else bias, tile_map, M, N, K, E,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, TRANS_B=trans_b,
        FLATTEN=config.flatten, UPCAST_DOT=upcast, HAS_BIAS=bias is not None,
        WARP_SPECIALIZE=forward_warp_specialize(config, bias is not None),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def launch_wgrad(a, b, counts, out, config: TmaWgradConfig, upcast: bool, accumulate=False):
    """TMA weight gradient; with ``config.split > 1`` through an fp32 workspace and a fixed-order
    reduction pass (``accumulate``: ``out +=`` in the last epilogue)."""
    M, P = a.shape
    Q = b.shape[1]
    E = out.shape[0]
    if a.device.type == "cuda":
        _ensure_allocator()
    split = config.split
    target = out if split == 1 else torch.empty(
        (split, E, P, Q), dtype=torch.float32, device=out.device
    )
    strides = (out.stride(0), out.stride(1), 0) if split == 1 else (
        target.stride(1), target.stride(2), target.stride(0))
    rows = torch.empty(2 * E, dtype=torch.int32, device=a.device)
    expert_rows_kernel[(1,)](counts, rows, M, E, BLOCK_E=next_power_of_2(E))
    grid = (split * E * triton.cdiv(P, config.block_p) * triton.cdiv(Q, config.block_q),)
    grouped_wgrad_tma_kernel[grid](
        a, b, target, rows, M, P, Q, E,
        a.stride(0), b.stride(0), *strides,
        BLOCK_P=config.block_p, BLOCK_Q=config.block_q, BLOCK_R=config.block_r,
        GROUP_P=config.group_p, SPLIT=split,
        WARP_SPECIALIZE=config.warp_specialize and supports_warp_specialize(),
        UPCAST_DOT=upcast, ACCUMULATE=accumulate and split == 1, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split > 1:
        numel = E * P * Q
        block = 1024
        split_reduce_kernel[(triton.cdiv(numel, block),)](
            target, out, numel, P * Q, Q, out.stride(0), out.stride(1), out.stride(2),
            SPLIT=split, BLOCK=block, ACCUMULATE=accumulate,
        )
    return out
