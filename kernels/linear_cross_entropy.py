"""Triton kernels of the fused linear + cross-entropy: the per-chunk loss maths.

The chunk's logits shard ``x`` (``[rows, V_local]``, contiguous, fp32 / fp16 / bf16) comes from
one GEMM into a chunk buffer. These kernels read it once for the row statistics and, when the
gradient is wanted, read it again (the same program, an L2 hit on a GPU) and overwrite it with
the gradient in the input dtype: the operand of the ``d_hidden`` and ``d_weight`` GEMMs. The row
machinery (16-byte vector loads whatever ``V_local`` is, per-lane online softmax, the gradient of
a row rounded once) is the cross-entropy kernels' (:mod:`mtp.kernels.cross_entropy_rows`).

Targets are the global ids (int32 / int64, ``ignore_index`` for ignored rows). At tp > 1 the
shard's first id and the global vocab size live on the device (``vinfo``: int64 ``[2]``, from the
ranks' shard sizes); at tp = 1 they are ``0`` and ``V_local``. Notation as in
:mod:`mtp.kernels.cross_entropy`: ``c = (1 - eps) x[t] + (eps / V) sum(x)``.

- ``_lce_loss_kernel``: per row the loss, from the row's logits (tp = 1) or with ``PARTS`` from
  ``k`` partial statistics (the ranks' shards, and / or the vocab shares of the fused GEMM);
  with ``GRAD`` the gradient of the row's loss (upstream gradient 1, 0 for ignored rows)
  written over the row; with ``ROWSTAT`` ``(m, s)`` for a backward that recomputes the logits.
- ``_lce_stats_kernel`` (tp > 1, pass 1): per row ``(m, s, c)`` of the shard, what the ranks
  all-gather.
- ``_lce_grad_kernel`` (the backward that recomputes the logits): the gradient from the saved
  ``(m, s)``, scaled by the row's upstream gradient.

With ``CHECK`` the forward kernels count the valid targets outside ``[0, V)`` into ``status``
(int32, zeroed by the caller; one device-side check reads it). Programs loop over rows
``pid, pid + G, ...`` beyond ``MAX_PROGRAMS``. The launchers run through cached launch plans
(:mod:`mtp.kernels._launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._launch import Plans, aligned
from mtp.kernels.cross_entropy import (
    LANES,
    NUM_WARPS,
    _register_cap,
    num_programs,
    vector_width,
)
from mtp.kernels.cross_entropy_rows import (
    _finish_row,
    _row_grad,
    _row_stats_and_target,
    _softmax_coefs,
    _store_row_stats,
)

__all__ = ["chunk_grad_", "chunk_stats", "finish_rows", "forward_rows"]


@triton.jit
def _vocab(vinfo_ptr, V_local, TP: tl.constexpr):
    """``(first id of this shard, global vocab size)``: from the device at tp > 1."""
    if TP:
        start = tl.load(vinfo_ptr)
        vocab = tl.load(vinfo_ptr + 1)
    else:
        start = tl.full([], 0, tl.int64)
        vocab = tl.full([], 0, tl.int64) + V_local
    return start, vocab


@triton.jit
def _row_target(target_ptr, row, start, vocab, ignore_index):
    """``(local id or -1, valid, out of range)`` of the row's target: ``local`` is a column of
    this shard only when this rank owns the id."""
    t = tl.load(target_ptr + row).to(tl.int64)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= vocab))
    return tl.where(valid, t - start, -1), valid, bad.to(tl.int32)


@triton.jit
def _finish_and_grad(logits_ptr, row, V_local, local_t, valid, m, s, c, loss_ptr, rowstat_ptr,
                     coef_target, coef_uniform, z_loss_weight, GRAD: tl.constexpr,
                     ROWSTAT: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr):
    """Store the row's loss (and ``(m, s)``); with ``GRAD`` overwrite the row with its gradient."""
    log_s = tl.log(s)
    loss, lse = _finish_row(m, log_s, c, valid, z_loss_weight)
    tl.store(loss_ptr + row, loss)
    if ROWSTAT:
        tl.store(rowstat_ptr + 2 * row, m)
        tl.store(rowstat_ptr + 2 * row + 1, s)
    if GRAD:
        row_off = row * V_local
        m_ref, a = _softmax_coefs(m, log_s, 1.0 + 2.0 * z_loss_weight * lse)
        _row_grad(logits_ptr, logits_ptr, row_off, row_off, V_local, local_t, m_ref, a,
                  coef_target, coef_uniform, tl.where(valid, 1.0, 0.0), True, NT, VEC)


@triton.jit
def _report(status_ptr, n_bad, CHECK: tl.constexpr):
    if CHECK:
        if n_bad > 0:
            tl.atomic_add(status_ptr, n_bad)


@triton.jit
def _lce_stats_kernel(logits_ptr, target_ptr, vinfo_ptr, stats_ptr, n_rows, V_local,
                      ignore_index, eps, SMOOTHING: tl.constexpr, NT: tl.constexpr,
                      VEC: tl.constexpr):  # fmt: skip
    start, vocab = _vocab(vinfo_ptr, V_local, True)
    coef_target, coef_uniform = 1.0 - eps, eps / vocab.to(tl.float32)
    for row32 in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = row32 * tl.full([], 1, tl.int64)
        local_t, _, _ = _row_target(target_ptr, row, start, vocab, ignore_index)
        _store_row_stats(logits_ptr, row * V_local, V_local, local_t, coef_target,
                         coef_uniform, stats_ptr + 3 * row, SMOOTHING, NT, VEC)


@triton.jit
def _merge_parts(parts_ptr, n_parts, n_rows, row):
    """``(m, s, c)`` of a whole row from ``n_parts`` statistics ``[n_parts, n_rows, 3]``."""
    m = -float("inf")
    for p in range(0, n_parts):
        m = tl.maximum(m, tl.load(parts_ptr + (p * n_rows + row) * 3))
    m_ref = tl.where(m == -float("inf"), 0.0, m)
    s = 0.0
    c = 0.0
    for p in range(0, n_parts):
        at = parts_ptr + (p * n_rows + row) * 3
        s += tl.load(at + 1) * tl.exp(tl.load(at) - m_ref)
        c += tl.load(at + 2)
    return m, s, c


@triton.jit
def _lce_loss_kernel(logits_ptr, parts_ptr, target_ptr, vinfo_ptr, loss_ptr, rowstat_ptr,
                     status_ptr, n_parts, n_rows, V_local, ignore_index, eps, z_loss_weight,
                     PARTS: tl.constexpr, TP: tl.constexpr, SMOOTHING: tl.constexpr,
                     GRAD: tl.constexpr, ROWSTAT: tl.constexpr, CHECK: tl.constexpr,
                     NT: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """Per row the loss (and the gradient over the row); the statistics read from the logits
    row, or with ``PARTS`` merged from ``n_parts`` partial statistics."""
    start, vocab = _vocab(vinfo_ptr, V_local, TP)
    coef_target, coef_uniform = 1.0 - eps, eps / vocab.to(tl.float32)
    n_bad = tl.zeros([], tl.int32)
    for row32 in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = row32 * tl.full([], 1, tl.int64)
        local_t, valid, bad = _row_target(target_ptr, row, start, vocab, ignore_index)
        n_bad += bad
        if PARTS:
            m, s, c = _merge_parts(parts_ptr, n_parts, n_rows, row)
        else:
            m, s, c = _row_stats_and_target(logits_ptr, row * V_local, V_local, local_t,
                                            coef_target, coef_uniform, SMOOTHING, NT, VEC)
        _finish_and_grad(logits_ptr, row, V_local, local_t, valid, m, s, c, loss_ptr,
                         rowstat_ptr, coef_target, coef_uniform, z_loss_weight, GRAD, ROWSTAT,
                         NT, VEC)  # fmt: skip
    _report(status_ptr, n_bad, CHECK)


@triton.jit
def _lce_grad_kernel(logits_ptr, target_ptr, vinfo_ptr, rowstat_ptr, dloss_ptr, dloss_stride,
                     n_rows, V_local, ignore_index, eps, z_loss_weight, TP: tl.constexpr,
                     NT: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    start, vocab = _vocab(vinfo_ptr, V_local, TP)
    coef_target, coef_uniform = 1.0 - eps, eps / vocab.to(tl.float32)
    for row32 in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = row32 * tl.full([], 1, tl.int64)
        local_t, valid, _ = _row_target(target_ptr, row, start, vocab, ignore_index)
        m, log_s = tl.load(rowstat_ptr + 2 * row), tl.log(tl.load(rowstat_ptr + 2 * row + 1))
        m_ref, a = _softmax_coefs(m, log_s, 1.0 + 2.0 * z_loss_weight * (m + log_s))
        scale = tl.where(valid, tl.load(dloss_ptr + row * dloss_stride).to(tl.float32), 0.0)
        row_off = row * V_local
        _row_grad(logits_ptr, logits_ptr, row_off, row_off, V_local, local_t, m_ref, a,
                  coef_target, coef_uniform, scale, True, NT, VEC)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

_PLANS = Plans()


def _options(x: torch.Tensor, grad: bool, **constexprs) -> dict:
    return dict(NT=LANES, VEC=vector_width(x.dtype), num_warps=NUM_WARPS, **constexprs,
                **_register_cap(grad))  # fmt: skip


def forward_rows(x: torch.Tensor, target: torch.Tensor, loss: torch.Tensor,
                 rowstat: torch.Tensor | None, status: torch.Tensor | None, *,
                 ignore_index: int, eps: float, z: float, grad: bool) -> None:
    """tp = 1: ``loss`` (fp32 ``[rows]``) of the logits chunk ``x`` ``[rows, V_local]``
    (contiguous), ``rowstat`` (fp32 ``[rows, 2]``) when given, and with ``grad`` the gradient
    of the rows' loss written over ``x``. ``target``: ``[rows]`` contiguous global ids;
    ``status``: int32 0-d, the out-of-range count is added to it (None: no check). One launch."""
    _loss_rows(None, x, target, None, loss, rowstat, status, x.shape[1], ignore_index, eps, z,
               grad, eps > 0.0)  # fmt: skip


def chunk_stats(x: torch.Tensor, target: torch.Tensor, vinfo: torch.Tensor, stats: torch.Tensor,
                *, ignore_index: int, eps: float) -> None:
    """tp > 1, pass 1: ``stats`` fp32 ``[rows, 3]`` ``(m, s, c)`` of the shard ``x``; ``vinfo``
    int64 ``[2]`` ``(first id of the shard, global vocab)`` on the device. One launch."""
    rows, v = x.shape
    if rows == 0:
        return
    args = (x, target, vinfo, stats, rows, v, ignore_index, eps)
    key = ("stats", rows, v, ignore_index, x.dtype, target.dtype, eps > 0.0,
           aligned(x, target, vinfo, stats), x.device)
    _PLANS.run(key, _lce_stats_kernel, (num_programs(rows),), args,
               lambda: _options(x, False, SMOOTHING=eps > 0.0))  # fmt: skip


def finish_rows(parts: torch.Tensor, x: torch.Tensor | None, target: torch.Tensor,
                vinfo: torch.Tensor | None, loss: torch.Tensor, rowstat: torch.Tensor | None,
                status: torch.Tensor | None, *, v_local: int, ignore_index: int, eps: float,
                z: float, grad: bool) -> None:
    """The loss from the statistics ``parts`` (fp32 ``[k, rows, 3]``, contiguous: the ranks'
    shards and / or vocab shares), as :func:`forward_rows` otherwise (``x`` is only read with
    ``grad``; ``vinfo`` None at tp = 1). One launch."""
    _loss_rows(parts, x, target, vinfo, loss, rowstat, status, v_local, ignore_index, eps, z,
               grad, False)  # fmt: skip


def _loss_rows(parts, x, target, vinfo, loss, rowstat, status, v_local, ignore_index, eps, z,
               grad, smoothing) -> None:
    rows = target.shape[0]
    if rows == 0:
        return
    # unused pointers get a tensor of the launch (never read)
    xx, pp = (parts if x is None else x), (x if parts is None else parts)
    vi, rs, st = (target if vinfo is None else vinfo), (loss if rowstat is None else rowstat), (
        loss if status is None else status)
    n_parts = 1 if parts is None else parts.shape[0]
    args = (xx, pp, target, vi, loss, rs, st, n_parts, rows, v_local, ignore_index, eps, z)
    flags = (parts is not None, vinfo is not None, smoothing, grad, rowstat is not None,
             status is not None)
    key = ("loss", n_parts, rows, v_local, ignore_index, xx.dtype, target.dtype, flags,
           aligned(xx, pp, target, vi, loss, rs, st), target.device)
    _PLANS.run(key, _lce_loss_kernel, (num_programs(rows),), args, lambda: _options(
        xx, grad, **dict(zip(("PARTS", "TP", "SMOOTHING", "GRAD", "ROWSTAT", "CHECK"), flags))))


def chunk_grad_(x: torch.Tensor, target: torch.Tensor, vinfo: torch.Tensor | None,
                rowstat: torch.Tensor, dloss: torch.Tensor, *, ignore_index: int, eps: float,
                z: float) -> None:
    """Overwrite ``x`` ``[rows, V_local]`` with ``dloss[row] * d loss / d x`` (in ``x.dtype``)
    from the saved ``rowstat`` (fp32 ``[rows, 2]``); ``dloss``: fp32 ``[rows]``, any stride
    (0: one value broadcast). One launch."""
    rows, v = x.shape
    if rows == 0:
        return
    vi = target if vinfo is None else vinfo
    stride = dloss.stride(0) if dloss.dim() else 0
    args = (x, target, vi, rowstat, dloss, stride, rows, v, ignore_index, eps, z)
    key = ("grad", rows, v, stride, ignore_index, x.dtype, target.dtype, dloss.dtype,
           vinfo is not None, aligned(x, target, vi, rowstat, dloss), x.device)
    _PLANS.run(key, _lce_grad_kernel, (num_programs(rows),), args,
               lambda: _options(x, True, TP=vinfo is not None))  # fmt: skip
