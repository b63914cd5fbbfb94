"""TMA versions of the fused expert-MLP kernels of :mod:`mtp.kernels.grouped_gemm_act` (sm_90a /
sm_100a, fp16/bf16 operands that TMA can read).

Same contract and epilogues (``fwd_epilogue`` / ``dact_epilogue`` of that module); the main loop
is :mod:`mtp.kernels.grouped_gemm_tma`'s: the tile map of its ``tile_map_kernel`` (one small
launch before each kernel), operands read through device-side tensor descriptors, a persistent
loop over the output tiles (``flatten`` where this Triton has it: the next tile's loads overlap
this tile's epilogue). SwiGLU loads two ``b`` tiles per K step from one ``[E, K, 2F]``
descriptor (gate at column ``col``, up at ``col + F``; a gate tile running past ``F`` reads up
columns that the epilogue masks out). The epilogue keeps several fp32 tiles alive, so these
kernels are not warp-specialised and use the tiles of
:func:`mtp.kernels.grouped_gemm_act.gpu_act_config` (no spills for sm_90a / sm_100a).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels import grouped_gemm_tma as _tma
from mtp.kernels.grouped_gemm_act import dact_epilogue, dact_zero, fwd_epilogue, fwd_zero
from mtp.kernels.grouped_gemm_tma import map_tile
from mtp.kernels.grouped_tiles import tail_tile

__all__ = ["grouped_gemm_act_tma_kernel", "grouped_gemm_dact_tma_kernel", "launch"]


@triton.jit
def grouped_gemm_act_tma_kernel(
    a_ptr, b_ptr, h_ptr, y_ptr, bias_ptr, p_ptr, map_ptr,
    M, F, K, E,
    stride_am, stride_be, stride_bk, stride_hm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROB: tl.constexpr,
):
    """fc1 with its epilogue (see :func:`mtp.kernels.grouped_gemm_act.grouped_gemm_act_kernel`);
    ``a`` ``[M, K]`` and ``b`` ``[E, K, W]`` with unit last strides."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
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
        fwd_epilogue(acc_a, acc_g, expert, rows, mask_m, cols, cols < F, h_ptr, y_ptr, bias_ptr,
                     p_ptr, F, stride_hm, stride_ym, ACT, HAS_BIAS, HAS_PROB)  # fmt: skip
    for tile in range(pid, (M - routed + BLOCK_M - 1) // BLOCK_M * num_n, programs):
        rows, cols = tail_tile(tile, 0, routed, num_n, BLOCK_M, BLOCK_N)
        fwd_zero(rows, rows < M, cols, F, h_ptr, y_ptr, stride_hm, stride_ym, ACT,
                 BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def grouped_gemm_dact_tma_kernel(
    g_ptr, b_ptr, h_ptr, p_ptr, dh_ptr, part_ptr, map_ptr,
    M, F, K, E,
    stride_gm, stride_be, stride_bn, stride_hm, stride_dm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ACT: tl.constexpr, HAS_PROB: tl.constexpr,
):
    """fc2's data gradient with the activation's backward (see
    :func:`mtp.kernels.grouped_gemm_act.grouped_gemm_dact_kernel`); ``g`` ``[M, K]`` with a
    unit last stride and ``b_ptr`` the ``[E, F, K]`` weight ``w2`` with a unit last stride."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
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
        dact_epilogue(dy, rows, mask_m, cols, cols < F, h_ptr, p_ptr, dh_ptr, part_ptr,
                      col // BLOCK_N, M, F, stride_hm, stride_dm, ACT, HAS_PROB)  # fmt: skip
    for tile in range(pid, (M - routed + BLOCK_M - 1) // BLOCK_M * num_n, programs):
        rows, cols = tail_tile(tile, 0, routed, num_n, BLOCK_M, BLOCK_N)
        dact_zero(rows, rows < M, cols, tile % num_n, M, F, dh_ptr, part_ptr, stride_dm, ACT,
                  HAS_PROB, BLOCK_M, BLOCK_N)  # fmt: skip


def eligible(a: torch.Tensor, b: torch.Tensor, unit_dim: int) -> bool:
    """fp16/bf16 ``a`` and weight ``b`` that TMA can read (``b``'s unit stride in ``unit_dim``)."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _tma._aligned(a, 1) and _tma._aligned(b, unit_dim)


def launch(kernel, a, b, counts, M, F, K, config, upcast, tensors, strides, flags) -> None:
    """Tile map, then ``kernel`` on one program per SM (at most one per worst-case tile)."""
    E = b.shape[0]
    tile_map = _tma.build_tile_map(counts, M, E, config.block_m, a.device)
    bound = (triton.cdiv(M, config.block_m) + E) * triton.cdiv(F, config.block_n)
    kernel[(min(bound, _tma.sm_count(a.device)),)](
        *tensors, tile_map, M, F, K, E, *strides,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, FLATTEN=_tma.supports_warp_specialize(), UPCAST_DOT=upcast,
        num_warps=config.num_warps, num_stages=config.num_stages, **flags,
    )  # fmt: skip
