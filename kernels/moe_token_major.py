"""MoE token-major kernels: the permute forward, the unpermute and both backwards (Triton).

Each kernel takes the token-major map of :mod:`mtp.kernels.moe_row_map` (``token_count[t]``
rows ``token_rows[t, :count]``, experts ``token_experts[t, :count]``, ascending; ``[T, S]``
int32, contiguous or with its slots ``SLOT`` elements apart) and works on a ``[rows of a
token, BLOCK_H]`` tile, so that all index loads of a token are issued before its data loads:

- :func:`scatter_tokens`: each token row is read once and written to its rows; extra programs
  zero the rows that hold no token. The permute forward.
- :func:`combine_tokens`: ``out[t] = sum_j probs[t, e_j] * x[r_j]`` in fp32 (fixed order,
  deterministic), optionally the ``[T, E]`` gradient of the permuted probabilities (given per
  row, or as per-row partial sums added in a fixed order). The unpermute forward, the permute
  backward and the backward of an expert GEMM that read its rows through the map.
- :func:`unpermute_backward`: each token reads its output gradient once and writes its rows'
  gradients and its probs gradient (the dots ``<x[r_j], grad[t]>``).

All address arithmetic is int64. The launchers take contiguous data tensors and preallocated
outputs, keep one :class:`~mtp.kernels._launch.Launch` per key and do no autograd.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2
from mtp.kernels._launch import Launch, Plans, aligned
from mtp.kernels.moe_permute import block_config

__all__ = ["combine_tokens", "run_scatter", "scatter_plan", "scatter_tokens", "unpermute_backward"]

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
    T, E, hidden, S, parts, part_stride,
    HAS_PROBS: tl.constexpr, GRAD_PROBS: tl.constexpr, S_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, SLOT: tl.constexpr = 1,
):
    # out[t] = sum_j probs[t, e_j] * x[r_j] (fp32, fixed order); with GRAD_PROBS also
    # gprobs[t, e] = sum_q gpp[q, r_j] where e == e_j (``parts`` partials, in order), 0
    # elsewhere (the permute backward: one part).
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
            row = tl.load(trows_ptr + t * S + j * SLOT, mask=ok, other=0).to(tl.int64)
            vmask = cols < tl.where(ok, hidden, 0)  # cmask, or nothing past the count
            v = tl.load(x_ptr + row * hidden + cols, mask=vmask, other=0.0).to(tl.float32)
            if HAS_PROBS or GRAD_PROBS:
                e_j = tl.load(texp_ptr + t * S + j * SLOT, mask=ok, other=0)
            if HAS_PROBS:
                v = v * tl.load(probs_ptr + t * E + e_j, mask=ok, other=0.0).to(tl.float32)
            acc += v
            if GRAD_PROBS:
                gok = j < g_cnt
                g = tl.load(gpp_ptr + row, mask=gok, other=0.0).to(tl.float32)
                for q in range(1, parts):
                    g += tl.load(gpp_ptr + q * part_stride + row, mask=gok, other=0.0)
                tl.store(gprobs_ptr + t * E + e_j, g, mask=gok)
        j0 += S_BLOCK
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _unpermute_bwd_kernel(
    g_ptr, x_ptr, trows_ptr, texp_ptr, tcount_ptr, row_id_ptr, probs_ptr, gx_ptr, gprobs_ptr,
    T, N, E, hidden, S,
    HAS_PROBS: tl.constexpr, NEED_GX: tl.constexpr, NEED_GPROBS: tl.constexpr,
    S_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr, SLOT: tl.constexpr = 1,
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
            rows = tl.load(trows_ptr + t * S + js * SLOT, mask=jmask, other=0).to(tl.int64)
            exps = tl.load(texp_ptr + t * S + js * SLOT, mask=jmask, other=0)
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

_PLANS = Plans()


def _s_block(width: int) -> int:
    return min(next_power_of_2(max(width, 1)), MAX_S_BLOCK)


def scatter_tokens(x, token_rows, token_count, row_id_map, out, *, zero_empty: bool) -> None:
    """``out[token_rows[t, j]] = x[t]`` for ``j < token_count[t]``; with ``zero_empty`` also
    ``out[r] = 0`` where ``row_id_map[r] < 0``. One launch."""
    tokens, hidden = x.shape
    n, width = out.shape[0], token_rows.shape[1]
    key = ("scatter", tokens, hidden, n, width, x.dtype, out.dtype, zero_empty,
           aligned(x, token_rows, token_count, row_id_map, out), x.device)
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.add(key, scatter_plan(x, token_rows, token_count, row_id_map, out,
                                              zero_empty))  # fmt: skip
    if launch is not None:
        run_scatter(launch, x, token_rows, token_count, row_id_map, out)


def run_scatter(launch, x, token_rows, token_count, row_id_map, out) -> None:
    """Run a :func:`scatter_plan` launch on the arguments it was made for."""
    launch(x, token_rows, token_count, row_id_map, out, x.shape[0], out.shape[0], x.shape[1],
           token_rows.shape[1])


def scatter_plan(x, token_rows, token_count, row_id_map, out, zero_empty) -> Launch | None:
    """The launch of :func:`scatter_tokens` for arguments like these (None: nothing to do)."""
    tokens, hidden = x.shape
    n, width = out.shape[0], token_rows.shape[1]
    programs = tokens + (triton.cdiv(n, ZERO_ROWS) if zero_empty else 0)
    if programs == 0 or hidden == 0:
        return None
    s_block = _s_block(width)
    block, warps = token_block(hidden, max(s_block, ZERO_ROWS))
    args = (x, token_rows, token_count, row_id_map, out, tokens, n, hidden, width)
    return Launch(_scatter_tokens_kernel, (programs, triton.cdiv(hidden, block)), args,
                  dict(S_BLOCK=s_block, BLOCK_H=block, ZERO_ROWS=ZERO_ROWS, num_warps=warps))


def combine_block(hidden: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of ``_combine_tokens_kernel``: its tiles are 1-D, so the row
    config (16-byte loads; :func:`token_block`'s 8 warps for a ``[S_BLOCK, BLOCK_H]`` tile made
    them 8 bytes)."""
    return block_config(hidden)


def combine_tokens(x, token_rows, token_experts, token_count, out, *, probs=None,
                   grad_permuted_probs=None, grad_probs=None) -> None:
    """``out[t] = sum_j w_j * x[token_rows[t, j]]`` with ``w_j = probs[t, token_experts[t, j]]``
    (1 without probs); with ``grad_probs`` (``[T, E]``) also ``grad_probs[t, e_j] =
    grad_permuted_probs[r_j]`` and 0 elsewhere (``grad_permuted_probs`` ``[N]``, or ``[P, N]``
    contiguous partial sums, added in order in fp32). One launch."""
    tokens, hidden = out.shape
    num_experts = grad_probs.shape[1] if grad_probs is not None else (
        probs.shape[1] if probs is not None else 1)
    stride, slot = token_rows.stride()
    gpp = grad_permuted_probs
    parts = 1 if gpp is None or gpp.dim() == 1 else gpp.shape[0]
    part_stride = 0 if gpp is None else gpp.shape[-1]
    key = ("combine", tokens, hidden, num_experts, token_rows.shape[1], stride, slot, x.dtype,
           out.dtype, None if probs is None else probs.dtype, None if gpp is None else gpp.dtype,
           None if grad_probs is None else grad_probs.dtype, None if gpp is None else gpp.shape,
           aligned(x, token_rows, token_experts, token_count, probs, out, gpp, grad_probs),
           x.device)  # fmt: skip
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.add(key, _combine_plan(x, token_rows, token_experts, token_count, out,
                                               probs, gpp, grad_probs))  # fmt: skip
    if launch is not None:
        launch(x, token_rows, token_experts, token_count, probs if probs is not None else x, out,
               gpp if gpp is not None else x, grad_probs if grad_probs is not None else out,
               tokens, num_experts, hidden, stride, parts, part_stride)  # fmt: skip


def _combine_plan(x, token_rows, token_experts, token_count, out, probs, gpp, grad_probs):
    tokens, hidden = out.shape
    if tokens == 0:
        return None
    num_experts = grad_probs.shape[1] if grad_probs is not None else (
        probs.shape[1] if probs is not None else 1)
    _check_strides(token_rows, token_experts)
    block, warps = combine_block(hidden)
    cblocks = triton.cdiv(hidden, block) if hidden else (1 if grad_probs is not None else 0)
    if cblocks == 0:
        return None
    parts = 1 if gpp is None or gpp.dim() == 1 else gpp.shape[0]
    args = (x, token_rows, token_experts, token_count, probs if probs is not None else x, out,
            gpp if gpp is not None else x, grad_probs if grad_probs is not None else out,
            tokens, num_experts, hidden, token_rows.stride(0), parts,
            0 if gpp is None else gpp.shape[-1])
    return Launch(_combine_tokens_kernel, (tokens, cblocks), args, dict(
        HAS_PROBS=probs is not None, GRAD_PROBS=grad_probs is not None,
        S_BLOCK=_s_block(token_rows.shape[1]), E_BLOCK=next_power_of_2(num_experts),
        BLOCK_H=block, SLOT=token_rows.stride(1), num_warps=warps))  # fmt: skip


def unpermute_backward(grad, x, token_rows, token_experts, token_count, row_id_map, *,
                       probs=None, grad_x=None, grad_probs=None) -> None:
    """The unpermute backward in one launch: ``grad_x[r_j] = w_j * grad[t]`` (zero rows that
    hold no token) and ``grad_probs[t, e_j] = <x[r_j], grad[t]>`` (fp32, 0 elsewhere)."""
    tokens, hidden = grad.shape
    n = row_id_map.shape[0]
    num_experts = probs.shape[1] if probs is not None else 1
    stride, slot = token_rows.stride()
    key = ("unpermute_bwd", tokens, hidden, n, num_experts, token_rows.shape[1], stride, slot,
           grad.dtype, x.dtype, None if probs is None else probs.dtype,
           None if grad_x is None else grad_x.dtype,
           None if grad_probs is None else grad_probs.dtype,
           aligned(grad, x, token_rows, token_experts, token_count, row_id_map, probs, grad_x,
                   grad_probs), grad.device)  # fmt: skip
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.add(key, _unpermute_bwd_plan(grad, x, token_rows, token_experts,
                                                     token_count, row_id_map, probs, grad_x,
                                                     grad_probs))  # fmt: skip
    if launch is not None:
        launch(grad, x, token_rows, token_experts, token_count, row_id_map,
               probs if probs is not None else grad, grad_x if grad_x is not None else grad,
               grad_probs if grad_probs is not None else grad,
               tokens, n, num_experts, hidden, stride)  # fmt: skip


def _unpermute_bwd_plan(grad, x, token_rows, token_experts, token_count, row_id_map, probs,
                        grad_x, grad_probs):
    tokens, hidden = grad.shape
    n = row_id_map.shape[0]
    programs = tokens + (triton.cdiv(n, ZERO_ROWS) if grad_x is not None else 0)
    if programs == 0:
        return None
    _check_strides(token_rows, token_experts)
    num_experts = probs.shape[1] if probs is not None else 1
    s_block = _s_block(token_rows.shape[1])
    block, warps = token_block(hidden, max(s_block, ZERO_ROWS))
    args = (grad, x, token_rows, token_experts, token_count, row_id_map,
            probs if probs is not None else grad, grad_x if grad_x is not None else grad,
            grad_probs if grad_probs is not None else grad,
            tokens, n, num_experts, hidden, token_rows.stride(0))
    return Launch(_unpermute_bwd_kernel, (programs,), args, dict(
        HAS_PROBS=probs is not None, NEED_GX=grad_x is not None,
        NEED_GPROBS=grad_probs is not None, S_BLOCK=s_block,
        E_BLOCK=next_power_of_2(num_experts), BLOCK_H=block, ZERO_ROWS=ZERO_ROWS,
        SLOT=token_rows.stride(1), num_warps=warps))  # fmt: skip


def _check_strides(token_rows, token_experts) -> None:
    if token_rows.stride() != token_experts.stride():
        raise ValueError(
            f"token_rows and token_experts must share their strides, got {token_rows.stride()} "
            f"and {token_experts.stride()}"
        )
