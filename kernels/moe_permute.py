"""MoE token permute / unpermute: row gather and per-token combine (Triton).

Two kernels carry every data movement of :mod:`mtp.ops.moe_permute` (forward and backward):

- :func:`gather_rows`: ``out[i, :] = scale[i] * x[index[i], :]`` with ``out[i] = 0`` where
  ``index[i]`` is out of range (``-1`` marks a padded slot); optionally also
  ``dot[i] = sum_h x[index[i], h] * other[i, h]`` (the gradient of ``scale``). Grid (rows, column
  blocks); with the dot, one program per row loops over the hidden dimension. This is the
  permute forward and the unpermute backward.
- :func:`combine_rows`: ``out[t, :] = sum_j weight[rows[j]] * x[rows[j], :]`` for
  ``j in [offsets[t], offsets[t + 1])``, accumulated in fp32 in ascending ``j`` and written once:
  a per-token gather, no atomics, deterministic. Grid (tokens, column blocks). This is the
  unpermute forward and the permute backward.

The token-major kernels (the fused permute / unpermute with the map of
:mod:`mtp.kernels.moe_row_map`) are in :mod:`mtp.kernels.moe_token_major`.

All address arithmetic is int64: a DeepSeek-size ``num_out_tokens * hidden`` exceeds 2**31.
The launchers take contiguous tensors and preallocated outputs, keep one
:class:`~mtp.kernels._launch.Launch` per key and do no autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2
from mtp.kernels._launch import Launch, Plans, aligned

__all__ = ["gather_rows", "combine_rows", "block_config", "MAX_BLOCK_H"]

_PLANS = Plans()

#: Largest slice of the hidden dimension one program handles at a time.
MAX_BLOCK_H = 1024


def block_config(hidden: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` for a row of ``hidden`` elements (the default launch config)."""
    block = min(next_power_of_2(max(hidden, 1)), MAX_BLOCK_H)
    return block, max(1, min(4, block // 256))


# Loops with runtime bounds are written as `while` loops: the Triton 3.6 interpreter cannot
# iterate `range()` over runtime values with NumPy 2 (it converts 1-element arrays to int).


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    index_ptr,
    scale_ptr,
    other_ptr,
    out_ptr,
    dot_ptr,
    num_src_rows,
    hidden,
    HAS_SCALE: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    HAS_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Grid (rows, column blocks); with HAS_DOT the grid has one column block and the program
    # strides over the whole row to finish the dot product.
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(index_ptr + row).to(tl.int64)
    valid = (src >= 0) & (src < num_src_rows)
    src = tl.where(valid, src, 0)
    src_base = x_ptr + src * hidden
    dst_offset = row * hidden
    # Columns to read: the whole row, or none for an empty slot (which then stores zeros).
    read_limit = tl.where(valid, hidden, 0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    h0 = tl.program_id(1) * BLOCK_H
    step = tl.num_programs(1) * BLOCK_H
    while h0 < hidden:
        cols = h0 + tl.arange(0, BLOCK_H)
        in_row = cols < hidden
        v = tl.load(src_base + cols, mask=cols < read_limit, other=0.0)
        if WRITE_OUT:
            if HAS_SCALE:
                tl.store(
                    out_ptr + dst_offset + cols,
                    (v.to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
                    mask=in_row,
                )
            else:
                tl.store(out_ptr + dst_offset + cols, v, mask=in_row)
        if HAS_DOT:
            o = tl.load(other_ptr + dst_offset + cols, mask=in_row, other=0.0)
            acc += v.to(tl.float32) * o.to(tl.float32)
        h0 += step
    if HAS_DOT:
        tl.store(dot_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _combine_rows_kernel(
    x_ptr,
    rows_ptr,
    offsets_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Grid (tokens, column blocks): each program sums its token's rows over one column block.
    token = tl.program_id(0).to(tl.int64)
    j = tl.load(offsets_ptr + token).to(tl.int64)
    end = tl.load(offsets_ptr + token + 1).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    while j < end:
        r = tl.load(rows_ptr + j).to(tl.int64)
        v = tl.load(x_ptr + r * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            v = v * tl.load(weight_ptr + r).to(tl.float32)
        acc += v
        j += 1
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def gather_rows(
    x: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None,
    *,
    scale: torch.Tensor | None = None,
    other: torch.Tensor | None = None,
    dot: torch.Tensor | None = None,
) -> None:
    """Launch the row gather.

    Args:
        x: ``[M, H]`` source rows (contiguous).
        index: ``[N]`` int32/int64 source row of each output row; outside ``[0, M)`` (``-1``)
            gives a zero row.
        out: ``[N, H]`` output, dtype of your choice (``None``: only ``dot`` is computed).
        scale: optional ``[N]`` float row factor (computed in fp32).
        other: ``[N, H]`` rows to dot with the gathered rows (needs ``dot``).
        dot: ``[N]`` fp32 output of ``sum_h x[index[i], h] * other[i, h]`` (unscaled).
    """
    n, hidden = index.shape[0], x.shape[1]
    if n == 0:
        return
    if hidden == 0:
        if dot is not None:
            dot.zero_()
        return
    key = ("gather", n, x.shape[0], hidden, x.dtype, index.dtype,
           None if scale is None else scale.dtype, None if other is None else other.dtype,
           None if out is None else out.dtype, dot is None,
           aligned(x, index, scale, other, out, dot), x.device)  # fmt: skip
    launch = _PLANS.get(key)
    if launch is None:
        block, warps = block_config(hidden)
        has_dot = dot is not None
        grid = (n, 1 if has_dot else triton.cdiv(hidden, block))
        launch = _PLANS.add(key, Launch(
            _gather_rows_kernel, grid, _gather_args(x, index, out, scale, other, dot),
            dict(HAS_SCALE=scale is not None, WRITE_OUT=out is not None, HAS_DOT=has_dot,
                 BLOCK_H=block, num_warps=warps)))  # fmt: skip
    launch(*_gather_args(x, index, out, scale, other, dot))


def _gather_args(x, index, out, scale, other, dot) -> tuple:
    return (x, index, scale if scale is not None else index, other if dot is not None else x,
            out if out is not None else x, dot if dot is not None else x, x.shape[0], x.shape[1])


def combine_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
) -> None:
    """Launch the per-token combine.

    Args:
        x: ``[N, H]`` rows to merge (contiguous).
        rows: ``[>= offsets[-1]]`` int32/int64 row numbers grouped by destination token.
        offsets: ``[T + 1]`` int64: token ``t`` merges ``rows[offsets[t]:offsets[t + 1]]``.
        out: ``[T, H]`` output (every element is written; fp32 accumulation).
        weight: optional ``[N]`` float factor per row of ``x``.
    """
    tokens, hidden = out.shape
    if tokens == 0 or hidden == 0:
        return
    key = ("combine", tokens, hidden, x.dtype, rows.dtype, offsets.dtype,
           None if weight is None else weight.dtype, out.dtype,
           aligned(x, rows, offsets, weight, out), x.device)  # fmt: skip
    w = weight if weight is not None else offsets
    launch = _PLANS.get(key)
    if launch is None:
        block, warps = block_config(hidden)
        launch = _PLANS.add(key, Launch(
            _combine_rows_kernel, (tokens, triton.cdiv(hidden, block)),
            (x, rows, offsets, w, out, hidden),
            dict(HAS_WEIGHT=weight is not None, BLOCK_H=block, num_warps=warps)))  # fmt: skip
    launch(x, rows, offsets, w, out, hidden)
