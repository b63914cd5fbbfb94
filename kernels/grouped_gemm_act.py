"""Grouped GEMMs of an MoE expert MLP with the activation fused into their epilogues.

The experts compute ``y = act(x @ w1[e] + b1[e]) * p`` then ``y @ w2[e] + b2[e]`` on each
expert's rows (``p``: the row's routing probability). Two kernels keep the ``[M, F]``
intermediates out of memory except for what the backward needs:

- :func:`grouped_gemm_act_kernel` (fc1 forward): the grouped GEMM ``x @ w1[e]`` whose epilogue
  adds the bias, stores the pre-activation ``h`` (saved for the backward, in ``x``'s dtype),
  applies the activation and the probability and stores ``y``. For SwiGLU the program holds two
  accumulators: columns ``cols`` (the gate, through SiLU) and ``F + cols`` (the up projection)
  of ``w1[e]`` (Megatron's ``torch.chunk(h, 2, -1)`` layout: gate half first), so each output
  tile reads its ``x`` tile once for both halves.
- :func:`grouped_gemm_dact_kernel` (fc2's data gradient): the grouped GEMM ``dy @ w2[e]^T``
  (``dL/dy``, never stored) whose epilogue loads ``h``, recomputes the activation and writes
  ``dh = dL/dh`` (both halves for SwiGLU) and, per row and column tile, the fp32 partial of
  ``dL/dp = sum_cols(dL/dy * act(h))``; the tiles' partials are summed afterwards in a fixed
  order (deterministic).

Both find their tiles from the device counts exactly as :mod:`mtp.kernels.grouped_gemm` does
(no host sync, graph-safe), write zeros for the rows past ``sum(counts)``, compute in fp32 and
take the activation of the *stored* (rounded) ``h`` so the forward and the backward agree.
Activations: ``"gelu"`` (erf), ``"gelu_tanh"``, ``"swiglu"`` (:mod:`mtp.kernels.bias_act`'s
codes and +-inf handling) and GPT-OSS's ``"clamped_swiglu"`` (interleaved gate/up columns
``2j`` / ``2j + 1``, ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with
``g = min(gate, L)``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mtp.kernels import grouped_gemm as _gg
from mtp.kernels import grouped_gemm_tma as _tma
from mtp.kernels._common import dot_upcast, next_power_of_2
from mtp.kernels.bias_act import ACTIVATIONS as _BIAS_ACT_CODES
from mtp.kernels.bias_act import _gelu_and_grad, _silu_and_sigmoid
from mtp.kernels.grouped_tiles import expert_tile_map, locate_expert_tile, tail_tile

#: activation name -> the kernels' ``ACT``: bias_act's codes plus GPT-OSS's clamped SwiGLU
#: (interleaved gate/up columns).
ACTIVATIONS = {**_BIAS_ACT_CODES, "clamped_swiglu": 3}
GATED = ("swiglu", "clamped_swiglu")

__all__ = ["act_config", "gpu_act_config", "grouped_gemm_act", "grouped_gemm_dact"]


@triton.jit
def _gate_up(cols, F, ACT: tl.constexpr):
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
def fwd_epilogue(
    acc_a, acc_g, expert, rows, mask_m, cols, mask_n, h_ptr, y_ptr, bias_ptr, p_ptr, F,
    stride_hm, stride_ym, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROB: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc1's epilogue on the fp32 accumulators (``acc_g``: the up half, gated activations
    only): + bias, store ``h``, store ``act(h) * p``."""
    rows64 = rows.to(tl.int64)
    gc, up = _gate_up(cols, F, ACT)
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
        y = y * tl.load(p_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def fwd_zero(rows, mask_m, cols, F, h_ptr, y_ptr, stride_hm, stride_ym, ACT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Zeros in ``h`` and ``y`` for a tile of the rows past the routed ones."""
    mask = mask_m[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=h_ptr.dtype.element_ty)
    gc, up = _gate_up(cols, F, ACT)
    h_ptrs = h_ptr + rows64 * stride_hm + gc[None, :]
    tl.store(h_ptrs, zeros, mask=mask)
    if ACT >= 2:
        tl.store(h_ptrs + up, zeros, mask=mask)
    tl.store(y_ptr + rows64 * stride_ym + cols[None, :], zeros, mask=mask)


@triton.jit
def grouped_gemm_act_kernel(
    a_ptr, b_ptr, h_ptr, y_ptr, bias_ptr, p_ptr, counts_ptr,
    M, F, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_hm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROB: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc1 with its epilogue: ``h[rows of e] = a @ b[e] + bias[e]`` (``[M, W]``, ``W = 2F`` for
    the gated activations, else ``F``) and ``y = act(h) * p[row]`` (``[M, F]``); zeros past the
    routed rows (``LIMIT`` / ``ALPHA``: the clamped SwiGLU's).
    Tiles and grid as :func:`mtp.kernels.grouped_gemm.grouped_gemm_kernel` over ``[M, F]``."""
    pid = tl.program_id(0)
    lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed, total = expert_tile_map(
        counts_ptr, M, F, E, BLOCK_M, BLOCK_N, BLOCK_E
    )
    last = total if PERSISTENT else pid + 1
    for tile in range(pid, last, tl.num_programs(0)):
        expert, rows, mask_m, cols, _ = _tile_coords(
            tile, counts_ptr, M, lane, counts, m_tiles, tile_ends, num_n, expert_tiles, routed,
            BLOCK_M, BLOCK_N, GROUP_M,
        )
        if expert >= 0:
            gc, up = _gate_up(cols, F, ACT)
            acc_a, acc_g = _dual_mma(
                a_ptr, b_ptr, expert, rows.to(tl.int64), mask_m, gc, cols < F, gc + up, K,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, ACT >= 2, UPCAST_DOT, DOT_PRECISION,
            )
            fwd_epilogue(acc_a, acc_g, expert, rows, mask_m, cols, cols < F, h_ptr, y_ptr,
                         bias_ptr, p_ptr, F, stride_hm, stride_ym, ACT, HAS_BIAS, HAS_PROB,
                         LIMIT, ALPHA)  # fmt: skip
        else:  # the zero tail: rows [routed, M)
            fwd_zero(rows, mask_m, cols, F, h_ptr, y_ptr, stride_hm, stride_ym, ACT,
                     BLOCK_M, BLOCK_N)


@triton.jit
def dact_epilogue(
    dy, rows, mask_m, cols, mask_n, h_ptr, p_ptr, dh_ptr, part_ptr, pid_n, M, F,
    stride_hm, stride_dm, ACT: tl.constexpr, HAS_PROB: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc2's data-gradient epilogue on ``dy = dL/dy`` (fp32): ``dh`` and the ``dL/dp``
    partial of this column tile."""
    rows64 = rows.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    gc, up = _gate_up(cols, F, ACT)
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
        scaled = dy * tl.load(p_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    if ACT >= 2:
        tl.store(dh_ptrs + up, (scaled * grad_g).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs, (scaled * grad_a).to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_gemm_dact_kernel(
    g_ptr, b_ptr, h_ptr, p_ptr, dh_ptr, part_ptr, counts_ptr,
    M, F, K, E,
    stride_gm, stride_gk, stride_be, stride_bk, stride_bn, stride_hm, stride_dm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    ACT: tl.constexpr, HAS_PROB: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIMIT: tl.constexpr = 7.0, ALPHA: tl.constexpr = 1.702,
):
    """fc2's data gradient with the activation's backward: ``dy = g[rows of e] @ b[e]``
    (``[M, F]``, ``b[e]`` is ``w2[e]^T``), ``dh = dy * p * act'(h)`` (``[M, W]``) and
    ``part[tile column, row] = sum(dy * act(h))`` over the tile's columns (``[cdiv(F, BN), M]``
    fp32, with ``HAS_PROB``); zeros past the routed rows."""
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
                          pid_n, M, F, stride_hm, stride_dm, ACT, HAS_PROB, LIMIT, ALPHA)
        else:  # the zero tail
            dact_zero(rows, mask_m, cols, pid_n, M, F, dh_ptr, part_ptr, stride_dm, ACT,
                      HAS_PROB, BLOCK_M, BLOCK_N)


@triton.jit
def dact_zero(rows, mask_m, cols, pid_n, M, F, dh_ptr, part_ptr, stride_dm, ACT: tl.constexpr,
              HAS_PROB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Zeros in ``dh`` and the ``dL/dp`` partials for a tile of the rows past the routed ones."""
    mask = mask_m[:, None] & (cols < F)[None, :]
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=dh_ptr.dtype.element_ty)
    gc, up = _gate_up(cols, F, ACT)
    dh_ptrs = dh_ptr + rows.to(tl.int64)[:, None] * stride_dm + gc[None, :]
    tl.store(dh_ptrs, zeros, mask=mask)
    if ACT >= 2:
        tl.store(dh_ptrs + up, zeros, mask=mask)
    if HAS_PROB:
        tl.store(part_ptr + pid_n.to(tl.int64) * M + rows,
                 tl.zeros((BLOCK_M,), dtype=tl.float32), mask=mask_m)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def gpu_act_config(dtype: torch.dtype, M: int, F: int, K: int, E: int,
                   act: str) -> _gg.GemmConfig:  # fmt: skip
    """Tiles of both kernels on sm_90 / sm_100: the grouped forward's
    (:func:`mtp.kernels.grouped_gemm.forward_config`) with room for the epilogue, whose
    activation (and, backward, its derivative and the loaded ``h``) keeps several fp32 tiles
    alive next to the accumulators: 128-row tiles use 64 columns (for SwiGLU two accumulators
    and two ``b`` tiles per stage, so registers and shared memory match the plain 128 x 128
    tile) and 64-row tiles 8 warps. The clamped SwiGLU (stride-2 gate/up loads, a larger
    epilogue) takes 32 columns: 128 x 32 with 8 warps, 64 x 32 with 4. With these, both kernels
    compile without spills for sm_90a and sm_100a."""
    config = _gg.forward_config(dtype, M, F, K, E)
    if act == "clamped_swiglu" and config.block_n > 32:
        return dataclasses.replace(config, block_n=32)
    if config.block_m == 128 and config.block_n > 64:
        config = dataclasses.replace(config, block_n=64)
    elif config.block_m == 64:
        config = dataclasses.replace(config, num_warps=8)
    return config


def act_config(a: torch.Tensor, M: int, F: int, K: int, E: int, act: str) -> _gg.GemmConfig:
    """:func:`gpu_act_config` on a GPU, the small interpreter tiles elsewhere."""
    if a.device.type != "cuda":
        return _gg.default_forward_config(a, M, F, K, E)
    return gpu_act_config(a.dtype, M, F, K, E, act)


def _launch(kernel, a, b, counts, M, F, K, act, limit, alpha, config, persistent, tensors,
            strides, flags, tma_args):
    """The pointer kernel, or with ``tma_args = (kernel, strides)`` its TMA version, on the
    tiles ``config`` (:func:`act_config`)."""
    E = b.shape[0]
    flags = dict(flags, ACT=ACTIVATIONS[act])
    if act == "clamped_swiglu":  # constexprs: other activations keep one build
        flags.update(LIMIT=float(limit), ALPHA=float(alpha))
    if tma_args is not None:
        from mtp.kernels import grouped_gemm_act_tma as _act_tma

        _act_tma.launch(tma_args[0], a, b, counts, M, F, K, config, dot_upcast(a.dtype),
                        tensors, tma_args[1], flags)  # fmt: skip
        return
    stage = (config.block_m + (2 if act in GATED else 1) * config.block_n) * config.block_k
    grid, persistent = _gg.launch_plan(a, config, M, F, E, persistent, stage)
    kernel[grid](
        *tensors, counts, M, F, K, E, *strides,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=next_power_of_2(E), GROUP_M=config.group_m, PERSISTENT=persistent,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **flags, **_gg.dot_flags(a.dtype),
    )


def _use_tma(tma: bool | None, a: torch.Tensor, w: torch.Tensor, unit_dim: int, act: str) -> bool:
    """TMA unless off or not eligible; the interleaved clamped SwiGLU reads its stride-2 gate
    and up columns with the pointer kernels."""
    from mtp.kernels import grouped_gemm_act_tma as _act_tma

    ok = _act_tma.eligible(a, w, unit_dim) and a.shape[1] > 0 and act != "clamped_swiglu"
    return _tma.use_tma(tma, a.device, ok)


def grouped_gemm_act(
    a: torch.Tensor,
    b: torch.Tensor,
    counts: torch.Tensor,
    h: torch.Tensor,
    y: torch.Tensor,
    act: str,
    *,
    bias: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    limit: float = 7.0,
    alpha: float = 1.702,
    persistent: bool | None = None,
    tma: bool | None = None,
) -> None:
    """One launch: ``h = a_e @ b[e] + bias[e]`` and ``y = act(h) * probs`` on each expert's rows,
    zeros past ``sum(counts)``.

    Args:
        a: ``[M, K]`` fp32/fp16/bf16, rows grouped by expert, any strides.
        b: ``[E, K, W]`` in ``a``'s dtype, any strides; ``W = 2F`` for ``"swiglu"`` (gate columns
            ``[0, F)``, up ``[F, 2F)``) and the clamped SwiGLU (gate ``2j``, up ``2j + 1``),
            else ``F``.
        counts: ``[E]`` int32/int64 on ``a``'s device.
        h: ``[M, W]`` output (pre-activation incl. bias), last dim contiguous.
        y: ``[M, F]`` output, last dim contiguous.
        act: ``"gelu"``, ``"gelu_tanh"``, ``"swiglu"`` or ``"clamped_swiglu"`` (GPT-OSS;
            pointer kernels only), see :data:`ACTIVATIONS`.
        bias: contiguous ``[E, W]`` or None. probs: ``[M]`` contiguous or None.
        limit, alpha: the clamped SwiGLU's (ignored by the other activations).
        persistent: as :func:`mtp.kernels.grouped_gemm.grouped_gemm` (pointer kernel).
        tma: the TMA kernel (:mod:`mtp.kernels.grouped_gemm_act_tma`); default: on sm_90+ for
            fp16/bf16 operands TMA can read (``MTP_TRITON_TMA=0/1`` overrides, as for
            :func:`mtp.kernels.grouped_gemm.grouped_gemm`).
    """
    M, K = a.shape
    F = y.shape[1]
    if M == 0 or F == 0:
        return
    _gg._check_counts(counts, b.shape[0], a.device)
    config = act_config(a, M, F, K, b.shape[0], act)
    tma_args = None
    if _use_tma(tma, a, b, 2, act):
        from mtp.kernels.grouped_gemm_act_tma import grouped_gemm_act_tma_kernel

        tma_args = (grouped_gemm_act_tma_kernel,
                    (a.stride(0), b.stride(0), b.stride(1), h.stride(0), y.stride(0)))
    _launch(
        grouped_gemm_act_kernel, a, b, counts, M, F, K, act, limit, alpha, config, persistent,
        (a, b, h, y, h if bias is None else bias, h if probs is None else probs),
        (a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), h.stride(0),
         y.stride(0)),
        dict(HAS_BIAS=bias is not None, HAS_PROB=probs is not None), tma_args,
    )  # fmt: skip


def grouped_gemm_dact(
    g: torch.Tensor,
    b: torch.Tensor,
    counts: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    act: str,
    *,
    probs: torch.Tensor | None = None,
    limit: float = 7.0,
    alpha: float = 1.702,
    persistent: bool | None = None,
    tma: bool | None = None,
) -> torch.Tensor | None:
    """One launch: ``dy = g_e @ b[e]`` (``b[e] = w2[e]^T``), ``dh = dy * probs * act'(h)`` on
    each expert's rows, zeros past ``sum(counts)``; returns the fp32 ``[tiles, M]`` partials of
    ``dL/dprobs`` (sum them over dim 0) when ``probs`` is given, else None.

    Args:
        g: ``[M, K]`` (fc2's output gradient), b: ``[E, K, F]`` any strides (``w2.transpose(1,
            2)`` of a ``[E, F, K]`` weight), h: ``[M, W]`` the forward's pre-activation, dh:
            ``[M, W]`` output (last dims contiguous), act, probs, limit, alpha, persistent and
            tma as in :func:`grouped_gemm_act` (TMA reads ``w2`` with its unit last stride).
    """
    M, K = g.shape
    F = b.shape[2]
    _gg._check_counts(counts, b.shape[0], g.device)
    config = act_config(g, M, F, K, b.shape[0], act)
    part = None
    if probs is not None:
        part = torch.empty((triton.cdiv(F, config.block_n), M), dtype=torch.float32,
                           device=g.device)  # fmt: skip
    if M == 0 or F == 0:
        return None if part is None else part.zero_()
    tma_args = None
    if _use_tma(tma, g, b, 1, act):
        from mtp.kernels.grouped_gemm_act_tma import grouped_gemm_dact_tma_kernel

        tma_args = (grouped_gemm_dact_tma_kernel,
                    (g.stride(0), b.stride(0), b.stride(2), h.stride(0), dh.stride(0)))
    _launch(
        grouped_gemm_dact_kernel, g, b, counts, M, F, K, act, limit, alpha, config, persistent,
        (g, b, h, dh if probs is None else probs, dh, dh if part is None else part),
        (g.stride(0), g.stride(1), b.stride(0), b.stride(1), b.stride(2), h.stride(0),
         dh.stride(0)),
        dict(HAS_PROB=probs is not None), tma_args,
    )  # fmt: skip
    return part
