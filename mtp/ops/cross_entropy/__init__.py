"""Fused vocab-parallel cross-entropy (``mtp.ops.vocab_parallel_cross_entropy``).

The gradient is computed in the forward, while the logits are read (the backward only scales
it by the upstream gradient, and does nothing when that is 1). Custom ops (``torch.ops.mtp.*``)
with fake implementations:

- ``mtp::vocab_parallel_cross_entropy(logits, target, label_smoothing, ignore_index,
  z_loss_weight, vocab_start, vocab_size, group_name, world_size, reduction, compute_grad,
  check, backend) -> (loss, grad, info)``: ``loss`` fp32 (``target``'s shape for
  ``reduction="none"``, else 0-d), ``grad`` the gradient of the (reduced) loss for a unit
  upstream gradient (``logits``' shape and dtype; ``[0]`` when ``compute_grad`` is False),
  ``info`` int32 ``[world_size + 1, 4]`` (see :mod:`mtp.kernels.cross_entropy`).
- ``mtp::vocab_parallel_cross_entropy_(logits!, ...) -> (loss, info)``: the same, writing the
  gradient into ``logits`` (``inplace_backward=True``).
- ``mtp::vocab_parallel_cross_entropy_scale_(grad!, dloss, backend)``: the backward,
  ``grad *= dloss`` per row.

Distributed: each rank holds ``logits[..., rank*Vl:(rank+1)*Vl]`` of the global vocab. The
ranks first exchange their agreement row (:mod:`mtp.parallel.collective_check`: a row count
that differs, zero included, raises ``RankMismatchError`` on every rank). Pass 1
reduces the shard to three fp32 values per row, and one ``all_gather`` exchanges them together
with two metadata rows per rank (shard size, valid-target count, a checksum of the targets, the
range check): ``12 * (rows + 2)`` bytes per rank. Pass 2 combines them into the loss, checks
that every rank saw the same targets and shard size, and writes this rank's gradient shard.
The group travels through the op as the name ``torch.distributed`` registered it under (custom
ops cannot take a ``ProcessGroup``; :mod:`mtp.parallel.groups`, trace-safe under
``torch.compile``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from mtp.kernels import cross_entropy as kernels
from mtp.kernels.cross_entropy import META_ROWS
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import CheckedKeys, autograd_apply, eager
from mtp.ops.cross_entropy.checks import (
    REDUCTIONS,
    TargetOutOfRangeError,
    check_args,
    check_info,
    check_transforms,
)
from mtp.ops.cross_entropy.reference import reference_forward
from mtp.parallel.collective_check import check_collective
from mtp.parallel.errors import RankMismatchError
from mtp.parallel.groups import group_from_mesh, group_name, resolve_group_name
from mtp.utils import (
    capturing_on,
    data_checks_enabled,
    empty,
    poison_,
    poison_enabled,
    validation_mode,
)

__all__ = [
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_reference",
    "TargetOutOfRangeError",
    "RankMismatchError",
    "REDUCTIONS",
]

_BACKENDS = ("triton", "reference")
_CHECKED = CheckedKeys()

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
    """``[world, rows + 2, 3]``: every rank's ``stats`` (one collective, also with 0 rows),
    after the agreement check on the row count (the ranks' sizes must match)."""
    group = resolve_group_name(group_name)
    world = dist.get_world_size(group)
    rows = (stats.shape[0] - META_ROWS, stats.shape[1])
    check_collective("vocab_parallel_cross_entropy", stats, group, shape=rows)
    gathered = torch.empty((world, *stats.shape), dtype=stats.dtype, device=stats.device)
    dist.all_gather(list(gathered.unbind(0)), stats, group=group)
    return gathered


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


def _kernel_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` (or a contiguous copy) and its row layout, as the kernels read it."""
    layout = kernels.row_layout(t) if (t.stride(-1) == 1 or t.shape[-1] == 1) else None
    if layout is None:
        t = t.contiguous()
        layout = kernels.row_layout(t)
    return t, layout


def _new_grad(logits: torch.Tensor) -> torch.Tensor:
    """A gradient buffer with ``logits``' strides when it is dense (the same row alignment;
    ``empty_like`` keeps the layout of a dense permutation and is contiguous otherwise)."""
    out = torch.empty_like(logits)
    return poison_(out) if poison_enabled() else out


def _forward(
    logits, target, grad, label_smoothing, ignore_index, z_loss_weight, vocab_start,
    vocab_size, group_name, world_size, reduction, check, backend,
):  # fmt: skip
    """Loss and info; the gradient goes into ``grad`` when given."""
    if backend != "triton" and backend != "reference":  # the public function resolved it
        backend = resolve_backend("vocab_parallel_cross_entropy", backend, logits.device,
                                  _BACKENDS)  # fmt: skip
    rank = vocab_start // logits.shape[-1] if group_name else 0
    target1 = target
    if target.dim() != 1 or not target.is_contiguous():
        target1 = target.reshape(-1).contiguous()
    if backend == "reference":
        loss, g, info = reference_forward(
            logits, target1, label_smoothing, ignore_index, z_loss_weight, vocab_start,
            vocab_size, group_name, rank, reduction, grad is not None, _all_gather_stats,
        )  # fmt: skip
        if grad is not None:
            grad.copy_(g)
        return loss.reshape(target.shape) if reduction == "none" else loss, info

    device = logits.device
    loss_shape = target.shape if reduction == "none" else ()
    loss = empty(loss_shape, dtype=torch.float32, device=device)
    info = empty((world_size + 1, kernels.INFO_COLS), dtype=torch.int32, device=device)
    logits, layout = _kernel_view(logits)
    grad_view, grad_layout = (None, None) if grad is None else _kernel_view(grad)
    common = dict(label_smoothing=label_smoothing, ignore_index=ignore_index)
    if not group_name:
        kernels.cross_entropy_fused(
            logits, layout, target1, loss, info, grad=grad_view, grad_layout=grad_layout,
            z_loss_weight=z_loss_weight, reduction=reduction, check=check, **common,
        )  # fmt: skip
    else:
        stats = empty((target1.numel() + kernels.META_ROWS, kernels.NUM_STATS),
                      dtype=torch.float32, device=device)  # fmt: skip
        kernels.cross_entropy_stats(
            logits, layout, target1, stats, vocab_start=vocab_start, vocab_size=vocab_size,
            **common,
        )  # fmt: skip
        kernels.cross_entropy_finish(
            _all_gather_stats(stats, group_name), logits, layout, target1, loss, info,
            rank=rank, grad=grad_view, grad_layout=grad_layout, vocab_start=vocab_start,
            vocab_size=vocab_size, z_loss_weight=z_loss_weight, reduction=reduction, **common,
        )  # fmt: skip
    if grad is not None and grad_view is not grad:
        grad.copy_(grad_view)
    return loss, info


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
    world_size: int,
    reduction: str,
    compute_grad: bool,
    check: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ce(
        logits, target, label_smoothing, ignore_index, z_loss_weight, vocab_start, vocab_size,
        group_name, world_size, reduction, compute_grad, check, backend,
    )  # fmt: skip


def _ce(logits, target, label_smoothing, ignore_index, z_loss_weight, vocab_start, vocab_size,
        group_name, world_size, reduction, compute_grad, check, backend):  # fmt: skip
    """The body of ``mtp::vocab_parallel_cross_entropy`` (the eager path calls it directly)."""
    grad = _new_grad(logits) if compute_grad else logits.new_empty(0)
    loss, info = _forward(
        logits, target, grad if compute_grad else None, label_smoothing, ignore_index,
        z_loss_weight, vocab_start, vocab_size, group_name, world_size, reduction, check, backend,
    )  # fmt: skip
    return loss, grad, info


@_ce_op.register_fake
def _(logits, target, eps, ii, z, start, size, group, world, reduction, compute_grad, *args):
    return (
        logits.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32),
        logits.new_empty(logits.shape if compute_grad else (0,)),
        logits.new_empty((world + 1, 4), dtype=torch.int32),
    )


@torch.library.custom_op("mtp::vocab_parallel_cross_entropy_", mutates_args=("logits",))
def _ce_inplace_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    vocab_start: int,
    vocab_size: int,
    group_name: str,
    world_size: int,
    reduction: str,
    check: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(
        logits, target, logits, label_smoothing, ignore_index, z_loss_weight, vocab_start,
        vocab_size, group_name, world_size, reduction, check, backend,
    )  # fmt: skip


@_ce_inplace_op.register_fake
def _(logits, target, eps, ii, z, start, size, group, world, reduction, *args):
    return (
        logits.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32),
        logits.new_empty((world + 1, 4), dtype=torch.int32),
    )


@torch.library.custom_op("mtp::vocab_parallel_cross_entropy_scale_", mutates_args=("grad",))
def _ce_scale_op(grad: torch.Tensor, dloss: torch.Tensor, backend: str) -> None:
    """``grad[..., :] *= dloss[...]`` (``dloss``: the loss's shape, fp32)."""
    _scale(grad, dloss, backend)


def _scale(grad: torch.Tensor, dloss: torch.Tensor, backend: str) -> None:
    """The body of ``mtp::vocab_parallel_cross_entropy_scale_``."""
    backend = resolve_backend("vocab_parallel_cross_entropy", backend, grad.device, _BACKENDS)
    if backend == "reference":
        grad.mul_(dloss.unsqueeze(-1).to(grad.dtype) if dloss.dim() else dloss.to(grad.dtype))
        return
    view, layout = _kernel_view(grad)
    kernels.cross_entropy_scale(view, layout, dloss.reshape(-1) if dloss.dim() else dloss)
    if view is not grad:
        grad.copy_(view)


@_ce_scale_op.register_fake
def _(grad, dloss, backend):
    return None


class _CrossEntropyFunction(torch.autograd.Function):
    """Forward writes the gradient (for a unit upstream gradient); backward scales it in place.

    Saves one tensor: the gradient buffer (``logits`` itself with ``inplace_backward``).
    """

    @staticmethod
    def forward(ctx, logits, target, options):
        args, inplace, backend, direct = options
        if inplace:
            if direct:  # the custom op's mutation, version bump included
                loss, info = _forward(logits, target, logits, *args, backend)
                increment_version(logits)
            else:
                loss, info = torch.ops.mtp.vocab_parallel_cross_entropy_(
                    logits, target, *args, backend
                )
            grad = logits
        else:
            op = _ce if direct else torch.ops.mtp.vocab_parallel_cross_entropy
            loss, grad, info = op(logits, target, *args[:-1], True, args[-1], backend)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(info)
        ctx.set_materialize_grads(False)
        ctx.backend = backend
        return loss, info

    @staticmethod
    def backward(ctx, dloss, _dinfo):
        (grad,) = ctx.saved_tensors
        if dloss is None:
            return None, None, None
        # A second backward through the same graph (retain_graph=True) fails in autograd's
        # version check of ``grad``: it was scaled in place by the first one.
        if eager(grad, dloss):  # as the custom op: in place, version bumped
            _scale(grad, dloss, ctx.backend)
            increment_version(grad)
        else:
            torch.ops.mtp.vocab_parallel_cross_entropy_scale_(grad, dloss, ctx.backend)
        return grad, None, None


_APPLY = autograd_apply(_CrossEntropyFunction)  # the eager path's (C) apply


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


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
    validate: bool | str = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of logits split over the vocab, fused (the gradient is written while the
    logits are read in the forward).

    Equal to ``F.cross_entropy(full_logits.float(), target, label_smoothing=..., ignore_index=...,
    reduction=...) + z_loss_weight * lse**2`` (per row, before the reduction), where
    ``full_logits`` is the concatenation of every rank's shard along the last dim and ``lse`` is
    its log-sum-exp. Label smoothing spreads ``label_smoothing`` over the *global* vocab, so
    every rank computes the same loss (unlike Megatron-LM's shard-local smoothing).

    Args:
        logits: this rank's shard ``[..., Vl]`` (fp32 / fp16 / bf16) of a vocab of
            ``V = Vl * group_size`` ids; rank ``r`` holds ids ``[r*Vl, (r+1)*Vl)``; every rank
            holds the same ``Vl`` (uneven shards are rejected, see Raises). Any leading dims
            (strided leading dims are read in place; the last dim should be contiguous).
        target: ``[...]`` (``logits.shape[:-1]``) int64 / int32 global ids in ``[0, V)`` or
            ``ignore_index``; the same on every rank of ``group``.
        group: the tensor-parallel group the vocab is split over; None (or a group of size 1)
            is ordinary fused cross-entropy.
        label_smoothing: in ``[0, 1]``, as in ``F.cross_entropy``.
        ignore_index: rows with this target get loss 0 and gradient 0.
        reduction: ``"none"`` (per-row loss, ``target``'s shape), ``"sum"`` or ``"mean"`` (over
            the non-ignored rows, computed in the kernel; NaN when every row is ignored, as in
            PyTorch).
        z_loss_weight: adds ``z_loss_weight * lse**2`` per row (PaLM's z-loss), with its gradient.
        inplace_backward: the forward writes the gradient into ``logits`` (saves one
            logits-sized buffer; ``logits`` holds the gradient after the call and must not be
            needed afterwards; ``logits`` with overlapping elements, e.g. ``expand``-ed, are
            rejected).
        validate: the data checks (targets in range; with a group, same targets and shard size
            on every rank). ``True``: on the device, no host sync (``torch._assert_async``: a
            device-side assert on CUDA, a ``RuntimeError`` at once on CPU); ``"sync"`` (or
            ``MTP_VALIDATE=sync``): a typed error after one host sync; ``False``: off. Skipped
            while tracing, compiling or capturing a CUDA graph.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        The loss in float32: ``target``'s shape for ``"none"``, a scalar otherwise.

    Launches (triton): one rank: 1 kernel forward (+1 ``_assert_async`` with the default
    ``validate``), 1 kernel backward (it returns at once where the upstream gradient is 1).
    With a group: 2 kernels, the agreement row (an ``all_gather`` of 14 int64 per rank and its
    device-side comparison) and one ``all_gather`` of ``3 * (rows + 2)`` fp32 per rank forward,
    1 kernel and no communication backward.
    Memory: when ``logits`` requires grad, the forward allocates the gradient (``logits``' shape
    and dtype; none with ``inplace_backward``), which autograd keeps until the backward; that
    is the only tensor saved (the logits are not).
    Bytes moved: without grad, the shard once (``rows * Vl * s``); with grad, one read of the
    shard and one write of the gradient (the second read of a row is by the same program, a
    cache hit), plus one more read of the shard with a group; ``O(rows)`` besides.

    Raises:
        TypeError / ValueError: bad arguments (named in the message).
        TargetOutOfRangeError: (``validate="sync"``) a target outside ``[0, V)`` other than
            ``ignore_index``.
        RankMismatchError: the row count differs between the ranks of ``group`` (on CPU, or
            with ``validate="sync"``; a device-side assert on CUDA by default), or
            (``validate="sync"``) the target or the shard size does (raised on every rank).
        NotImplementedError: called inside a ``torch.func`` transform.
    """
    direct = eager(logits, target)
    key = (logits.shape, logits.dtype, logits.device, target.shape, target.dtype, target.device,
           label_smoothing, ignore_index, reduction, z_loss_weight) if direct else None
    if key is None or key not in _CHECKED:
        check_args(logits, target, label_smoothing, ignore_index, reduction, z_loss_weight)
        check_transforms(logits)
        if key is not None:
            _CHECKED.add(key)
    group_name, rank, world = _group_info(group)
    backend = resolve_backend("vocab_parallel_cross_entropy", backend, logits.device, _BACKENDS)
    v_local = logits.shape[-1]
    vocab_size = v_local * world
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace_backward and compute_grad and any(
        st == 0 and sz > 1 for st, sz in zip(logits.stride(), logits.shape)
    ):
        raise ValueError(
            "inplace_backward=True writes the gradient into logits, but logits has overlapping "
            f"elements (shape {tuple(logits.shape)}, strides {logits.stride()}: an expanded "
            "tensor); pass inplace_backward=False or logits.contiguous()"
        )
    if backend == "triton":
        logits, _ = _kernel_view(logits)  # a copy only if the rows need more than two strides
    mode = validation_mode(validate)  # a bad value raises here, naming the argument
    if mode == "off":
        check = False
    else:  # the eager path knows nothing traces: only a graph capture turns the check off
        check = not capturing_on(logits) if direct else data_checks_enabled(mode, target)
    args = (
        float(label_smoothing), int(ignore_index), float(z_loss_weight), rank * v_local,
        vocab_size, group_name, world, reduction, check,
    )  # fmt: skip
    if compute_grad:
        apply = _APPLY if direct else _CrossEntropyFunction.apply
        loss, info = apply(logits, target, (args, bool(inplace_backward), backend, direct))
    else:
        op = _ce if direct else torch.ops.mtp.vocab_parallel_cross_entropy
        loss, _, info = op(logits, target, *args[:-1], False, check, backend)
    if check:
        check_info(info, target, ignore_index, vocab_size, world, mode)
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
