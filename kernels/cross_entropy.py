"""Fused (vocab-parallel) cross-entropy: one pass over the logits forward, one backward.

Notation per row: ``x`` the logits of this rank's vocab shard ``[vocab_start, vocab_start+Vl)``,
``t`` the global target id, ``V`` the global vocab size, ``eps`` the label smoothing and ``w`` the
z-loss weight. Global ``lse = M + log(S)`` with ``M`` the max logit and ``S = sum exp(x - M)``.
The loss is ``F.cross_entropy(full_logits, t, label_smoothing=eps) + w * lse**2``:

    loss = (M - C) + log(S) + w * lse**2,   C = (1 - eps) * x[t] + (eps / V) * sum(x)

``C`` is a sum over shards, ``M`` a max and ``S`` a rescaled sum, so each rank reduces its shard
to three fp32 values per row (``m``, ``s``, ``c``) and the ranks exchange only those.

Kernels (fp32 math; logits fp32 / fp16 / bf16; targets int32 / int64):

- ``_ce_fwd_kernel``: one program per row, an online max / sum-exp over the shard in
  ``BLOCK_V`` chunks. ``FINAL`` (one rank): writes the loss and the per-row ``(M, log S)``.
  Otherwise writes the row statistics ``(m, s, c)`` for the all-gather.
- ``_ce_combine_kernel``: combines the gathered ``[world, rows, 3]`` statistics into the loss
  and ``(M, log S)``.
- ``_ce_bwd_kernel``: ``grad = dloss * (softmax * (1 + 2 w lse) - eps/V - (1-eps) onehot)``,
  one program per ``(row, BLOCK_V chunk)``; may write into the logits buffer itself.

Ignored rows (``target == ignore_index``) get loss 0 and gradient 0. Rows are addressed as
``(r // n_inner) * stride_outer + (r % n_inner) * stride_inner``, which covers logits whose
leading dims are non-contiguous (a slice or a transpose of ``[b, s, v]``) without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2

#: fp32 values per row that each rank contributes to the all-gather: ``(m, s, c)``.
NUM_STATS = 3
#: Largest vocab chunk per loop iteration of the forward and per program of the backward.
#: (Forward 4096 x 8 warps made ptxas spill 8 bytes on sm_100a with label smoothing.)
MAX_BLOCK_V_FWD = 2048
MAX_BLOCK_V_BWD = 4096
NUM_WARPS = 8
#: Rows per program of the combine kernel, and its warps.
COMBINE_BLOCK = 256
COMBINE_NUM_WARPS = 4


@triton.jit
def _row_offset(row, n_inner, stride_outer, stride_inner):
    return (row // n_inner) * stride_outer + (row % n_inner) * stride_inner


@triton.jit
def _finish(m, s, c, target, ignore_index, z_loss_weight):
    """``(loss, log S)`` of rows with global max ``m``, rescaled sum ``s`` and linear term ``c``."""
    log_s = tl.log(s)
    lse = m + log_s
    loss = (m - c) + log_s + z_loss_weight * lse * lse
    return tl.where(target != ignore_index, loss, 0.0), log_s


@triton.jit
def _ce_fwd_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    rowstat_ptr,
    stats_ptr,
    n_inner,
    stride_outer,
    stride_inner,
    V_local,
    vocab_start,
    ignore_index,
    coef_target,
    coef_uniform,
    z_loss_weight,
    SMOOTHING: tl.constexpr,
    FINAL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + _row_offset(row, n_inner, stride_outer, stride_inner)
    target = tl.load(target_ptr + row).to(tl.int64)
    local_t = target - vocab_start
    m = -float("inf")
    s = 0.0
    sum_x = 0.0
    for start in range(0, V_local, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V_local
        x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A shard (so far) of -inf only: keep s = 0 instead of exp(-inf - -inf) = NaN.
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
        m = m_new
        if SMOOTHING:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
    owns = (local_t >= 0) & (local_t < V_local)
    x_t = tl.load(base + tl.where(owns, local_t, 0), mask=owns, other=0.0).to(tl.float32)
    c = coef_target * x_t
    if SMOOTHING:
        c += coef_uniform * sum_x
    if FINAL:
        loss, log_s = _finish(m, s, c, target, ignore_index, z_loss_weight)
        tl.store(loss_ptr + row, loss)
        tl.store(rowstat_ptr + 2 * row, m)
        tl.store(rowstat_ptr + 2 * row + 1, log_s)
    else:
        tl.store(stats_ptr + 3 * row, m)
        tl.store(stats_ptr + 3 * row + 1, s)
        tl.store(stats_ptr + 3 * row + 2, c)


@triton.jit
def _ce_combine_kernel(
    stats_ptr,
    target_ptr,
    loss_ptr,
    rowstat_ptr,
    n_rows,
    world_size,
    ignore_index,
    z_loss_weight,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    m = tl.full([BLOCK], -float("inf"), tl.float32)
    for r in range(0, world_size):
        at = stats_ptr + 3 * (r * n_rows + rows)
        m = tl.maximum(m, tl.load(at, mask=mask, other=-float("inf")))
    m_ref = tl.where(m == -float("inf"), 0.0, m)
    s = tl.zeros([BLOCK], tl.float32)
    c = tl.zeros([BLOCK], tl.float32)
    for r in range(0, world_size):
        at = stats_ptr + 3 * (r * n_rows + rows)
        m_r = tl.load(at, mask=mask, other=-float("inf"))
        s += tl.load(at + 1, mask=mask, other=0.0) * tl.exp(m_r - m_ref)
        c += tl.load(at + 2, mask=mask, other=0.0)
    target = tl.load(target_ptr + rows, mask=mask, other=0)
    loss, log_s = _finish(m, s, c, target, ignore_index, z_loss_weight)
    tl.store(loss_ptr + rows, loss, mask=mask)
    tl.store(rowstat_ptr + 2 * rows, m, mask=mask)
    tl.store(rowstat_ptr + 2 * rows + 1, log_s, mask=mask)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr,
    grad_ptr,
    target_ptr,
    rowstat_ptr,
    dloss_ptr,
    dloss_stride,
    n_inner,
    stride_outer,
    stride_inner,
    g_n_inner,
    g_stride_outer,
    g_stride_inner,
    V_local,
    vocab_start,
    ignore_index,
    coef_target,
    coef_uniform,
    z_loss_weight,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V_local
    target = tl.load(target_ptr + row).to(tl.int64)
    m = tl.load(rowstat_ptr + 2 * row)
    log_s = tl.load(rowstat_ptr + 2 * row + 1)
    dloss = tl.load(dloss_ptr + row * dloss_stride).to(tl.float32)
    x = tl.load(
        logits_ptr + _row_offset(row, n_inner, stride_outer, stride_inner) + cols,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    p = tl.exp((x - m) - log_s)
    g = p * (1.0 + 2.0 * z_loss_weight * (m + log_s)) - coef_uniform
    g = g - tl.where(cols == target - vocab_start, coef_target, 0.0)
    g = tl.where(target != ignore_index, g * dloss, 0.0)
    tl.store(
        grad_ptr + _row_offset(row, g_n_inner, g_stride_outer, g_stride_inner) + cols,
        g.to(grad_ptr.dtype.element_ty),
        mask=mask,
    )


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def row_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(n_inner, stride_outer, stride_inner)`` addressing the rows of ``t`` ``[..., V]``.

    Leading dims are merged where their strides allow; None when more than two strided leading
    dims remain (the caller then makes a contiguous copy). ``t.stride(-1)`` must be 1.
    """
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


def block_v(v_local: int, backward: bool = False) -> int:
    """Default vocab chunk for a shard of ``v_local`` logits (forward or backward kernel)."""
    cap = MAX_BLOCK_V_BWD if backward else MAX_BLOCK_V_FWD
    return min(next_power_of_2(max(v_local, 1)), cap)


def _coefs(label_smoothing: float, vocab_size: int) -> tuple[float, float]:
    return 1.0 - label_smoothing, label_smoothing / vocab_size


def cross_entropy_forward(
    logits: torch.Tensor,
    layout: tuple[int, int, int],
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    loss: torch.Tensor | None,
    rowstat: torch.Tensor | None,
    stats: torch.Tensor | None,
) -> None:
    """Per-row pass over ``logits`` ``[..., Vl]`` (rows addressed by ``layout``).

    Either ``loss`` ``[R]`` fp32 and ``rowstat`` ``[R, 2]`` fp32 (``(M, log S)``) are given (a
    single rank: the final result), or ``stats`` ``[R, 3]`` fp32 (``(m, s, c)`` of this shard).
    ``target`` is ``[R]`` contiguous int32/int64 holding global ids.
    """
    rows = target.numel()
    if rows == 0:
        return
    final = stats is None
    coef_target, coef_uniform = _coefs(label_smoothing, vocab_size)
    dummy = target if final else stats
    _ce_fwd_kernel[(rows,)](
        logits,
        target,
        loss if final else dummy,
        rowstat if final else dummy,
        dummy if final else stats,
        *layout,
        logits.shape[-1],
        vocab_start,
        ignore_index,
        coef_target,
        coef_uniform,
        z_loss_weight,
        SMOOTHING=label_smoothing > 0.0,
        FINAL=final,
        BLOCK_V=block_v(logits.shape[-1]),
        num_warps=NUM_WARPS,
    )


def cross_entropy_combine(
    gathered: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    z_loss_weight: float,
    loss: torch.Tensor,
    rowstat: torch.Tensor,
) -> None:
    """Combine ``gathered`` ``[world, R, 3]`` fp32 statistics into ``loss`` / ``rowstat``."""
    world, rows = gathered.shape[0], gathered.shape[1]
    if rows == 0:
        return
    _ce_combine_kernel[(triton.cdiv(rows, COMBINE_BLOCK),)](
        gathered,
        target,
        loss,
        rowstat,
        rows,
        world,
        ignore_index,
        z_loss_weight,
        BLOCK=COMBINE_BLOCK,
        num_warps=COMBINE_NUM_WARPS,
    )


def cross_entropy_backward(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    layout: tuple[int, int, int],
    target: torch.Tensor,
    rowstat: torch.Tensor,
    grad: torch.Tensor,
    grad_layout: tuple[int, int, int],
    *,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
) -> None:
    """Write ``dloss[r] * dloss_r/dlogits`` into ``grad`` (may be ``logits`` itself).

    ``dloss`` is a 1-D fp32 tensor of ``R`` rows (any stride, 0 for a broadcast scalar).
    """
    rows, v_local = target.numel(), logits.shape[-1]
    if rows == 0:
        return
    coef_target, coef_uniform = _coefs(label_smoothing, vocab_size)
    bv = block_v(v_local, backward=True)
    _ce_bwd_kernel[(rows, triton.cdiv(v_local, bv))](
        logits,
        grad,
        target,
        rowstat,
        dloss,
        dloss.stride(0),
        *layout,
        *grad_layout,
        v_local,
        vocab_start,
        ignore_index,
        coef_target,
        coef_uniform,
        z_loss_weight,
        BLOCK_V=bv,
        num_warps=NUM_WARPS,
    )
