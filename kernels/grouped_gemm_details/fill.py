"""Zeros for what PyTorch's ``grouped_mm`` leaves unwritten, without a pass over its output.

``torch.nn.functional.grouped_mm`` writes the rows of its groups and nothing else: rows of the
output past ``offs[-1]`` (the tail of a worst-case buffer) and, in the weight-gradient form, the
``[P, Q]`` blocks of empty groups stay uninitialised. mtp's ``torch`` backend returns exact zeros
there, as its other backends do. A ``masked_fill`` over the whole output would read and write
every element (a full extra pass, as large as the GEMM's own output traffic); these kernels
read the offsets on the device and store only the zeros, so nothing waits for the host:

- :func:`zero_tail_rows`: one program per ``BLOCK_M`` rows; a program whose rows all lie before
  ``offs[-1]`` stores nothing;
- :func:`zero_empty_groups`: ``E x SPLITS`` programs; those of a non-empty group store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._launch import Launch, Plans, aligned

__all__ = ["zero_empty_groups", "zero_empty_groups_kernel", "zero_tail_rows",
           "zero_tail_rows_kernel"]  # fmt: skip

_BLOCK_M, _BLOCK_N = 32, 256
_BLOCK, _SPLITS = 2048, 64


@triton.jit
def zero_tail_rows_kernel(y_ptr, offs_ptr, M, N, E, stride_m,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows ``[offs[E-1], M)`` of ``y [M, N]`` (unit column stride) set to zero."""
    total = tl.load(offs_ptr + E - 1).to(tl.int64)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    if row0 + BLOCK_M > total:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = (rows >= total) & (rows < M)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
        for col0 in range(0, N, BLOCK_N):
            cols = col0 + tl.arange(0, BLOCK_N)
            ptrs = y_ptr + rows[:, None] * stride_m + cols[None, :]
            tl.store(ptrs, zeros, mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def zero_empty_groups_kernel(c_ptr, counts_ptr, PQ, stride_e,
                             BLOCK: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """``c[e]`` (``PQ`` contiguous elements from ``e * stride_e``) set to zero where
    ``counts[e] <= 0``; program ``(e, s)`` takes every ``SPLITS``-th block of it."""
    e = tl.program_id(0)
    if tl.load(counts_ptr + e) <= 0:
        base = c_ptr + e.to(tl.int64) * stride_e
        zeros = tl.zeros((BLOCK,), dtype=c_ptr.dtype.element_ty)
        for start in range(tl.program_id(1) * BLOCK, PQ, SPLITS * BLOCK):
            idx = start + tl.arange(0, BLOCK)
            tl.store(base + idx, zeros, mask=idx < PQ)


_PLANS = Plans()


def zero_tail_rows(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero the rows of ``y [M, N]`` at or past ``offs[-1]`` in place (``offs``: int32 end
    offsets of the groups, on ``y``'s device); returns ``y``."""
    M, N = y.shape
    if M == 0 or N == 0:
        return y
    if y.stride(1) != 1:
        raise ValueError(f"zero_tail_rows: y needs unit column stride, got strides {y.stride()}")
    args = (M, N, offs.shape[0], y.stride(0))
    key = ("tail", *args, y.dtype, offs.dtype, aligned(y, offs), y.device)
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.add(key, Launch(zero_tail_rows_kernel, (triton.cdiv(M, _BLOCK_M),),
                                        (y, offs, *args), dict(BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)))
    launch(y, offs, *args)
    return y


def zero_empty_groups(c: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Zero ``c[e]`` of ``c [E, P, Q]`` (each ``c[e]`` contiguous) where ``counts[e] <= 0``,
    in place; returns ``c``."""
    E, P, Q = c.shape
    if c.numel() == 0:
        return c
    if c.stride(1) != Q or c.stride(2) != 1:
        raise ValueError(f"zero_empty_groups: c[e] must be contiguous, got strides {c.stride()}")
    args = (P * Q, c.stride(0))
    key = ("groups", E, *args, c.dtype, counts.dtype, aligned(c, counts), c.device)
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.add(key, Launch(zero_empty_groups_kernel, (E, _SPLITS), (c, counts, *args),
                                        dict(BLOCK=_BLOCK, SPLITS=_SPLITS)))
    launch(c, counts, *args)
    return c
