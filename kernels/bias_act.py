"""Fused bias + activation: GeLU (exact erf or tanh approximation) and SwiGLU.

Kernels (all compute in fp32 and round the result to the output dtype):

- ``_bias_act_fwd_kernel``: ``y = act(x + bias)`` on a ``[BLOCK_M, BLOCK_N]`` tile. For the
  gated activation (SwiGLU) ``x`` has ``2 * N`` columns: ``y = silu(a) * g`` with ``a`` the first
  and ``g`` the second half (Megatron's ``torch.chunk(x, 2, -1)`` convention).
- ``_bias_act_bwd_kernel``: recomputes ``x + bias`` from the saved inputs, writes ``dx`` and (when
  asked) one fp32 partial column sum of ``dx`` per row group: stage one of the ``dbias``
  reduction. The row groups depend only on the shape, so the result is deterministic.
- ``_column_sum_kernel``: stage two, sums the partials over the row groups in a fixed order and
  writes ``dbias`` in the bias dtype.

Launchers take 2-D views whose last dimension is contiguous (any row stride, including 0 for an
expanded ``dy``) and preallocated outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2

#: activation name -> the ``ACT`` constexpr of the kernels.
ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "swiglu": 2}

#: Elements per program tile and the warps that process it (fwd and bwd).
TILE_ELEMENTS = 2048
NUM_WARPS = 8
#: Largest tile width; wider rows take several column blocks.
MAX_BLOCK_N = 1024
#: The backward splits rows into groups so that about this many programs run (more groups mean
#: more parallelism and a larger fp32 partial-sum workspace for dbias).
TARGET_PROGRAMS = 1024
#: Columns per program of the second reduction stage.
COLSUM_BLOCK = 1024


@triton.jit
def _gelu_and_grad(u, APPROX_TANH: tl.constexpr, NEED_GRAD: tl.constexpr):
    """``gelu(u)`` and, when ``NEED_GRAD``, ``gelu'(u)`` (else 0), in fp32."""
    if APPROX_TANH:
        # 0.5 * u * (1 + tanh(z)) == u * sigmoid(2 z),  z = sqrt(2/pi) * (u + 0.044715 u^3)
        z2 = 1.5957691216057308 * (u + 0.044715 * u * u * u)
        sig = tl.sigmoid(z2)
        y = u * sig
        if NEED_GRAD:
            dz2 = 1.5957691216057308 * (1.0 + 0.134145 * u * u)
            dy = sig + u * sig * (1.0 - sig) * dz2
        else:
            dy = 0.0
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
        y = u * cdf
        if NEED_GRAD:
            dy = cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)
        else:
            dy = 0.0
    return y, dy


@triton.jit
def _tile_rows(row0, cols, cmask, M, stride_xm, stride_om, BLOCK_M: tl.constexpr):
    """Mask of the ``[BLOCK_M, BLOCK_N]`` tile at ``row0`` and its row offsets into x and out."""
    rows = row0 + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    return mask, rows64 * stride_xm, rows64 * stride_om


@triton.jit
def _load_pre_activation(x_ptr, b_ptr, xrow, cols, mask, cmask, col_offset, HAS_BIAS: tl.constexpr):
    """fp32 ``x[rows, col_offset + cols] + bias[col_offset + cols]`` (0 where masked)."""
    u = tl.load(x_ptr + xrow + (col_offset + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + col_offset + cols, mask=cmask, other=0.0).to(tl.float32)
        u = u + b[None, :]
    return u


@triton.jit
def _bias_act_fwd_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask, xrow, yrow = _tile_rows(
        tl.program_id(0) * BLOCK_M, cols, cmask, M, stride_xm, stride_ym, BLOCK_M
    )
    u = _load_pre_activation(x_ptr, b_ptr, xrow, cols, mask, cmask, 0, HAS_BIAS)
    if ACT == 2:
        g = _load_pre_activation(x_ptr, b_ptr, xrow, cols, mask, cmask, N, HAS_BIAS)
        y = u * tl.sigmoid(u) * g
    else:
        y, _ = _gelu_and_grad(u, ACT == 1, False)
    tl.store(y_ptr + yrow + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd_kernel(
    dy_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    part_ptr,
    M,
    N,
    stride_dym,
    stride_xm,
    stride_dxm,
    rows_per_group,
    HAS_BIAS: tl.constexpr,
    COMPUTE_DBIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    row0 = pid_g * rows_per_group
    for r in range(0, rows_per_group, BLOCK_M):
        mask, xrow, dxrow = _tile_rows(row0 + r, cols, cmask, M, stride_xm, stride_dxm, BLOCK_M)
        _, dyrow, _ = _tile_rows(row0 + r, cols, cmask, M, stride_dym, 0, BLOCK_M)
        dy = tl.load(dy_ptr + dyrow + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = _load_pre_activation(x_ptr, b_ptr, xrow, cols, mask, cmask, 0, HAS_BIAS)
        if ACT == 2:
            g = _load_pre_activation(x_ptr, b_ptr, xrow, cols, mask, cmask, N, HAS_BIAS)
            sig = tl.sigmoid(u)
            silu = u * sig
            du = tl.where(mask, dy * g * (sig + silu * (1.0 - sig)), 0.0)
            dg = tl.where(mask, dy * silu, 0.0)
            dg_out = dg.to(dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + dxrow + (N + cols)[None, :], dg_out, mask=mask)
            if COMPUTE_DBIAS:
                acc_g += tl.sum(dg, axis=0)
        else:
            _, grad = _gelu_and_grad(u, ACT == 1, True)
            du = tl.where(mask, dy * grad, 0.0)
        tl.store(dx_ptr + dxrow + cols[None, :], du.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DBIAS:
            acc_a += tl.sum(du, axis=0)
    if COMPUTE_DBIAS:
        width = 2 * N if ACT == 2 else N
        part = part_ptr + pid_g.to(tl.int64) * width
        tl.store(part + cols, acc_a, mask=cmask)
        if ACT == 2:
            tl.store(part + N + cols, acc_g, mask=cmask)


@triton.jit
def _column_sum_kernel(part_ptr, out_ptr, G, W, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for g in range(0, G):
        acc += tl.load(part_ptr + g * W + cols, mask=mask, other=0.0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tile_shape(n_cols: int) -> tuple[int, int]:
    """Default ``(BLOCK_M, BLOCK_N)`` for an output of ``n_cols`` columns."""
    block_n = min(next_power_of_2(max(n_cols, 1)), MAX_BLOCK_N)
    return max(1, TILE_ELEMENTS // block_n), block_n


def backward_groups(n_rows: int, n_cols: int) -> tuple[int, int]:
    """``(row_groups, rows_per_group)`` of the backward for an ``n_rows x n_cols`` output.

    Depends on the shape only (not on the device), so dbias is bitwise reproducible.
    """
    block_m, block_n = tile_shape(n_cols)
    row_blocks = triton.cdiv(n_rows, block_m)
    col_blocks = triton.cdiv(n_cols, block_n)
    groups = max(1, min(row_blocks, triton.cdiv(TARGET_PROGRAMS, col_blocks)))
    blocks_per_group = triton.cdiv(row_blocks, groups)
    return triton.cdiv(row_blocks, blocks_per_group), blocks_per_group * block_m


def _check_act(act: str) -> int:
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {list(ACTIVATIONS)}, got {act!r}")
    return ACTIVATIONS[act]


def bias_act_forward(x: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, act: str) -> None:
    """``y = act(x + bias)``.

    Args:
        x: ``[M, W]`` with ``x.stride(1) == 1``; ``W = N`` (GeLU) or ``2 * N`` (SwiGLU).
        bias: ``[W]`` contiguous, or None.
        y: ``[M, N]`` output with ``y.stride(1) == 1``.
        act: ``"gelu"``, ``"gelu_tanh"`` or ``"swiglu"``.
    """
    code = _check_act(act)
    M, N = y.shape
    if M == 0 or N == 0:
        return
    block_m, block_n = tile_shape(N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _bias_act_fwd_kernel[grid](
        x,
        bias if bias is not None else x,
        y,
        M,
        N,
        x.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        ACT=code,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=NUM_WARPS,
    )


def bias_act_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    dx: torch.Tensor,
    dbias: torch.Tensor | None,
    act: str,
) -> None:
    """``dx = dy * act'(x + bias)`` and ``dbias = dx.sum(0)`` (fp32 two-stage reduction).

    Args:
        dy: ``[M, N]`` with ``dy.stride(1) == 1`` (row stride may be 0).
        x: ``[M, W]`` as in :func:`bias_act_forward`.
        bias: ``[W]`` or None.
        dx: ``[M, W]`` output with ``dx.stride(1) == 1``.
        dbias: ``[W]`` contiguous output, or None to skip the bias gradient.
        act: as in :func:`bias_act_forward`.
    """
    code = _check_act(act)
    M, N = dy.shape
    if dbias is not None and (M == 0 or N == 0):
        dbias.zero_()
    if M == 0 or N == 0:
        return
    block_m, block_n = tile_shape(N)
    groups, rows_per_group = backward_groups(M, N)
    width = x.shape[1]
    part = (
        torch.empty((groups, width), dtype=torch.float32, device=dy.device)
        if dbias is not None
        else dx
    )
    _bias_act_bwd_kernel[(triton.cdiv(N, block_n), groups)](
        dy,
        x,
        bias if bias is not None else x,
        dx,
        part,
        M,
        N,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
        rows_per_group,
        HAS_BIAS=bias is not None,
        COMPUTE_DBIAS=dbias is not None,
        ACT=code,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=NUM_WARPS,
    )
    if dbias is not None:
        _column_sum_kernel[(triton.cdiv(width, COLSUM_BLOCK),)](
            part, dbias, groups, width, BLOCK=COLSUM_BLOCK, num_warps=NUM_WARPS
        )
