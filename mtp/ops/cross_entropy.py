"""Fused vocab-parallel cross-entropy (``mtp.ops.vocab_parallel_cross_entropy``).

Custom ops (``torch.ops.mtp.*``) with fake implementations:

- ``mtp::vocab_parallel_cross_entropy(logits, target, label_smoothing, ignore_index,
  z_loss_weight, vocab_start, vocab_size, group_name, inplace_backward, backend)
  -> (loss, rowstat)``, with autograd. ``loss`` is fp32 with ``target``'s shape; ``rowstat``
  (fp32 ``[..., 2]``, not differentiable) holds ``(max, log(sum(exp(logits - max))))`` of each
  row over the *global* vocab, so ``lse = rowstat[..., 0] + rowstat[..., 1]``.
- ``mtp::vocab_parallel_cross_entropy_backward(dloss, logits, target, rowstat, ...) -> grad``
  and ``mtp::vocab_parallel_cross_entropy_backward_`` (writes the gradient into ``logits``).

Distributed: each rank holds ``logits[..., rank*Vl:(rank+1)*Vl]`` of the global vocab. The
forward reduces its shard to three fp32 values per row and the ranks exchange them in one
``all_gather`` (``12 * rows`` bytes per rank); the backward needs no communication and returns
this rank's shard of the gradient. The group travels through the op as the name
``torch.distributed`` registered it under (custom ops cannot take a ``ProcessGroup``; see
:mod:`mtp.parallel.groups`, trace-safe under ``torch.compile``).

Autograd saves the logits (no copy), the targets and ``rowstat`` (8 bytes per row).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.ops._backend import resolve_backend
from mtp.parallel.groups import group_from_mesh, group_name, resolve_group_name
from mtp.utils import check_tensor, data_checks_enabled, empty

__all__ = [
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_reference",
    "TargetOutOfRangeError",
    "REDUCTIONS",
]

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TARGET_DTYPES = (torch.int64, torch.int32)
_BACKENDS = ("triton", "reference")
REDUCTIONS = ("none", "mean", "sum")


class TargetOutOfRangeError(ValueError, IndexError):
    """A target id is outside ``[0, vocab_size)`` and is not ``ignore_index``.

    A ``ValueError`` (the project's bad-input error) and an ``IndexError`` (what
    ``torch.nn.functional.cross_entropy`` raises for the same mistake).
    """


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def _group_info(group: dist.ProcessGroup | None) -> tuple[str, int, int]:
    """``(group_name, rank, world_size)``; ``""`` (no communication) for None or size 1."""
    group = group_from_mesh(group)
    if group is None:
        return "", 0, 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {group!r}")
    world = dist.get_world_size(group)
    if world == 1:
        return "", 0, 1
    return group_name(group), dist.get_rank(group), world


def _all_gather_stats(stats: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[world, rows, 3]``: every rank's ``stats`` ``[rows, 3]`` (one collective)."""
    group = resolve_group_name(group_name)
    world = dist.get_world_size(group)
    gathered = torch.empty((world, *stats.shape), dtype=stats.dtype, device=stats.device)
    if stats.numel():  # no rows here means no rows on any rank (the targets are replicated)
        dist.all_gather(list(gathered.unbind(0)), stats, group=group)
    return gathered


# --------------------------------------------------------------------------------------------
# Reference (plain PyTorch; fp32 copies of the shard are fine here)
# --------------------------------------------------------------------------------------------


def _coefs(label_smoothing: float, vocab_size: int) -> tuple[float, float]:
    return 1.0 - label_smoothing, label_smoothing / vocab_size


def _local_target(target: torch.Tensor, vocab_start: int, v_local: int):
    local = target.reshape(-1).long() - vocab_start
    owns = (local >= 0) & (local < v_local)
    return local.clamp(0, v_local - 1), owns


def _reference_stats(logits, target, label_smoothing, vocab_start, vocab_size) -> torch.Tensor:
    """``[rows, 3]`` fp32 ``(m, s, c)`` of this shard (see :mod:`mtp.kernels.cross_entropy`)."""
    v_local = logits.shape[-1]
    x = logits.reshape(-1, v_local).float()
    m = x.amax(-1)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    s = torch.exp(x - m_ref[:, None]).sum(-1)
    local, owns = _local_target(target, vocab_start, v_local)
    x_t = torch.where(owns, x.gather(1, local[:, None])[:, 0], torch.zeros_like(m))
    coef_target, coef_uniform = _coefs(label_smoothing, vocab_size)
    c = coef_target * x_t
    if label_smoothing > 0:
        c = c + coef_uniform * x.sum(-1)
    return torch.stack([m, s, c], dim=-1)


def _reference_combine(gathered, target, ignore_index, z_loss_weight):
    """``(loss [rows], rowstat [rows, 2])`` from ``[world, rows, 3]`` statistics."""
    m_all, s_all, c_all = gathered.unbind(-1)
    m = m_all.amax(0)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    log_s = torch.log((s_all * torch.exp(m_all - m_ref)).sum(0))
    lse = m + log_s
    loss = (m - c_all.sum(0)) + log_s + z_loss_weight * lse * lse
    valid = target.reshape(-1) != ignore_index
    return torch.where(valid, loss, torch.zeros_like(loss)), torch.stack([m, log_s], dim=-1)


def _reference_grad(dloss, logits, target, rowstat, eps, ignore_index, z, vocab_start, vocab_size):
    v_local = logits.shape[-1]
    x = logits.reshape(-1, v_local).float()
    m, log_s = rowstat.reshape(-1, 2).unbind(-1)
    p = torch.exp((x - m[:, None]) - log_s[:, None])
    coef_target, coef_uniform = _coefs(eps, vocab_size)
    g = p * (1.0 + 2.0 * z * (m + log_s))[:, None] - coef_uniform
    local, owns = _local_target(target, vocab_start, v_local)
    g.scatter_add_(1, local[:, None], torch.where(owns, -coef_target, 0.0)[:, None])
    valid = (target.reshape(-1) != ignore_index)[:, None]
    g = torch.where(valid, g * dloss.reshape(-1, 1).float(), torch.zeros_like(g))
    return g.reshape(logits.shape)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


def _kernel_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` (or a contiguous copy) and its row layout, as the kernels read it."""
    from mtp.kernels.cross_entropy import row_layout

    layout = row_layout(t) if (t.stride(-1) == 1 or t.shape[-1] == 1) else None
    if layout is None:
        t = t.contiguous()
        layout = row_layout(t)
    return t, layout


@torch.library.custom_op("mtp::vocab_parallel_cross_entropy", mutates_args=())
def _ce_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    vocab_start: int,
    vocab_size: int,
    group_name: str,
    inplace_backward: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    backend = resolve_backend("vocab_parallel_cross_entropy", backend, logits.device, _BACKENDS)
    rows, device = target.numel(), logits.device
    target1 = target.reshape(-1).contiguous()
    if backend == "reference":
        stats = _reference_stats(logits, target1, label_smoothing, vocab_start, vocab_size)
        gathered = _all_gather_stats(stats, group_name) if group_name else stats[None]
        loss, rowstat = _reference_combine(gathered, target1, ignore_index, z_loss_weight)
        return loss.reshape(target.shape), rowstat.reshape(*target.shape, 2)

    from mtp.kernels import cross_entropy as kernels

    loss = empty(target.shape, dtype=torch.float32, device=device)
    rowstat = empty((*target.shape, 2), dtype=torch.float32, device=device)
    common = dict(
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
        z_loss_weight=z_loss_weight,
    )
    logits, layout = _kernel_view(logits)
    if not group_name:
        kernels.cross_entropy_forward(
            logits, layout, target1, **common, loss=loss, rowstat=rowstat, stats=None
        )
        return loss, rowstat
    stats = empty((rows, kernels.NUM_STATS), dtype=torch.float32, device=device)
    kernels.cross_entropy_forward(
        logits, layout, target1, **common, loss=None, rowstat=None, stats=stats
    )
    kernels.cross_entropy_combine(
        _all_gather_stats(stats, group_name),
        target1,
        ignore_index=ignore_index,
        z_loss_weight=z_loss_weight,
        loss=loss,
        rowstat=rowstat,
    )
    return loss, rowstat


@_ce_op.register_fake
def _(logits, target, *args):
    return (
        logits.new_empty(target.shape, dtype=torch.float32),
        logits.new_empty((*target.shape, 2), dtype=torch.float32),
    )


def _backward_into(
    grad, dloss, logits, target, rowstat, eps, ignore_index, z, start, size, backend
) -> None:
    backend = resolve_backend("vocab_parallel_cross_entropy", backend, logits.device, _BACKENDS)
    if backend == "reference":
        g = _reference_grad(dloss, logits, target, rowstat, eps, ignore_index, z, start, size)
        grad.copy_(g)
        return
    from mtp.kernels.cross_entropy import cross_entropy_backward

    logits, layout = _kernel_view(logits)
    out, out_layout = _kernel_view(grad)
    cross_entropy_backward(
        dloss.reshape(-1).float(),
        logits,
        layout,
        target.reshape(-1).contiguous(),
        rowstat.reshape(-1, 2).contiguous(),
        out,
        out_layout,
        vocab_start=start,
        vocab_size=size,
        label_smoothing=eps,
        ignore_index=ignore_index,
        z_loss_weight=z,
    )
    if out is not grad:
        grad.copy_(out)


@torch.library.custom_op("mtp::vocab_parallel_cross_entropy_backward", mutates_args=())
def _ce_backward_op(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    rowstat: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    vocab_start: int,
    vocab_size: int,
    backend: str,
) -> torch.Tensor:
    grad = empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _backward_into(
        grad, dloss, logits, target, rowstat, label_smoothing, ignore_index, z_loss_weight,
        vocab_start, vocab_size, backend,
    )  # fmt: skip
    return grad


@_ce_backward_op.register_fake
def _(dloss, logits, *args):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("mtp::vocab_parallel_cross_entropy_backward_", mutates_args=("logits",))
def _ce_backward_inplace_op(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    rowstat: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    vocab_start: int,
    vocab_size: int,
    backend: str,
) -> None:
    _backward_into(
        logits, dloss, logits, target, rowstat, label_smoothing, ignore_index, z_loss_weight,
        vocab_start, vocab_size, backend,
    )  # fmt: skip


@_ce_backward_inplace_op.register_fake
def _(*args):
    return None


def _setup_context(ctx, inputs, output) -> None:
    logits, target, eps, ignore_index, z, start, size, _, inplace, backend = inputs
    rowstat = output[1]
    ctx.save_for_backward(logits, target, rowstat)
    ctx.mark_non_differentiable(rowstat)
    ctx.args = (eps, ignore_index, z, start, size, backend)
    ctx.inplace = inplace


def _ce_autograd(ctx, dloss, _drowstat):
    logits, target, rowstat = ctx.saved_tensors
    if ctx.inplace:
        torch.ops.mtp.vocab_parallel_cross_entropy_backward_(
            dloss, logits, target, rowstat, *ctx.args
        )
        grad = logits
    else:
        grad = torch.ops.mtp.vocab_parallel_cross_entropy_backward(
            dloss, logits, target, rowstat, *ctx.args
        )
    return (grad,) + (None,) * 9


_ce_op.register_autograd(_ce_autograd, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _check_args(logits, target, label_smoothing, ignore_index, reduction, z_loss_weight) -> None:
    check_tensor("logits", logits, dtypes=_LOGIT_DTYPES)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(
            "logits must be [..., vocab] with a non-empty last (vocab) dim, got shape "
            f"{tuple(logits.shape)}"
        )
    if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
        raise TypeError(
            f"target must hold class indices (int64 or int32), got {target.dtype}; class "
            "probabilities (soft targets) are not supported"
        )
    check_tensor("target", target, dtypes=_TARGET_DTYPES, device=logits.device)
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target must have shape {tuple(logits.shape[:-1])} (logits shape "
            f"{tuple(logits.shape)} without the vocab dim), got {tuple(target.shape)}"
        )
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss_weight, (int, float)) or not 0.0 <= z_loss_weight < float("inf"):
        raise ValueError(f"z_loss_weight must be a finite float >= 0, got {z_loss_weight!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")


def _check_targets(target: torch.Tensor, ignore_index: int, vocab_size: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        first = target[bad][0].item()
        raise TargetOutOfRangeError(
            f"target holds {int(bad.sum())} id(s) outside [0, {vocab_size}) that are not "
            f"ignore_index={ignore_index} (e.g. {first}); vocab_size is the global vocab "
            "(shard size x group size). Pass validate=False to skip this check."
        )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "none",
    z_loss_weight: float = 0.0,
    inplace_backward: bool = False,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of logits split over the vocab, fused (one pass forward, one backward).

    Equal to ``F.cross_entropy(full_logits.float(), target, label_smoothing=..., ignore_index=...,
    reduction=...) + z_loss_weight * lse**2`` (per row, before the reduction), where
    ``full_logits`` is the concatenation of every rank's shard along the last dim and ``lse`` is
    its log-sum-exp. Label smoothing spreads ``label_smoothing`` over the *global* vocab, so
    every rank computes the same loss (unlike Megatron-LM's shard-local smoothing).

    Args:
        logits: this rank's shard ``[..., Vl]`` (fp32 / fp16 / bf16) of a vocab of
            ``V = Vl * group_size`` ids; rank ``r`` holds ids ``[r*Vl, (r+1)*Vl)``. Any leading
            dims (strided leading dims are read in place; the last dim should be contiguous).
        target: ``[...]`` (``logits.shape[:-1]``) int64 / int32 global ids in ``[0, V)`` or
            ``ignore_index``.
        group: the tensor-parallel group the vocab is split over; None (or a group of size 1)
            is ordinary fused cross-entropy.
        label_smoothing: in ``[0, 1]``, as in ``F.cross_entropy``.
        ignore_index: rows with this target get loss 0 and gradient 0.
        reduction: ``"none"`` (per-row loss, ``target``'s shape), ``"sum"`` or ``"mean"`` (over
            the non-ignored rows, computed on the device; NaN when every row is ignored, as in
            PyTorch).
        z_loss_weight: adds ``z_loss_weight * lse**2`` per row (PaLM's z-loss), with its gradient.
        inplace_backward: the backward writes the gradient into ``logits`` (saves one
            logits-sized buffer; ``logits`` must not be needed afterwards).
        validate: check that the targets are in range (one host sync); skipped automatically
            while tracing, compiling or capturing a CUDA graph.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        The loss in float32: ``target``'s shape for ``"none"``, a scalar otherwise.

    Communication: one ``all_gather`` of ``3 * rows`` fp32 per rank in the forward, none in the
    backward; the gradient is this rank's shard (``logits.dtype``, ``logits.shape``).
    Memory: autograd saves ``logits`` (no copy), ``target`` and 8 bytes per row.
    Bytes moved: forward reads the shard once (``rows * Vl * s``); backward reads it again and
    writes the gradient (``2 * rows * Vl * s``), plus ``O(rows)``.

    Raises:
        TypeError / ValueError: bad arguments (named in the message).
        TargetOutOfRangeError: a target outside ``[0, V)`` other than ``ignore_index``.
    """
    _check_args(logits, target, label_smoothing, ignore_index, reduction, z_loss_weight)
    group_name, rank, world = _group_info(group)
    backend = resolve_backend("vocab_parallel_cross_entropy", backend, logits.device, _BACKENDS)
    v_local = logits.shape[-1]
    vocab_size = v_local * world
    if backend == "triton":
        logits, _ = _kernel_view(logits)  # a copy only if the rows need more than two strides
    if data_checks_enabled(validate, target):
        _check_targets(target, ignore_index, vocab_size)
    loss, _ = torch.ops.mtp.vocab_parallel_cross_entropy(
        logits,
        target,
        float(label_smoothing),
        int(ignore_index),
        float(z_loss_weight),
        rank * v_local,
        vocab_size,
        group_name,
        bool(inplace_backward),
        backend,
    )
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    return loss


def vocab_parallel_cross_entropy_reference(
    logits: torch.Tensor, target: torch.Tensor, **kwargs
) -> torch.Tensor:
    """:func:`vocab_parallel_cross_entropy` computed with plain PyTorch ops in fp32 (the same
    statistics, collective and formulas, without Triton): the reference tests and benches share.
    Takes the same arguments except ``backend``."""
    if "backend" in kwargs:
        raise TypeError("vocab_parallel_cross_entropy_reference takes no backend argument")
    return vocab_parallel_cross_entropy(logits, target, backend="reference", **kwargs)
