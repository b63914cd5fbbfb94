"""Argument and data checks of :func:`mtp.ops.vocab_parallel_cross_entropy`: the argument checks
(once per key on the eager path), the device-side data check of the kernels' status word and the
typed errors ``validate="sync"`` raises."""

from __future__ import annotations

import functools

import torch

from mtp.dtypes import INDEX_DTYPES, KERNEL_FLOATS
from mtp.parallel.agree import agreement
from mtp.utils import check_tensor, validation_mode

__all__ = ["REDUCTIONS", "TargetOutOfRangeError", "check_args", "check_info", "check_transforms"]

_LOGIT_DTYPES = KERNEL_FLOATS
_TARGET_DTYPES = INDEX_DTYPES
REDUCTIONS = ("none", "mean", "sum")


class TargetOutOfRangeError(ValueError, IndexError):
    """A target id is outside ``[0, vocab_size)`` and is not ``ignore_index``.

    A ``ValueError`` (the project's bad-input error) and an ``IndexError`` (what
    ``torch.nn.functional.cross_entropy`` raises for the same mistake).
    """


def check_args(logits, target, label_smoothing, ignore_index, reduction, z_loss_weight) -> None:
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


def _raise_from_info(info, target, ignore_index, vocab_size, world) -> None:
    """``validate="sync"``: the typed error for a failed check (reads ``info`` on the host)."""
    rows = info.tolist()
    if rows[world][0]:
        return
    per_rank = rows[:world]
    for col, name, hint in (
        (0, "vocab shard size", "every rank must hold a vocab shard of the same size (pad the "
         "vocab to a multiple of the tensor-parallel size)"),
        (2, "target checksum", "every tensor-parallel rank must pass the same target"),
    ):  # fmt: skip
        agreement("vocab_parallel_cross_entropy", {name: 0}).check_rows(
            [[row[col]] for row in per_rank], list(range(world)), hint=hint,
            where="tensor-parallel group (ranks numbered in the group)",
        )
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    first = target[bad][0].item() if bool(bad.any()) else "?"
    raise TargetOutOfRangeError(
        f"target holds {int(bad.sum())} id(s) outside [0, {vocab_size}) that are not "
        f"ignore_index={ignore_index} (e.g. {first}); vocab_size is the global vocab "
        "(shard size x group size). Pass validate=False to skip this check."
    )


def check_info(info, target, ignore_index, vocab_size, world, validate) -> None:
    """The data check of the kernels' status word (``info[world, 0]``), for a call whose data
    checks are enabled: a device-side assert, or with ``validate="sync"`` the typed error."""
    if validation_mode(validate) == "sync":
        _raise_from_info(info, target, ignore_index, vocab_size, world)
        return
    torch._assert_async(info[world, 0], _device_message(vocab_size, ignore_index, world > 1))


@functools.lru_cache(maxsize=256)
def _device_message(vocab_size: int, ignore_index: int, grouped: bool) -> str:
    message = (
        f"vocab_parallel_cross_entropy: target holds ids outside [0, {vocab_size}) that are not "
        f"ignore_index={ignore_index}"
    )
    if grouped:
        message += (
            ", or the target or the vocab shard size differs between the tensor-parallel ranks"
        )
    return message + " (validate='sync' or MTP_VALIDATE=sync raises a typed error with the values)"


def check_transforms(logits: torch.Tensor) -> None:
    if torch.compiler.is_compiling():
        return
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise NotImplementedError(
            "vocab_parallel_cross_entropy does not support torch.func transforms (grad, vmap, "
            "jacrev...): its fused kernel computes the gradient during the forward and the "
            "backward scales it in place. Use loss.backward() / torch.autograd.grad, or "
            "torch.nn.functional.cross_entropy inside the transform."
        )
