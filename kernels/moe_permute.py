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

The token-major kernels take the map of :mod:`mtp.kernels.moe_row_map` (``token_count[t]``
rows ``token_rows[t, :count]``, experts ``token_experts[t, :count]``, ascending) and work on a
``[rows of a token, BLOCK_H]`` tile, so that all index loads of a token are issued before its
data loads:

- :func:`scatter_tokens`: each token row is read once and written to its rows; extra programs
  zero the rows that hold no token. The permute forward.
- :func:`combine_tokens`: ``out[t] = sum_j probs[t, e_j] * x[r_j]`` in fp32 (fixed order,
  deterministic), optionally the ``[T, E]`` gradient of the permuted probabilities. The
  unpermute forward and the permute backward.
- :func:`unpermute_backward`: each token reads its output gradient once and writes its rows'
  gradients and its probs gradient (the dots ``<x[r_j], grad[t]>``).

All address arithmetic is int64: a DeepSeek-size ``num_out_tokens * hidden`` exceeds 2**31.
The launchers take contiguous tensors and preallocated outputs; they do no autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2

__all__ = ["gather_rows", "combine_rows", "block_config", "MAX_BLOCK_H"]

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
    block, warps = block_config(hidden)
    has_dot = dot is not None
    grid = (n, 1 if has_dot else triton.cdiv(hidden, block))
    _gather_rows_kernel[grid](
        x,
        index,
        scale if scale is not None else index,
        other if has_dot else x,
        out if out is not None else x,
        dot if has_dot else x,
        x.shape[0],
        hidden,
        HAS_SCALE=scale is not None,
        WRITE_OUT=out is not None,
        HAS_DOT=has_dot,
        BLOCK_H=block,
        num_warps=warps,
    )


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
    block, warps = block_config(hidden)
    _combine_rows_kernel[(tokens, triton.cdiv(hidden, block))](
        x,
        rows,
        offsets,
        weight if weight is not None else offsets,
        out,
        hidden,
        HAS_WEIGHT=weight is not None,
        BLOCK_H=block,
        num_warps=warps,
    )


# --------------------------------------------------------------------------------------------
# Token-major kernels: each token's rows come from the map of :mod:`mtp.kernels.moe_row_map`
# (token_count[t] rows token_rows[t, :count], experts token_experts[t, :count], ascending).
# --------------------------------------------------------------------------------------------

#: Elements of one ``[rows of a token, BLOCK_H]`` tile of the token-major kernels.
TOKEN_TILE = 8192
#: Rows per program that zero the rows holding no token.
ZERO_ROWS = 16


def token_block(hidden: int, s_block: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of the token-major kernels: the ``[S_BLOCK, BLOCK_H]`` tile of a
    token's rows stays within :data:`TOKEN_TILE` elements."""
    block, warps = block_config(hidden)
    block = max(16, min(block, TOKEN_TILE // s_block))
    return block, max(warps, min(8, s_block * block // 1024))


@triton.jit
def _scatter_tokens_kernel(
    x_ptr, trows_ptr, tcount_ptr, row_id_ptr, out_ptr, T, N, hidden, S,
    S_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, ZERO_ROWS: tl.constexpr,
):
    # Programs [0, T): token t reads its row once and writes it to each of its rows (S_BLOCK
    # rows at a time). Programs [T, T + N / ZERO_ROWS): rows that hold no token get zeros.
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    if p < T:
        t = p.to(tl.int64)
        cnt = tl.load(tcount_ptr + t)
        v = tl.load(x_ptr + t * hidden + cols, mask=cols < tl.where(cnt > 0, hidden, 0), other=0.0)
        v2 = v[None, :] + tl.zeros([S_BLOCK, BLOCK_H], dtype=v.dtype)
        j0 = 0
        while j0 < cnt:
            js = j0 + tl.arange(0, S_BLOCK)
            jmask = js < cnt
            rows = tl.load(trows_ptr + t * S + js, mask=jmask, other=0).to(tl.int64)
            tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], v2,
                     mask=jmask[:, None] & cmask[None, :])
            j0 += S_BLOCK
    else:
        r = (p - T).to(tl.int64) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        rid = tl.load(row_id_ptr + r, mask=r < N, other=0)
        zero = tl.zeros([ZERO_ROWS, BLOCK_H], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None] * hidden + cols[None, :], zero,
                 mask=((rid < 0) & (r < N))[:, None] & cmask[None, :])


@triton.jit
def _combine_tokens_kernel(
    x_ptr, trows_ptr, texp_ptr, tcount_ptr, probs_ptr, out_ptr, gpp_ptr, gprobs_ptr,
    T, E, hidden, S,
    HAS_PROBS: tl.constexpr, GRAD_PROBS: tl.constexpr, S_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # out[t] = sum_j probs[t, e_j] * x[r_j] (fp32, fixed order); with GRAD_PROBS also
    # gprobs[t, e] = gpp[r_j] where e == e_j, 0 elsewhere (the permute backward).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    cnt = tl.load(tcount_ptr + t)
    if GRAD_PROBS:
        if tl.program_id(1) == 0:
            ex = tl.arange(0, E_BLOCK)
            tl.store(gprobs_ptr + t * E + ex, tl.zeros([E_BLOCK], dtype=tl.float32), mask=ex < E)
        tl.debug_barrier()  # the zeros land before the routed entries overwrite theirs
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    g_cnt = tl.where(tl.program_id(1) == 0, cnt, 0)  # program column 0 writes gprobs
    j0 = 0
    while j0 < cnt:
        # S_BLOCK rows unrolled, each a 1-D [BLOCK_H] load added in row order: every load of
        # the chunk is in flight at once and the sum stays in registers. (A [S_BLOCK, BLOCK_H]
        # tile summed over axis 0 went through shared memory: on the H200, L1 96 % busy at
        # 12 % of DRAM, 330 us for Mixtral's unpermute.)
        for jj in tl.static_range(S_BLOCK):
            j = j0 + jj
            ok = j < cnt
            row = tl.load(trows_ptr + t * S + j, mask=ok, other=0).to(tl.int64)
            vmask = cols < tl.where(ok, hidden, 0)  # cmask, or nothing past the count
            v = tl.load(x_ptr + row * hidden + cols, mask=vmask, other=0.0).to(tl.float32)
            if HAS_PROBS or GRAD_PROBS:
                e_j = tl.load(texp_ptr + t * S + j, mask=ok, other=0)
            if HAS_PROBS:
                v = v * tl.load(probs_ptr + t * E + e_j, mask=ok, other=0.0).to(tl.float32)
            acc += v
            if GRAD_PROBS:
                gok = j < g_cnt
                g = tl.load(gpp_ptr + row, mask=gok, other=0.0)
                tl.store(gprobs_ptr + t * E + e_j, g, mask=gok)
        j0 += S_BLOCK
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _unpermute_bwd_kernel(
    g_ptr, x_ptr, trows_ptr, texp_ptr, tcount_ptr, row_id_ptr, probs_ptr, gx_ptr, gprobs_ptr,
    T, N, E, hidden, S,
    HAS_PROBS: tl.constexpr, NEED_GX: tl.constexpr, NEED_GPROBS: tl.constexpr,
    S_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
):
    # Programs [0, T): token t reads grad[t] (once when it has <= S_BLOCK rows), writes
    # gx[r_j] = probs[t, e_j] * grad[t] and the dots <x[r_j], grad[t]> into gprobs[t, e_j]
    # (0 elsewhere). Programs [T, T + N / ZERO_ROWS): zero the gx rows that hold no token.
    p = tl.program_id(0)
    if p < T:
        t = p.to(tl.int64)
        cnt = tl.load(tcount_ptr + t)
        if NEED_GPROBS:
            ex = tl.arange(0, E_BLOCK)
            tl.store(gprobs_ptr + t * E + ex, tl.zeros([E_BLOCK], dtype=tl.float32), mask=ex < E)
            tl.debug_barrier()  # the zeros land before the routed entries overwrite theirs
        j0 = 0
        while j0 < cnt:
            js = j0 + tl.arange(0, S_BLOCK)
            jmask = js < cnt
            rows = tl.load(trows_ptr + t * S + js, mask=jmask, other=0).to(tl.int64)
            exps = tl.load(texp_ptr + t * S + js, mask=jmask, other=0)
            if HAS_PROBS:
                w = tl.load(probs_ptr + t * E + exps, mask=jmask, other=0.0).to(tl.float32)
            dots = tl.zeros([S_BLOCK], dtype=tl.float32)
            h0 = 0
            while h0 < hidden:
                cols = h0 + tl.arange(0, BLOCK_H)
                cmask = cols < hidden
                m2 = jmask[:, None] & cmask[None, :]
                g = tl.load(g_ptr + t * hidden + cols, mask=cmask, other=0.0).to(tl.float32)
                if NEED_GX:
                    gx = g[None, :] + tl.zeros([S_BLOCK, BLOCK_H], dtype=tl.float32)
                    if HAS_PROBS:
                        gx = gx * w[:, None]
                    tl.store(gx_ptr + rows[:, None] * hidden + cols[None, :],
                             gx.to(gx_ptr.dtype.element_ty), mask=m2)
                if NEED_GPROBS:
                    xv = tl.load(x_ptr + rows[:, None] * hidden + cols[None, :], mask=m2,
                                 other=0.0)
                    dots += tl.sum(xv.to(tl.float32) * g[None, :], axis=1)
                h0 += BLOCK_H
            if NEED_GPROBS:
                tl.store(gprobs_ptr + t * E + exps, dots, mask=jmask)
            j0 += S_BLOCK
    elif NEED_GX:
        r = (p - T).to(tl.int64) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        empty = tl.load(row_id_ptr + r, mask=r < N, other=0) < 0
        h0 = 0
        while h0 < hidden:
            cols = h0 + tl.arange(0, BLOCK_H)
            zero = tl.zeros([ZERO_ROWS, BLOCK_H], dtype=gx_ptr.dtype.element_ty)
            tl.store(gx_ptr + r[:, None] * hidden + cols[None, :], zero,
                     mask=(empty & (r < N))[:, None] & (cols < hidden)[None, :])
            h0 += BLOCK_H


#: Most rows of a token handled at once (a top-k token's k rows in one chunk up to k = 8).
MAX_S_BLOCK = 8


def _s_block(token_rows: torch.Tensor) -> int:
    return min(next_power_of_2(max(token_rows.shape[1], 1)), MAX_S_BLOCK)


def scatter_tokens(x, token_rows, token_count, row_id_map, out, *, zero_empty: bool) -> None:
    """``out[token_rows[t, j]] = x[t]`` for ``j < token_count[t]``; with ``zero_empty`` also
    ``out[r] = 0`` where ``row_id_map[r] < 0``. One launch."""
    tokens, hidden = x.shape
    n = out.shape[0]
    programs = tokens + (triton.cdiv(n, ZERO_ROWS) if zero_empty else 0)
    if programs == 0 or hidden == 0:
        return
    s_block = _s_block(token_rows)
    block, warps = token_block(hidden, max(s_block, ZERO_ROWS))
    _scatter_tokens_kernel[(programs, triton.cdiv(hidden, block))](
        x, token_rows, token_count, row_id_map, out, tokens, n, hidden, token_rows.shape[1],
        S_BLOCK=s_block, BLOCK_H=block, ZERO_ROWS=ZERO_ROWS, num_warps=warps,
    )  # fmt: skip


def combine_block(hidden: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of ``_combine_tokens_kernel``: its tiles are 1-D, so the row
    config (16-byte loads; :func:`token_block`'s 8 warps for a ``[S_BLOCK, BLOCK_H]`` tile made
    them 8 bytes)."""
    return block_config(hidden)


def combine_tokens(x, token_rows, token_experts, token_count, out, *, probs=None,
                   grad_permuted_probs=None, grad_probs=None) -> None:
    """``out[t] = sum_j w_j * x[token_rows[t, j]]`` with ``w_j = probs[t, token_experts[t, j]]``
    (1 without probs); with ``grad_probs`` (``[T, E]``) also ``grad_probs[t, e_j] =
    grad_permuted_probs[r_j]`` and 0 elsewhere. One launch."""
    tokens, hidden = out.shape
    if tokens == 0:
        return
    num_experts = grad_probs.shape[1] if grad_probs is not None else (
        probs.shape[1] if probs is not None else 1)
    s_block = _s_block(token_rows)
    block, warps = combine_block(hidden)
    cblocks = triton.cdiv(hidden, block) if hidden else (1 if grad_probs is not None else 0)
    if cblocks == 0:
        return
    _combine_tokens_kernel[(tokens, cblocks)](
        x, token_rows, token_experts, token_count,
        probs if probs is not None else x, out,
        grad_permuted_probs if grad_permuted_probs is not None else x,
        grad_probs if grad_probs is not None else out,
        tokens, num_experts, hidden, token_rows.shape[1],
        HAS_PROBS=probs is not None, GRAD_PROBS=grad_probs is not None,
        S_BLOCK=s_block, E_BLOCK=next_power_of_2(num_experts), BLOCK_H=block,
        num_warps=warps,
    )  # fmt: skip


def unpermute_backward(grad, x, token_rows, token_experts, token_count, row_id_map, *,
                       probs=None, grad_x=None, grad_probs=None) -> None:
    """The unpermute backward in one launch: ``grad_x[r_j] = w_j * grad[t]`` (zero rows that
    hold no token) and ``grad_probs[t, e_j] = <x[r_j], grad[t]>`` (fp32, 0 elsewhere)."""
    tokens, hidden = grad.shape
    n = row_id_map.shape[0]
    programs = tokens + (triton.cdiv(n, ZERO_ROWS) if grad_x is not None else 0)
    if programs == 0:
        return
    num_experts = probs.shape[1] if probs is not None else 1
    s_block = _s_block(token_rows)
    block, warps = token_block(hidden, max(s_block, ZERO_ROWS))
    _unpermute_bwd_kernel[(programs,)](
        grad, x, token_rows, token_experts, token_count, row_id_map,
        probs if probs is not None else grad,
        grad_x if grad_x is not None else grad,
        grad_probs if grad_probs is not None else grad,
        tokens, n, num_experts, hidden, token_rows.shape[1],
        HAS_PROBS=probs is not None, NEED_GX=grad_x is not None,
        NEED_GPROBS=grad_probs is not None, S_BLOCK=s_block,
        E_BLOCK=next_power_of_2(num_experts), BLOCK_H=block, ZERO_ROWS=ZERO_ROWS,
        num_warps=warps,
    )  # fmt: skip
