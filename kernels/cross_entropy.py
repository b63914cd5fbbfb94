"""Fused (vocab-parallel) cross-entropy: the gradient is written while the logits are read.

Notation per row: ``x`` the logits of this rank's vocab shard ``[vocab_start, vocab_start+Vl)``,
``t`` the global target id, ``V`` the global vocab size, ``eps`` the label smoothing and ``w`` the
z-loss weight. Global ``lse = M + log(S)`` with ``M`` the max logit and ``S = sum exp(x - M)``.
The loss is ``F.cross_entropy(full_logits, t, label_smoothing=eps) + w * lse**2``:

    loss = (M - C) + log(S) + w * lse**2,   C = (1 - eps) * x[t] + (eps / V) * sum(x)
    dloss/dx = softmax(x) * (1 + 2 w lse) - eps / V - (1 - eps) * onehot(t)

Kernels (fp32 math; logits fp32 / fp16 / bf16; targets int32 / int64), one program per row
(programs loop over rows ``pid, pid + G, ...`` when there are more than ``MAX_PROGRAMS``):

- ``_ce_fused_kernel`` (one rank): pass 1 reads the row once with a per-lane running max and
  sum-exp (``[NT, VEC]`` tiles: the max of a lane's ``VEC`` elements, then one rescale per lane)
  and a single reduction at the end of the row; then, when ``GRAD``, the same program reads the
  row again (an L2 hit on a GPU) and writes ``scale * dloss/dx`` (``scale`` = ``1/N`` for
  ``reduction="mean"``, 1 otherwise; 0 for ignored rows). With ``REDUCE`` the per-program loss
  partials are summed by the last program to finish (a counter that resets itself), so
  ``sum`` / ``mean`` need no other launch.
- ``_ce_stats_kernel`` (tp > 1, pass 1): the row statistics ``(m, s, c)`` for the all-gather,
  plus two metadata rows (shard size, valid-target count, target checksum, range check, rows)
  so that the same all-gather tells every rank what the others saw.
- ``_ce_finish_kernel`` (tp > 1, pass 2): combines the gathered statistics into the loss, checks
  the metadata (program 0 writes ``info``), and when ``GRAD`` reads the shard again to write the
  gradient.
- ``_ce_scale_kernel`` (backward): ``grad *= dloss`` per row; a row whose ``dloss`` is 1
  is skipped (the usual ``loss.backward()`` of a sum or mean moves no data).

Loads of the row are 16-byte vectors whatever ``V`` is: the row is split into a head (up to
``VEC - 1`` elements before the first 16-byte boundary), unmasked ``BLOCK``-wide aligned tiles,
and a ragged tile (head + tail, masked). Rows are addressed as
``(r // n_inner) * stride_outer + (r % n_inner) * stride_inner``, which covers logits whose
leading dims are non-contiguous (a slice or a transpose of ``[b, s, v]``) without a copy. The
``@triton.jit`` helpers the kernels share (row loads and statistics, the gradient of a row, the
target scan, the reduction epilogue) are in :mod:`mtp.kernels.cross_entropy_rows`.

``info`` (int32 ``[world + 1, 4]``): row ``r``: ``(shard size, valid targets, target checksum,
targets in range)`` of rank ``r``; row ``world``: ``(all ok, 0, 0, 0)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import interpreting, next_power_of_2
from mtp.kernels._launch import Plans, aligned
from mtp.kernels.cross_entropy_rows import (
    _finish_row,
    _reduce_epilogue,
    _row_grad,
    _row_offset,
    _row_stats_and_target,
    _scan_targets,
    _softmax_coefs,
    _store_row_stats,
)

#: fp32 values per row that each rank contributes to the all-gather: ``(m, s, c)``; the
#: statistics buffer has two more rows of metadata (int32 bits).
NUM_STATS = 3
META_ROWS = 2
INFO_COLS = 4  # (literal 4 inside the kernels)
#: Bytes per vector load: 16 (``LDG.E.128``).
VECTOR_BYTES = 16
#: Lanes (rows of the ``[NT, VEC]`` tile) per tile and warps per program.
LANES = 512
NUM_WARPS = 8
#: Register cap of the kernels that write the gradient (``maxnreg``): two programs of 8 warps
#: per SM. Uncapped, triton 3.9 gives the no-reduce variants 190 registers (one program per SM);
#: capped, neither 3.6 (113-115 uncapped) nor 3.9 spills.
GRAD_MAX_REGISTERS = 128
#: Most programs of a launch (programs loop over rows beyond it).
MAX_PROGRAMS = 1024
#: Elements per program of the backward scale kernel.
SCALE_BLOCK = 4096
#: Targets per iteration of the target scan, and the padded world size for the metadata check.
TARGET_BLOCK = 1024


@triton.jit
def _ce_fused_kernel(
    logits_ptr, grad_ptr, target_ptr, loss_ptr, partial_ptr, counter_ptr, info_ptr,
    n_rows, n_inner, stride_outer, stride_inner, g_n_inner, g_stride_outer, g_stride_inner,
    V, ignore_index, coef_target, coef_uniform, z_loss_weight,
    SMOOTHING: tl.constexpr, GRAD: tl.constexpr, REDUCE: tl.constexpr, MEAN: tl.constexpr,
    CHECK: tl.constexpr, SAME_LAYOUT: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr,
    MAX_G: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    denom = 1.0
    if MEAN and GRAD:  # every program scales its gradient rows by 1 / N
        n_valid, _, _ = _scan_targets(target_ptr, n_rows, ignore_index, V, False)
        denom = n_valid.to(tl.float32)
    if CHECK:
        if pid == 0:  # info: the range check of all targets (a second scan is a cache hit)
            n_valid0, n_bad, _ = _scan_targets(target_ptr, n_rows, ignore_index, V, False)
            tl.store(info_ptr + 0, V)
            tl.store(info_ptr + 1, n_valid0)
            tl.store(info_ptr + 2, 0)
            tl.store(info_ptr + 3, (n_bad == 0).to(tl.int32))
            tl.store(info_ptr + 4, (n_bad == 0).to(tl.int32))
    scale = tl.where(denom > 0, 1.0 / denom, 0.0)
    partial = 0.0
    for row32 in range(pid, n_rows, n_programs):
        row = row32 * tl.full([], 1, tl.int64)
        row_off = _row_offset(row, n_inner, stride_outer, stride_inner)
        target = tl.load(target_ptr + row).to(tl.int64)
        valid = target != ignore_index
        M, S, c = _row_stats_and_target(logits_ptr, row_off, V, target, coef_target,
                                        coef_uniform, SMOOTHING, NT, VEC)  # fmt: skip
        log_s = tl.log(S)
        loss, lse = _finish_row(M, log_s, c, valid, z_loss_weight)
        if REDUCE:
            partial += loss
        else:
            tl.store(loss_ptr + row, loss)
        if GRAD:
            g_row_off = _row_offset(row, g_n_inner, g_stride_outer, g_stride_inner)
            m_ref, a = _softmax_coefs(M, log_s, 1.0 + 2.0 * z_loss_weight * lse)
            _row_grad(logits_ptr, grad_ptr, row_off, g_row_off, V, target, m_ref, a,
                      coef_target, coef_uniform, tl.where(valid, scale, 0.0), SAME_LAYOUT, NT,
                      VEC)  # fmt: skip
    if REDUCE:
        _reduce_epilogue(loss_ptr, partial_ptr, counter_ptr, pid, n_programs, partial, denom,
                         target_ptr, n_rows, ignore_index, V, MEAN and not GRAD, MAX_G)


@triton.jit
def _ce_stats_kernel(
    logits_ptr, target_ptr, stats_ptr, n_rows, n_inner, stride_outer, stride_inner,
    V_local, vocab_start, vocab_size, ignore_index, coef_target, coef_uniform,
    SMOOTHING: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    if pid == 0:  # metadata: what this rank saw, for every rank to compare after the gather
        n_valid, n_bad, checksum = _scan_targets(target_ptr, n_rows, ignore_index, vocab_size,
                                                 True)
        folded = (checksum ^ (checksum >> 32)) & 0xFFFFFFFF
        meta = stats_ptr + 3 * n_rows.to(tl.int64)
        tl.store(meta + 0, V_local.to(tl.int32).to(tl.float32, bitcast=True))
        tl.store(meta + 1, n_valid.to(tl.int32).to(tl.float32, bitcast=True))
        tl.store(meta + 2, folded.to(tl.int32).to(tl.float32, bitcast=True))
        tl.store(meta + 3, (n_bad == 0).to(tl.int32).to(tl.float32, bitcast=True))
        tl.store(meta + 4, n_rows.to(tl.int32).to(tl.float32, bitcast=True))
        tl.store(meta + 5, tl.zeros([], tl.int32).to(tl.float32, bitcast=True))
    for row32 in range(pid, n_rows, n_programs):
        row = row32 * tl.full([], 1, tl.int64)
        row_off = _row_offset(row, n_inner, stride_outer, stride_inner)
        local_t = tl.load(target_ptr + row).to(tl.int64) - vocab_start
        _store_row_stats(logits_ptr, row_off, V_local, local_t, coef_target, coef_uniform,
                         stats_ptr + 3 * row, SMOOTHING, NT, VEC)  # fmt: skip



@triton.jit
def _ce_finish_kernel(
    gathered_ptr, logits_ptr, grad_ptr, target_ptr, loss_ptr, partial_ptr, counter_ptr,
    info_ptr, n_rows, world, rank, n_inner, stride_outer, stride_inner, g_n_inner,
    g_stride_outer, g_stride_inner, V_local, vocab_start, ignore_index, coef_target,
    coef_uniform, z_loss_weight,
    GRAD: tl.constexpr, REDUCE: tl.constexpr, MEAN: tl.constexpr, SAME_LAYOUT: tl.constexpr,
    NT: tl.constexpr, VEC: tl.constexpr, MAX_G: tl.constexpr, WB: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    per_rank = 3 * (n_rows.to(tl.int64) + 2)
    meta = gathered_ptr + 3 * n_rows.to(tl.int64)
    denom = 1.0
    if MEAN:
        own_meta = meta + rank * per_rank
        denom = tl.load(own_meta + 1).to(tl.int32, bitcast=True).to(tl.float32)
    if pid == 0:
        r = tl.arange(0, WB)
        there = r < world
        at = meta + r * per_rank
        size = tl.load(at, mask=there, other=0.0).to(tl.int32, bitcast=True)
        n_valid = tl.load(at + 1, mask=there, other=0.0).to(tl.int32, bitcast=True)
        checksum = tl.load(at + 2, mask=there, other=0.0).to(tl.int32, bitcast=True)
        in_range = tl.load(at + 3, mask=there, other=0.0).to(tl.int32, bitcast=True)
        own_size = tl.sum(tl.where(r == rank, size, 0), axis=0)
        own_checksum = tl.sum(tl.where(r == rank, checksum, 0), axis=0)
        bad = there & ((size != own_size) | (checksum != own_checksum) | (in_range == 0))
        tl.store(info_ptr + r * 4, size, mask=there)
        tl.store(info_ptr + r * 4 + 1, n_valid, mask=there)
        tl.store(info_ptr + r * 4 + 2, checksum, mask=there)
        tl.store(info_ptr + r * 4 + 3, in_range, mask=there)
        tl.store(info_ptr + world * 4, (tl.sum(bad.to(tl.int32), axis=0) == 0).to(tl.int32))
    scale = tl.where(denom > 0, 1.0 / denom, 0.0)
    partial = 0.0
    for row32 in range(pid, n_rows, n_programs):
        row = row32 * tl.full([], 1, tl.int64)
        m = -float("inf")
        for r in range(0, world):
            m = tl.maximum(m, tl.load(gathered_ptr + r * per_rank + 3 * row))
        m_ref = tl.where(m == -float("inf"), 0.0, m)
        s = 0.0
        c = 0.0
        for r in range(0, world):
            at = gathered_ptr + r * per_rank + 3 * row
            s += tl.load(at + 1) * tl.exp(tl.load(at) - m_ref)
            c += tl.load(at + 2)
        target = tl.load(target_ptr + row).to(tl.int64)
        valid = target != ignore_index
        log_s = tl.log(s)
        loss, lse = _finish_row(m, log_s, c, valid, z_loss_weight)
        if REDUCE:
            partial += loss
        else:
            tl.store(loss_ptr + row, loss)
        if GRAD:
            row_off = _row_offset(row, n_inner, stride_outer, stride_inner)
            g_row_off = _row_offset(row, g_n_inner, g_stride_outer, g_stride_inner)
            m_ref, a = _softmax_coefs(m, log_s, 1.0 + 2.0 * z_loss_weight * lse)
            _row_grad(logits_ptr, grad_ptr, row_off, g_row_off, V_local, target - vocab_start,
                      m_ref, a, coef_target, coef_uniform, tl.where(valid, scale, 0.0),
                      SAME_LAYOUT, NT, VEC)  # fmt: skip
    if REDUCE:
        _reduce_epilogue(loss_ptr, partial_ptr, counter_ptr, pid, n_programs, partial, denom,
                         target_ptr, n_rows, ignore_index, 0, False, MAX_G)


@triton.jit
def _ce_scale_kernel(grad_ptr, dloss_ptr, dloss_stride, n_rows, n_inner, stride_outer,
                     stride_inner, V, BLOCK: tl.constexpr):
    """``grad[row] *= dloss[row]``, programs striding over the rows; a row whose ``dloss`` is 1
    moves no data (one load of ``dloss`` per row: with a mean or sum loss the whole launch
    reads ``R`` floats, where a program per row and column block spent 160 us on the H200
    launching 262,144 programs that all returned at once)."""
    pid = tl.program_id(0)
    for row32 in range(pid, n_rows, tl.num_programs(0)):
        row = row32 * tl.full([], 1, tl.int64)
        d = tl.load(dloss_ptr + row * dloss_stride).to(tl.float32)
        if d != 1.0:
            base = grad_ptr + _row_offset(row, n_inner, stride_outer, stride_inner)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < V
                g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(base + cols, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def row_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(n_inner, stride_outer, stride_inner)`` addressing the rows of ``t`` ``[..., V]``.

    Leading dims are merged where their strides allow; None when more than two strided leading
    dims remain (the caller then makes a contiguous copy). ``t.stride(-1)`` must be 1.
    """
    if t.dim() == 2:  # the common case, decided at once
        rows = t.shape[0]
        return (rows, 0, t.stride(0)) if rows != 1 else (1, 0, 0)
    merged: list[list[int]] = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if not merged:
        return 1, 0, 0
    if len(merged) == 1:
        return merged[0][0], 0, merged[0][1]
    if len(merged) == 2:
        return merged[1][0], merged[0][1], merged[1][1]
    return None


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte load of ``dtype`` (4 for fp32, 8 for fp16 / bf16)."""
    return VECTOR_BYTES // dtype.itemsize


def num_programs(rows: int) -> int:
    """Programs of a forward launch over ``rows`` rows (at least one: it writes the reduction)."""
    return max(1, min(rows, MAX_PROGRAMS))


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_PLANS = Plans()


def reduction_counter(device: torch.device) -> torch.Tensor:
    """The int32 counter of the last-program reduction on ``device`` (zero between launches:
    the last program resets it). Allocated once per device. Calls on concurrent streams of one
    device must not overlap (they would share it)."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros((), dtype=torch.int32, device=device)
    return counter


def _coefs(label_smoothing: float, vocab_size: int) -> tuple[float, float]:
    return 1.0 - label_smoothing, label_smoothing / vocab_size


def _reduce_buffers(loss, reduction, rows, device):
    g = num_programs(rows)
    if reduction == "none":
        return loss, loss, g
    return torch.empty((g,), dtype=torch.float32, device=device), reduction_counter(device), g


def _register_cap(grad: bool) -> dict:
    """The ``maxnreg`` launch option of a gradient-writing launch (none under the interpreter,
    which has no registers)."""
    return {"maxnreg": GRAD_MAX_REGISTERS} if grad and not interpreting() else {}


def cross_entropy_fused(
    logits: torch.Tensor,
    layout: tuple[int, int, int],
    target: torch.Tensor,
    loss: torch.Tensor,
    info: torch.Tensor,
    *,
    grad: torch.Tensor | None,
    grad_layout: tuple[int, int, int] | None,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    reduction: str,
    check: bool,
) -> None:
    """One rank: loss (``[R]`` fp32, or a 0-d sum / mean) and, if ``grad`` is given, the
    gradient of the (reduced) loss written into ``grad`` (may be ``logits`` itself).

    ``target`` is ``[R]`` contiguous int32/int64; ``info`` int32 ``[2, 4]`` (written when
    ``check``). One launch.
    """
    rows, vocab = target.numel(), logits.shape[-1]
    partial, counter, g = _reduce_buffers(loss, reduction, rows, logits.device)
    coef_target, coef_uniform = _coefs(label_smoothing, vocab)
    g_arg = grad if grad is not None else logits
    g_layout = grad_layout or layout
    args = (logits, g_arg, target, loss, partial, counter, info, rows, *layout, *g_layout, vocab,
            ignore_index, coef_target, coef_uniform, z_loss_weight)
    key = ("fused", rows, layout, g_layout, vocab, ignore_index, logits.dtype, g_arg.dtype,
           target.dtype, label_smoothing > 0.0, grad is not None, reduction, check,
           aligned(logits, g_arg, target, loss, partial, counter, info), logits.device)
    _PLANS.run(key, _ce_fused_kernel, (g,), args, lambda: dict(
        SMOOTHING=label_smoothing > 0.0, GRAD=grad is not None, REDUCE=reduction != "none",
        MEAN=reduction == "mean", CHECK=check, SAME_LAYOUT=grad_layout in (None, layout),
        NT=LANES, VEC=vector_width(logits.dtype), MAX_G=next_power_of_2(g),
        num_warps=NUM_WARPS, **_register_cap(grad is not None),
    ))  # fmt: skip


def cross_entropy_stats(
    logits: torch.Tensor,
    layout: tuple[int, int, int],
    target: torch.Tensor,
    stats: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
    ignore_index: int,
) -> None:
    """tp > 1, pass 1: ``stats`` fp32 ``[R + 2, 3]``: ``(m, s, c)`` per row and the metadata."""
    rows = target.numel()
    coef_target, coef_uniform = _coefs(label_smoothing, vocab_size)
    args = (logits, target, stats, rows, *layout, logits.shape[-1], vocab_start, vocab_size,
            ignore_index, coef_target, coef_uniform)
    key = ("stats", rows, layout, logits.shape[-1], vocab_start, vocab_size, ignore_index,
           logits.dtype, target.dtype, label_smoothing > 0.0, aligned(logits, target, stats),
           logits.device)
    _PLANS.run(key, _ce_stats_kernel, (num_programs(rows),), args, lambda: dict(
        SMOOTHING=label_smoothing > 0.0, NT=LANES, VEC=vector_width(logits.dtype),
        num_warps=NUM_WARPS,
    ))  # fmt: skip


def cross_entropy_finish(
    gathered: torch.Tensor,
    logits: torch.Tensor,
    layout: tuple[int, int, int],
    target: torch.Tensor,
    loss: torch.Tensor,
    info: torch.Tensor,
    *,
    rank: int,
    grad: torch.Tensor | None,
    grad_layout: tuple[int, int, int] | None,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    reduction: str,
) -> None:
    """tp > 1, pass 2: loss from the gathered ``[world, R + 2, 3]`` statistics, ``info``
    (int32 ``[world + 1, 4]``), and the gradient of this rank's shard when ``grad`` is given."""
    world, rows = gathered.shape[0], target.numel()
    partial, counter, g = _reduce_buffers(loss, reduction, rows, logits.device)
    coef_target, coef_uniform = _coefs(label_smoothing, vocab_size)
    g_arg = grad if grad is not None else logits
    g_layout = grad_layout or layout
    args = (gathered, logits, g_arg, target, loss, partial, counter, info, rows, world, rank,
            *layout, *g_layout, logits.shape[-1], vocab_start, ignore_index, coef_target,
            coef_uniform, z_loss_weight)
    key = ("finish", rows, world, rank, layout, g_layout, logits.shape[-1], vocab_start,
           ignore_index, logits.dtype, g_arg.dtype, target.dtype, grad is not None, reduction,
           aligned(gathered, logits, g_arg, target, loss, partial, counter, info), logits.device)
    _PLANS.run(key, _ce_finish_kernel, (g,), args, lambda: dict(
        GRAD=grad is not None, REDUCE=reduction != "none", MEAN=reduction == "mean",
        SAME_LAYOUT=grad_layout in (None, layout), NT=LANES, VEC=vector_width(logits.dtype),
        MAX_G=next_power_of_2(g), WB=next_power_of_2(world), num_warps=NUM_WARPS,
        **_register_cap(grad is not None),
    ))  # fmt: skip


def cross_entropy_scale(
    grad: torch.Tensor, layout: tuple[int, int, int], dloss: torch.Tensor
) -> None:
    """Backward: ``grad[r] *= dloss[r]`` in place (``dloss`` 1-D fp32 of ``R`` rows, any
    stride, 0 for a broadcast scalar). Rows whose ``dloss`` is 1 move no data. One launch."""
    vocab = grad.shape[-1]
    rows = grad.numel() // max(vocab, 1)
    if rows == 0:
        return
    stride = dloss.stride(0) if dloss.dim() else 0
    args = (grad, dloss, stride, rows, *layout, vocab)
    key = ("scale", stride, rows, layout, vocab, grad.dtype, dloss.dtype, aligned(grad, dloss),
           grad.device)
    _PLANS.run(key, _ce_scale_kernel, (num_programs(rows),), args, lambda: dict(
        BLOCK=min(next_power_of_2(vocab), SCALE_BLOCK), num_warps=NUM_WARPS))
