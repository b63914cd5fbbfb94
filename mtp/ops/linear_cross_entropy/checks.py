"""Argument checks of :func:`mtp.ops.linear_cross_entropy` (types, shapes, dtypes, devices,
the scalar options: free, always on), the target range check (on the device, or typed after a
sync) and the choice of its backend."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mtp.dtypes import FLOATS, INDEX_DTYPES
from mtp.kernels._common import launchable
from mtp.ops._backend import auto_backend
from mtp.ops.cross_entropy import TargetOutOfRangeError
from mtp.utils import check_tensor, check_values, data_checks_enabled, validation_mode

__all__ = [
    "BACKENDS",
    "REDUCTIONS",
    "TRITON_BACKENDS",
    "check_args",
    "check_status",
    "check_targets",
    "resolve_backend",
]

REDUCTIONS = ("none", "mean", "sum")
#: ``"reference"`` is the plain-PyTorch backend, ``"torch"``, under the name every op has.
BACKENDS = ("auto", "triton", "fused", "torch", "reference")
#: The backends whose loss maths are Triton kernels.
TRITON_BACKENDS = ("triton", "fused")
_DTYPES = FLOATS
_TARGET_DTYPES = INDEX_DTYPES


def resolve_backend(backend, hidden: torch.Tensor) -> str:
    """``"triton"``, ``"fused"`` or ``"torch"`` for ``backend`` (see
    :func:`mtp.ops.linear_cross_entropy`; ``"reference"`` is ``"torch"``)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "reference":
        return "torch"
    fp64 = hidden.dtype == torch.float64
    if backend == "auto":
        backend = auto_backend(BACKENDS[1:], hidden.device, reference="torch")
        if fp64:
            return "torch"
    if backend in TRITON_BACKENDS and fp64:
        raise ValueError(
            f"backend={backend!r} takes fp32 / fp16 / bf16 inputs; fp64 needs 'reference' "
            "('torch')"
        )
    if backend in TRITON_BACKENDS and not launchable(hidden.device):
        raise ValueError(
            f"backend={backend!r} needs CUDA tensors; on CPU use backend='reference' ('torch'), "
            "or set TRITON_INTERPRET=1 before importing mtp to run the kernels in the interpreter"
        )
    return backend


def check_args(hidden, weight, target, bias, group, sp, eps, ignore_index, z, reduction, chunk):
    check_tensor("hidden", hidden, dtypes=_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., H] with H = weight.shape[1] = {weight.shape[1]}, got shape "
            f"{tuple(hidden.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocab row (its shape is [V/tp, H])")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(hidden.dtype,), device=hidden.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
        raise TypeError(f"target must hold class indices (int64 or int32), got {target.dtype}")
    check_tensor("target", target, dtypes=_TARGET_DTYPES, device=hidden.device)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {group!r}")
    world = 1 if group is None else dist.get_world_size(group)
    lead = tuple(hidden.shape[:-1])
    want = lead if not (sp and world > 1) else ((lead[0] * world,) + lead[1:] if lead else None)
    if want is None or tuple(target.shape) != want:
        extra = " (sequence_parallel: hidden's first dim is this rank's chunk)" if sp else ""
        raise ValueError(
            f"target must have shape {want} for hidden of shape {tuple(hidden.shape)}{extra}, "
            f"got {tuple(target.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {eps!r}")
    if not isinstance(z, (int, float)) or isinstance(z, bool) or not 0.0 <= z < float("inf"):
        raise ValueError(f"z_loss_weight must be a finite float >= 0, got {z!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk!r}")
    if not isinstance(sp, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sp!r}")


def check_targets(t, vocab, ignore_index: int, validate, local_vocab: int | None) -> None:
    """Every id of ``t`` (flat) in ``[0, vocab)`` or ``ignore_index`` (``vocab``: the global
    vocab size, an int or 0-d on ``t``'s device; ``local_vocab``: the same as an int when known
    without a sync, one rank). On the device by default; ``validate="sync"``:
    :class:`TargetOutOfRangeError` naming the vocab size and a bad id."""
    in_range = (t == ignore_index) | ((t >= 0) & (t < vocab))
    if validation_mode(validate) == "sync":
        if data_checks_enabled(validate, t) and not bool(in_range.all()):
            raise TargetOutOfRangeError(_out_of_range(t[~in_range], int(vocab), ignore_index))
        return
    check_values(in_range.all(), _device_message(ignore_index, local_vocab), validate=validate,
                 tensors=(t,))  # fmt: skip


def check_status(status, t, vocab, ignore_index: int, validate, local_vocab: int | None) -> None:
    """The target check of the Triton backends: ``status`` (int32 0-d) holds the number of
    valid targets the kernels found outside ``[0, vocab)``. ``validate``: ``"device"`` (one
    ``_assert_async``, no host sync) or ``"sync"`` (a host sync, then :func:`check_targets`'
    typed error when it is not 0); the caller has decided that the check runs."""
    if validate == "sync":
        if int(status):
            check_targets(t, vocab, ignore_index, validate, local_vocab)
        return
    torch._assert_async(status == 0, _device_message(ignore_index, local_vocab))


@functools.lru_cache(maxsize=64)
def _device_message(ignore_index: int, local_vocab: int | None) -> str:
    size = "vocab_size" if local_vocab is None else str(local_vocab)
    return (
        f"linear_cross_entropy: target holds ids outside [0, {size}) that are not "
        f"ignore_index={ignore_index} (the vocab size is the global vocab: the sum of the "
        "ranks' weight rows)"
    )


def _out_of_range(bad: torch.Tensor, vocab: int, ignore_index: int) -> str:
    return (
        f"linear_cross_entropy: target holds {bad.numel()} id(s) outside [0, {vocab}) that are "
        f"not ignore_index={ignore_index} (e.g. {int(bad[0])}); the vocab size {vocab} is the "
        "global vocab: the sum of the ranks' weight rows. Pass validate=False to skip this check."
    )
