"""Grouped GEMM for MoE experts: one launch, ragged groups read on the device.

Rows of ``a`` are grouped by expert: expert ``e`` owns rows ``[start_e, start_e + m_e)`` where
``m_e = counts[e]`` and ``start_e = m_0 + ... + m_{e-1}``. The counts stay on the device: every
program loads them (one vector load), turns them into per-expert tile counts with a prefix sum and
finds its own (expert, row tile, column tile) from its program id. So the launch grid is static
(a worst-case bound on the number of tiles) and nothing waits for the host, which is what a CUDA
graph needs.

Kernels
- :func:`grouped_gemm_kernel`: ``c[rows of e] = a[rows of e] @ b[e]`` for ``b`` of shape
  ``[E, K, N]`` with any strides (a transposed view gives ``trans_b`` and the data gradient).
  Rows past ``sum(counts)`` (the tail of a worst-case buffer) are written as zeros by the same
  launch. The tile order is expert-major, and inside an expert grouped by ``GROUP_M`` row tiles
  so that neighbouring programs share both the ``a`` rows and the ``b[e]`` columns in L2.
  The grid is ``cdiv(M, BLOCK_M) + E`` row tiles times the column tiles (``sum_e cdiv(m_e, BM) <=
  cdiv(M, BM) + E - 1``, plus the zero tail); programs without work exit at once. The
  persistent variant launches one wave of programs that stride over the tiles instead (chosen
  automatically when the idle programs of the worst-case grid would exceed one wave).
- :func:`grouped_wgrad_kernel`: ``c[e] = a_e^T @ b_e`` (the weight gradient, ragged reduction
  dimension); grid ``E x tiles of c[e]``, each program loops over its expert's rows, experts
  without rows store exact zeros.

Both accumulate in fp32 and store in the output dtype. Row offsets are int64 (``M * K`` may exceed
2^31 elements).

On sm_90 / sm_100, fp16/bf16 operands whose strides TMA accepts take the kernels of
:mod:`mtp.kernels.grouped_gemm_tma` instead (TMA descriptors, a persistent warp-specialised loop,
configs by group-size regime and architecture, split-K weight gradient); ``tma=`` on the
launchers and ``MTP_TRITON_TMA=0/1`` choose explicitly. The kernels here stay the path for fp32,
unaligned operands, older GPUs and, by default, the interpreter.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mtp.kernels import grouped_gemm_tma as _tma
from mtp.kernels._common import dot_upcast, fp32_dot_precision, next_power_of_2
from mtp.kernels.grouped_tiles import expert_tile_map, locate_expert_tile, mma_loop, tail_tile

__all__ = [
    "GemmConfig",
    "WgradConfig",
    "default_forward_config",
    "dot_flags",
    "forward_config",
    "grouped_gemm",
    "grouped_gemm_kernel",
    "grouped_wgrad",
    "grouped_wgrad_kernel",
    "launch_plan",
    "num_row_tiles_bound",
    "wgrad_config",
]


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------


@triton.jit
def _gemm_tile(
    a_ptr, b_ptr, c_ptr, bias_ptr, expert, row0, row_end, pid_m, pid_n, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """``c[rows, cols] = a[rows, :] @ b[expert][:, cols] (+ bias[expert, cols])`` for one tile
    (rows < row_end)."""
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
        bias = tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :].to(tl.int64) * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _forward_tile(
    tile, a_ptr, b_ptr, c_ptr, bias_ptr, counts_ptr, M, N, K,
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    if tile < expert_tiles:
        expert, row0, row_end, pid_m, pid_n = locate_expert_tile(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, BLOCK_M, GROUP_M
        )
        _gemm_tile(
            a_ptr, b_ptr, c_ptr, bias_ptr, expert, row0, row_end, pid_m, pid_n, N, K,
            stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT, DOT_PRECISION, HAS_BIAS,
        )
    else:
        # The zero tail: rows [routed, M).
        rows, cols = tail_tile(tile, expert_tiles, routed, num_n, BLOCK_M, BLOCK_N)
        c_ptrs = (
            c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :].to(tl.int64) * stride_cn
        )
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, counts_ptr,
    M, N, K, E,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """``c[M, N]``: rows of expert ``e`` get ``a[rows] @ b[e]`` (``+ bias[e]`` with
    ``HAS_BIAS``: a contiguous ``[E, N]`` added in the epilogue); rows past the routed ones
    get 0.

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
                tile, a_ptr, b_ptr, c_ptr, bias_ptr, counts_ptr, M, N, K,
                lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST_DOT, DOT_PRECISION, HAS_BIAS,
            )
    else:
        # Programs past the tail find only masked-out rows (rows >= M) and store nothing.
        _forward_tile(
            pid, a_ptr, b_ptr, c_ptr, bias_ptr, counts_ptr, M, N, K,
            lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
            stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST_DOT, DOT_PRECISION, HAS_BIAS,
        )


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, counts_ptr,
    M, P, Q, E,
    stride_am, stride_ap,
    stride_bm, stride_bq,
    stride_ce, stride_cp, stride_cq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_P: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):
    """``c[e] = a[rows of e]^T @ b[rows of e]`` (``[P, Q]`` per expert); zeros for empty experts.
    With ``ACCUMULATE`` the epilogue adds the product to ``c`` instead (``c += ...``, in fp32
    before the store: Megatron's gradient-accumulation fusion into an fp32 ``main_grad``).

    ``a`` is ``[M, P]`` and ``b`` is ``[M, Q]`` (any strides). Grid:
    ``E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q)`` programs, expert-major, grouped by ``GROUP_P``
    inside an expert.
    """
    pid = tl.program_id(0)
    num_p = (P + BLOCK_P - 1) // BLOCK_P
    num_q = (Q + BLOCK_Q - 1) // BLOCK_Q
    expert = pid // (num_p * num_q)
    local = pid % (num_p * num_q)
    per_group = GROUP_P * num_q
    first_p = (local // per_group) * GROUP_P
    size_p = tl.minimum(num_p - first_p, GROUP_P)
    pid_p = first_p + (local % per_group) % size_p
    pid_q = (local % per_group) // size_p

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
    a_ptrs = a_ptr + (row0.to(tl.int64) + rs[None, :]) * stride_am + ps64[:, None] * stride_ap
    b_ptrs = b_ptr + (row0.to(tl.int64) + rs[:, None]) * stride_bm + qs64[None, :] * stride_bq
    acc = mma_loop(
        tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32), a_ptrs, b_ptrs,
        mask_p[:, None], mask_q[None, :], rs[None, :], rs[:, None], rows_e,
        BLOCK_R * stride_am, BLOCK_R * stride_bm, BLOCK_R, UPCAST_DOT, DOT_PRECISION,
    )
    c_ptrs = (
        c_ptr + expert.to(tl.int64) * stride_ce + ps64[:, None] * stride_cp
        + qs64[None, :] * stride_cq
    )
    mask_c = mask_p[:, None] & mask_q[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch options of :func:`grouped_gemm_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Tile shape and launch options of :func:`grouped_wgrad_kernel` (``c[e]`` is P x Q)."""

    block_p: int
    block_q: int
    block_r: int
    group_p: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Small tiles under the interpreter: tiny test shapes still cover several tiles per expert.
_INTERPRETER_GEMM = GemmConfig(16, 16, 16, group_m=2)
_INTERPRETER_WGRAD = WgradConfig(16, 16, 16, group_p=2)


def _fit(block: int, size: int) -> int:
    """``block`` shrunk to the problem (a power of two, at least 16: the MMA K/N granule)."""
    return max(16, min(block, next_power_of_2(size)))


def forward_config(dtype: torch.dtype, M: int, N: int, K: int, E: int) -> GemmConfig:
    """Default tiles for the forward / data-gradient kernel on sm_90 / sm_100.

    16-bit inputs: tensor-core tiles with BLOCK_K=64 (128-byte rows, the widest shared-memory
    swizzle for wgmma / tcgen05) and 4 pipeline stages (128 KiB of shared memory at most). A row
    tile never spans two experts, so each expert wastes up to BLOCK_M - 1 rows: when experts
    average fewer than 256 rows, 64-row tiles (the native wgmma M) halve that waste, with 4 warps
    (one warpgroup); otherwise 128 x 128 tiles with 8 warps. fp32 (no tensor cores unless TF32 is
    allowed): 64 x 64 x 32 tiles, 4 warps. Narrow N or K shrink their block to the problem.
    """
    if dtype == torch.float32:
        block_m, block_n, block_k, warps, stages = 64, 64, 32, 4, 3
    elif M < 256 * max(E, 1):
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 4
    return GemmConfig(block_m, _fit(block_n, N), _fit(block_k, K), group_m=8,
                      num_warps=warps, num_stages=stages)


def default_forward_config(a: torch.Tensor, M: int, N: int, K: int, E: int) -> GemmConfig:
    """:func:`forward_config` on a GPU, small tiles under the interpreter."""
    return _INTERPRETER_GEMM if a.device.type != "cuda" else forward_config(a.dtype, M, N, K, E)


def wgrad_config(dtype: torch.dtype, P: int, Q: int) -> WgradConfig:
    """Default tiles for the weight-gradient kernel (a ``[P, Q]`` tile of one expert, reducing
    over that expert's rows 64 at a time; 3 stages, 96 KiB of shared memory for 16-bit)."""
    if dtype == torch.float32:
        return WgradConfig(_fit(64, P), _fit(64, Q), 32, group_p=8, num_warps=4, num_stages=3)
    return WgradConfig(_fit(128, P), _fit(128, Q), 64, group_p=8, num_warps=8, num_stages=3)


def num_row_tiles_bound(M: int, E: int, block_m: int) -> int:
    """Worst-case row tiles of the forward kernel: ``cdiv(M, BM) + E`` (``E - 1`` for the
    experts' partial tiles, one for the zero tail)."""
    return triton.cdiv(M, block_m) + E


_SHARED_MEMORY_PER_SM = 228 * 1024  # H100 / H200 / B200


def _resident_programs(
    device: torch.device, config: GemmConfig, elem_size: int, stage_elems: int | None = None
) -> int:
    """Programs of the forward kernel that fit on the GPU at once (shared memory bound)."""
    if device.type != "cuda":
        return 4  # interpreter: a few programs, so the persistent loop is exercised
    if stage_elems is None:
        stage_elems = (config.block_m + config.block_n) * config.block_k
    stage = stage_elems * elem_size
    per_sm = max(1, _SHARED_MEMORY_PER_SM // (stage * config.num_stages + 1024))
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def launch_plan(
    a: torch.Tensor, config: GemmConfig, M: int, N: int, E: int, persistent: bool | None,
    stage_elems: int | None = None,
) -> tuple[tuple[int], bool]:
    """``(grid, persistent)`` of a grouped forward kernel over ``[M, N]`` outputs (see
    :func:`grouped_gemm`'s ``persistent``); ``stage_elems``: shared-memory elements per
    pipeline stage when not ``(BLOCK_M + BLOCK_N) * BLOCK_K``."""
    tiles = num_row_tiles_bound(M, E, config.block_m) * triton.cdiv(N, config.block_n)
    resident = _resident_programs(a.device, config, a.element_size(), stage_elems)
    if persistent is None:
        # The worst-case grid holds up to E * cdiv(N, BN) programs without work; each holds an
        # SM's shared memory while it starts and exits. When they are more than one wave, stride
        # over the tiles from one wave of programs instead.
        persistent = a.device.type == "cuda" and E * triton.cdiv(N, config.block_n) > resident
    return (min(tiles, resident) if persistent else tiles,), persistent


def dot_flags(dtype: torch.dtype) -> dict:
    return {
        "UPCAST_DOT": dot_upcast(dtype),
        "DOT_PRECISION": fp32_dot_precision() if dtype == torch.float32 else "ieee",
    }


def _check_counts(counts: torch.Tensor, E: int, device: torch.device) -> None:
    if counts.dtype not in (torch.int32, torch.int64) or counts.shape != (E,):
        raise ValueError(f"counts must be int32/int64 of shape ({E},), got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    if counts.device != device or not counts.is_contiguous():
        raise ValueError(f"counts must be contiguous on {device}, got {counts.device}")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    counts: torch.Tensor,
    out: torch.Tensor,
    *,
    config: GemmConfig | _tma.TmaGemmConfig | None = None,
    persistent: bool | None = None,
    tma: bool | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch: ``out[rows of e] = a[rows of e] @ b[e] (+ bias[e])``, zeros past
    ``sum(counts)``.

    Args:
        a: ``[M, K]`` fp32/fp16/bf16, rows grouped by expert, any strides.
        b: ``[E, K, N]`` same dtype, any strides (pass ``w.transpose(1, 2)`` for a
            ``[E, N, K]`` weight).
        counts: ``[E]`` int32/int64 rows per expert, on ``a``'s device (never read on the host).
        out: ``[M, N]`` in ``a``'s dtype; every element is written.
        config: tiles (default: :func:`forward_config`, small tiles under the interpreter).
        persistent: launch one wave of programs (as many as fit on the GPU) that stride over
            the tiles, instead of one program per worst-case tile. Default (None): persistent
            on CUDA when the worst case's idle programs (``E * cdiv(N, BLOCK_N)``) exceed one
            wave, i.e. many experts for the number of rows. (The TMA kernel is always
            persistent.)
        tma: use the TMA kernel (:mod:`mtp.kernels.grouped_gemm_tma`, always persistent).
            Default (None): on sm_90+ for fp16/bf16 TMA-aligned operands (see
            :func:`mtp.kernels.grouped_gemm_tma.use_tma`); True forces it (ValueError if the
            operands are not eligible).
        bias: optional contiguous ``[E, N]`` (any float dtype), added in fp32 in the epilogue.
    """
    M, K = a.shape
    E, _, N = b.shape
    _check_counts(counts, E, a.device)
    if bias is not None and (bias.shape != (E, N) or not bias.is_contiguous()
                             or bias.device != a.device):  # fmt: skip
        raise ValueError(f"bias must be contiguous [{E}, {N}] on {a.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")  # fmt: skip
    if _tma.use_tma(tma, a.device, _tma.forward_eligible(a, b, out) and K > 0):
        if M == 0 or N == 0:
            return out
        if not isinstance(config, _tma.TmaGemmConfig):
            config = _tma.forward_default(a.device, M, N, K, E)
        bound = num_row_tiles_bound(M, E, config.block_m) * triton.cdiv(N, config.block_n)
        programs = min(bound, _tma.sm_count(a.device))
        return _tma.launch_forward(a, b, counts, out, config, programs, dot_upcast(a.dtype),
                                   bias)  # fmt: skip
    if config is None:
        config = default_forward_config(a, M, N, K, E)
    if M == 0 or N == 0:
        return out
    grid, persistent = launch_plan(a, config, M, N, E, persistent)
    grouped_gemm_kernel[grid](
        a, b, out, out if bias is None else bias, counts,
        M, N, K, E,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=next_power_of_2(E), GROUP_M=config.group_m, PERSISTENT=persistent,
        HAS_BIAS=bias is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        **dot_flags(a.dtype),
    )
    return out


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    counts: torch.Tensor,
    out: torch.Tensor,
    *,
    config: WgradConfig | _tma.TmaWgradConfig | None = None,
    tma: bool | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """One launch: ``out[e] = a[rows of e]^T @ b[rows of e]``; exact zeros for empty experts.
    ``accumulate=True``: ``out[e] += ...`` in the epilogue (empty experts leave ``out[e]`` as
    it was), typically into an fp32 ``main_grad`` from half-precision operands.

    Args:
        a: ``[M, P]``, b: ``[M, Q]`` (same dtype, any strides), rows grouped by expert.
        counts: ``[E]`` int32/int64 on the device.
        out: ``[E, P, Q]``; every element is written.
        config: tiles (default: :func:`wgrad_config`, small tiles under the interpreter).
        tma: as in :func:`grouped_gemm`; the TMA kernel splits each expert's rows over several
            programs (fp32 partials, then a fixed-order sum) when the output tiles are fewer
            than the SMs.
    """
    M, P = a.shape
    Q = b.shape[1]
    E = out.shape[0]
    _check_counts(counts, E, a.device)
    if _tma.use_tma(tma, a.device, _tma.wgrad_eligible(a, b, out)):
        if E == 0 or P == 0 or Q == 0:
            return out
        if not isinstance(config, _tma.TmaWgradConfig):
            config = _tma.wgrad_default(a.device, M, P, Q, E)
        return _tma.launch_wgrad(a, b, counts, out, config, dot_upcast(a.dtype), accumulate)
    if config is None:
        config = _INTERPRETER_WGRAD if a.device.type != "cuda" else wgrad_config(a.dtype, P, Q)
    if E == 0 or P == 0 or Q == 0:
        return out
    grid = (E * triton.cdiv(P, config.block_p) * triton.cdiv(Q, config.block_q),)
    grouped_wgrad_kernel[grid](
        a, b, out, counts,
        M, P, Q, E,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_P=config.block_p, BLOCK_Q=config.block_q, BLOCK_R=config.block_r,
        BLOCK_E=next_power_of_2(E), GROUP_P=config.group_p, ACCUMULATE=accumulate,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **dot_flags(a.dtype),
    )
    return out
