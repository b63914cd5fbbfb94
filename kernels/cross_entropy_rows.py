"""``@triton.jit`` helpers of the cross-entropy kernels, one row of logits at a time.

Shared by the kernels of :mod:`mtp.kernels.cross_entropy` and those of the fused linear
cross-entropy (:mod:`mtp.kernels.linear_cross_entropy`); the notation (``M``, ``S``, ``C``,
``eps``, ``w``) is :mod:`mtp.kernels.cross_entropy`'s. All maths in fp32.

- Addressing and loads: ``_row_offset``, ``_tile``, ``_split``, ``_ragged_cols``. Loads of the
  row are 16-byte vectors whatever ``V`` is: the row is split into a head (up to ``VEC - 1``
  elements before the first 16-byte boundary), unmasked ``BLOCK``-wide aligned tiles, and a
  ragged tile (head + tail, masked). Rows are addressed as
  ``(r // n_inner) * stride_outer + (r % n_inner) * stride_inner``.
- Statistics: ``_accumulate`` (per-lane online max / sum-exp of a ``[NT, VEC]`` tile),
  ``_row_stats`` (``(M, S, sum x)`` in one pass), ``_row_stats_and_target`` (``(m, s, c)``
  with the target term) and ``_store_row_stats``.
- Gradient: ``_softmax_coefs``, ``_grad_tile``, ``_round_to`` (one rounding at the store) and
  ``_row_grad`` (reads the row again and writes ``scale * dloss/dx``).
- Targets and loss: ``_scan_targets`` (valid count, range check, checksum of all targets),
  ``_finish_row`` (a row's loss from its statistics) and ``_reduce_epilogue`` (the last program
  sums the per-program partials).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mtp.kernels._common import interpreting


@triton.jit
def _row_offset(row, n_inner, stride_outer, stride_inner):
    return (row // n_inner) * stride_outer + (row % n_inner) * stride_inner


@triton.jit
def _tile(NT: tl.constexpr, VEC: tl.constexpr):
    return tl.arange(0, NT)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _split(row_off, V, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """``(head, main_start, n_full, tail_start)`` of a row starting at element ``row_off``."""
    head = tl.minimum((VEC - row_off % VEC) % VEC, V)
    main_start = tl.multiple_of(((row_off + VEC - 1) // VEC) * VEC, VEC)
    n_full = (V - head) // BLOCK
    return head, main_start, n_full, head + n_full * BLOCK


@triton.jit
def _ragged_cols(k, head, tail_start, V, flat, BLOCK: tl.constexpr):
    """Columns and mask of ragged tile ``k`` (head columns first, then the tail)."""
    i = k * BLOCK + flat
    cols = tl.where(i < head, i, tail_start + i - head)
    return cols, i < head + (V - tail_start)


@triton.jit
def _accumulate(x, m, s):
    """Per-lane online max / sum-exp over a ``[NT, VEC]`` tile (one rescale per lane)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # lanes of -inf only: keep s = 0
    s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref[:, None]), axis=1)
    return m_new, s


@triton.jit
def _row_stats(logits_ptr, row_off, V, SMOOTHING: tl.constexpr, NT: tl.constexpr,
               VEC: tl.constexpr):
    """``(M, S, sum_x)`` of one row: one pass, one reduction at the end."""
    BLOCK: tl.constexpr = NT * VEC
    flat = _tile(NT, VEC)
    head, main_start, n_full, tail_start = _split(row_off, V, VEC, BLOCK)
    m = tl.full([NT], -float("inf"), tl.float32)
    s = tl.zeros([NT], tl.float32)
    sx = tl.zeros([NT], tl.float32)
    for k in range(0, n_full):
        x = tl.load(logits_ptr + (main_start + k * BLOCK) + flat).to(tl.float32)
        m, s = _accumulate(x, m, s)
        if SMOOTHING:
            sx += tl.sum(x, axis=1)
    for k in range(0, tl.cdiv(head + V - tail_start, BLOCK)):
        cols, mask = _ragged_cols(k, head, tail_start, V, flat, BLOCK)
        x = tl.load(logits_ptr + row_off + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m, s = _accumulate(x, m, s)
        if SMOOTHING:
            sx += tl.sum(tl.where(mask, x, 0.0), axis=1)
    M = tl.max(m, axis=0)
    M_ref = tl.where(M == -float("inf"), 0.0, M)
    S = tl.sum(s * tl.exp(m - M_ref), axis=0)
    return M, S, tl.sum(sx, axis=0)


@triton.jit
def _row_stats_and_target(logits_ptr, row_off, V_local, local_t, coef_target, coef_uniform,
                          SMOOTHING: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr):
    """``(m, s, c)`` of one row: max, ``sum exp(x - m)`` and the target term
    ``c = coef_target * x[local_t] + coef_uniform * sum(x)`` (``x[local_t]`` is 0 when
    ``local_t`` is not a column of this shard)."""
    m, s, sum_x = _row_stats(logits_ptr, row_off, V_local, SMOOTHING, NT, VEC)
    owns = (local_t >= 0) & (local_t < V_local)
    x_t = tl.load(logits_ptr + row_off + tl.where(owns, local_t, 0), mask=owns, other=0.0)
    c = coef_target * x_t.to(tl.float32)
    if SMOOTHING:
        c += coef_uniform * sum_x
    return m, s, c


@triton.jit
def _store_row_stats(logits_ptr, row_off, V_local, local_t, coef_target, coef_uniform, out_ptr,
                     SMOOTHING: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr):
    """Store :func:`_row_stats_and_target` of one row at ``out_ptr`` (3 fp32)."""
    m, s, c = _row_stats_and_target(logits_ptr, row_off, V_local, local_t, coef_target,
                                    coef_uniform, SMOOTHING, NT, VEC)  # fmt: skip
    tl.store(out_ptr, m)
    tl.store(out_ptr + 1, s)
    tl.store(out_ptr + 2, c)


@triton.jit
def _grad_tile(x, hit, m_ref, a, coef_target, coef_uniform, scale):
    # softmax * factor = exp(x - m_ref) * a (see _row_grad); ``hit``: the target's column
    g = tl.exp(x - m_ref) * a - coef_uniform
    g = g - tl.where(hit, coef_target, 0.0)
    return g * scale


@triton.jit
def _softmax_coefs(m, log_s, factor):
    """``(m_ref, factor / s)`` of a row from its max ``m`` and ``log_s = log(sum exp(x -
    m_ref))``: ``exp(-log_s)`` rather than a division, which makes sm_90a spill here."""
    return tl.where(m == -float("inf"), 0.0, m), factor * tl.exp(-log_s)


_BF16_RNE_BY_HAND = tl.constexpr(interpreting())


@triton.jit
def _round_to(g, out_ty: tl.constexpr):
    """fp32 ``g`` in ``out_ty``, rounded to nearest even: the cast on the GPU
    (``cvt.rn.bf16.f32``); under the interpreter, whose bf16 cast truncates (twice the error),
    bf16 is rounded on the bits by hand (NaN stays NaN)."""
    if _BF16_RNE_BY_HAND and out_ty == tl.bfloat16:
        bits = g.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(g == g, rounded, g.to(tl.bfloat16))
    else:
        return g.to(out_ty)


@triton.jit
def _row_grad(logits_ptr, grad_ptr, row_off, g_row_off, V, local_t, m_ref, a, coef_target,
              coef_uniform, scale, SAME_LAYOUT: tl.constexpr, NT: tl.constexpr,
              VEC: tl.constexpr):
    """Write ``scale * dloss/dx`` of one row (reads the row again), rounded once at the store;
    ``softmax * factor = exp(x - m_ref) * a`` with ``(m_ref, a) = (max, factor / sum)``
    (:func:`_softmax_coefs`): PyTorch's order, so the gradient keeps PyTorch's precision at large
    logits (``exp(x - lse)`` would carry ``lse``'s rounding, ulp(lse), into every element)."""
    BLOCK: tl.constexpr = NT * VEC
    flat = _tile(NT, VEC)
    head, main_start, n_full, tail_start = _split(row_off, V, VEC, BLOCK)
    if SAME_LAYOUT:
        g_main = main_start
    else:
        g_main = g_row_off + head
    out_ty = grad_ptr.dtype.element_ty
    # the target's offset inside full tile k as one int32 scalar (-1: not in that tile), so the
    # loop compares int32 offsets, not a tile of int64 columns (triton 3.6: 237 -> ... registers)
    t_main = local_t - head
    for k in range(0, n_full):
        x = tl.load(logits_ptr + (main_start + k * BLOCK) + flat).to(tl.float32)
        t_k = t_main - k * BLOCK
        t_k = tl.where((t_k >= 0) & (t_k < BLOCK), t_k, -1).to(tl.int32)
        g = _grad_tile(x, flat == t_k, m_ref, a, coef_target, coef_uniform, scale)
        tl.store(grad_ptr + (g_main + k * BLOCK) + flat, _round_to(g, out_ty))
    for k in range(0, tl.cdiv(head + V - tail_start, BLOCK)):
        cols, mask = _ragged_cols(k, head, tail_start, V, flat, BLOCK)
        x = tl.load(logits_ptr + row_off + cols, mask=mask, other=0.0).to(tl.float32)
        g = _grad_tile(x, cols == local_t, m_ref, a, coef_target, coef_uniform, scale)
        tl.store(grad_ptr + g_row_off + cols, _round_to(g, out_ty), mask=mask)


@triton.jit
def _scan_targets(target_ptr, n_rows, ignore_index, vocab_size, CHECKSUM: tl.constexpr):
    """``(valid count, out-of-range count, checksum)`` of all targets (one program)."""
    n_valid = tl.full([], 0, tl.int32)
    n_bad = tl.full([], 0, tl.int32)
    checksum = tl.full([], 0, tl.int64)
    for start in range(0, n_rows, 1024):
        i = start + tl.arange(0, 1024)
        inside = i < n_rows
        t = tl.load(target_ptr + i, mask=inside, other=ignore_index).to(tl.int64)
        valid = (t != ignore_index) & inside
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        n_bad += tl.sum((valid & ((t < 0) | (t >= vocab_size))).to(tl.int32), axis=0)
        if CHECKSUM:
            checksum += tl.sum(tl.where(inside, (t + 1) * (2 * i.to(tl.int64) + 1), 0), axis=0)
    return n_valid, n_bad, checksum


@triton.jit
def _finish_row(m, log_s, c, valid, z_loss_weight):
    lse = m + log_s
    loss = (m - c) + log_s + z_loss_weight * lse * lse
    return tl.where(valid, loss, 0.0), lse


@triton.jit
def _reduce_epilogue(loss_ptr, partial_ptr, counter_ptr, pid, n_programs, partial, denom,
                     target_ptr, n_rows, ignore_index, V, SCAN: tl.constexpr,
                     MAX_G: tl.constexpr):
    """The last program to finish sums the per-program partials (in program order); with
    ``SCAN`` it counts the valid targets itself (a mean whose programs did not need it)."""
    tl.store(partial_ptr + pid, partial)
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == n_programs - 1:
        idx = tl.arange(0, MAX_G)
        parts = tl.load(partial_ptr + idx, mask=idx < n_programs, other=0.0, volatile=True)
        total = tl.sum(parts, axis=0)
        if SCAN:
            n_valid, _, _ = _scan_targets(target_ptr, n_rows, ignore_index, V, False)
            total = total / n_valid.to(tl.float32)
        else:
            total = total / denom
        tl.store(loss_ptr, total)
        tl.atomic_xchg(counter_ptr, 0, sem="acq_rel")
