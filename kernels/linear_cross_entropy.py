"""Triton kernels of the fused linear + cross-entropy: the per-chunk loss maths.

The chunk's logits shard ``x`` (``[rows, V_local]``, contiguous, fp32 / fp16 / bf16) comes from
one GEMM; these kernels replace the fp32 PyTorch passes over it (an fp32 copy, max, exp, sum,
gather, ...: five to eight reads and writes of a vocab-wide tensor) with one read forward and
one read plus one in-place write backward. The row machinery (16-byte vector loads whatever
``V_local`` is, per-lane online softmax) is the cross-entropy kernels'
(:mod:`mtp.kernels.cross_entropy_rows`).

- ``_lce_stats_kernel``: per row ``(m, s, c)``: max, ``sum exp(x - m)`` and
  ``c = coef_target * x[t] + coef_uniform * sum(x)`` (``t`` this rank's local target id, or -1
  when another rank owns it), the statistics the ranks all-gather.
- ``_lce_grad_kernel``: overwrites ``x`` with ``scale * (softmax(x) * (1 + 2 z lse) - coef_uniform
  - coef_target * onehot(t))`` from the saved ``(m, s)`` of the row (``softmax = exp(x - m) /
  s`` as PyTorch computes it, ``lse = m + log s``), ``scale`` = the row's upstream gradient
  (0 for ignored rows).

``coef_ptr`` is a device fp32 ``[2]`` = ``(1 - eps, eps / V)``: ``V``, the global vocab, is
known on the device only (the sum of the ranks' shard sizes), so it is not a launch argument.
Programs loop over rows ``pid, pid + G, ...`` beyond ``MAX_PROGRAMS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels.cross_entropy import LANES, NUM_WARPS, num_programs, vector_width
from mtp.kernels.cross_entropy_rows import _row_grad, _softmax_coefs, _store_row_stats


@triton.jit
def _lce_stats_kernel(logits_ptr, local_t_ptr, coef_ptr, stats_ptr, n_rows, V_local,
                      SMOOTHING: tl.constexpr, NT: tl.constexpr, VEC: tl.constexpr):
    coef_target, coef_uniform = tl.load(coef_ptr), tl.load(coef_ptr + 1)
    for row32 in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = row32 * tl.full([], 1, tl.int64)
        _store_row_stats(logits_ptr, row * V_local, V_local, tl.load(local_t_ptr + row),
                         coef_target, coef_uniform, stats_ptr + 3 * row, SMOOTHING, NT, VEC)


@triton.jit
def _lce_grad_kernel(logits_ptr, local_t_ptr, coef_ptr, rowstat_ptr, scale_ptr, n_rows, V_local,
                     z_loss_weight, NT: tl.constexpr, VEC: tl.constexpr):
    coef_target, coef_uniform = tl.load(coef_ptr), tl.load(coef_ptr + 1)
    for row32 in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = row32 * tl.full([], 1, tl.int64)
        row_off = row * V_local
        m, log_s = tl.load(rowstat_ptr + 2 * row), tl.log(tl.load(rowstat_ptr + 2 * row + 1))
        m_ref, a = _softmax_coefs(m, log_s, 1.0 + 2.0 * z_loss_weight * (m + log_s))
        local_t = tl.load(local_t_ptr + row)  # -1 (never a column) when another rank owns it
        scale = tl.load(scale_ptr + row)
        _row_grad(logits_ptr, logits_ptr, row_off, row_off, V_local, local_t, m_ref, a,
                  coef_target, coef_uniform, scale, True, NT, VEC)


def _check_chunk(x: torch.Tensor, local_t: torch.Tensor, coefs: torch.Tensor) -> None:
    assert x.dim() == 2 and x.is_contiguous(), "logits chunk must be contiguous [rows, V_local]"
    assert local_t.dtype == torch.int64 and local_t.is_contiguous() and local_t.numel() == x.shape[0]
    assert coefs.dtype == torch.float32 and coefs.numel() == 2


def chunk_stats(x: torch.Tensor, local_t: torch.Tensor, coefs: torch.Tensor,
                smoothing: bool) -> torch.Tensor:
    """fp32 ``[rows, 3]`` ``(m, s, c)`` of the logits chunk ``x`` ``[rows, V_local]``; one launch.

    ``local_t``: int64 ``[rows]`` local target ids (-1: not on this rank); ``coefs``: fp32 ``[2]``
    ``(1 - eps, eps / V)``; ``smoothing``: whether ``eps > 0`` (the ``sum(x)`` term is needed).
    """
    _check_chunk(x, local_t, coefs)
    rows = x.shape[0]
    stats = torch.empty((rows, 3), dtype=torch.float32, device=x.device)
    if rows:
        _lce_stats_kernel[(num_programs(rows),)](
            x, local_t, coefs, stats, rows, x.shape[1], SMOOTHING=smoothing, NT=LANES,
            VEC=vector_width(x.dtype), num_warps=NUM_WARPS,
        )  # fmt: skip
    return stats


def chunk_grad_(x: torch.Tensor, local_t: torch.Tensor, coefs: torch.Tensor,
                rowstat: torch.Tensor, scale: torch.Tensor, z_loss_weight: float) -> torch.Tensor:
    """Overwrite ``x`` ``[rows, V_local]`` with ``scale * d loss / d x`` (in ``x.dtype``); one launch.

    ``rowstat``: fp32 ``[rows, 2]`` ``(m, s)`` of the global row; ``scale``: fp32 ``[rows]``
    (the upstream gradient, 0 for ignored rows). Returns ``x``.
    """
    _check_chunk(x, local_t, coefs)
    assert rowstat.dtype == scale.dtype == torch.float32 and rowstat.is_contiguous()
    rows = x.shape[0]
    if rows:
        _lce_grad_kernel[(num_programs(rows),)](
            x, local_t, coefs, rowstat, scale.contiguous(), rows, x.shape[1],
            float(z_loss_weight), NT=LANES, VEC=vector_width(x.dtype), num_warps=NUM_WARPS,
        )  # fmt: skip
    return x
