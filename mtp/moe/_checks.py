"""Constructor-argument checks shared by the MoE modules (clear errors naming the argument)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.utils import check_positive, qualified_name

__all__ = ["check_bool", "check_device", "check_float_dtype", "check_group", "check_positive"]


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_device(name: str, value) -> torch.device | None:
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name} must be a torch.device or device string, got {value!r}") from exc


def check_float_dtype(name: str, value, allow_none: bool = False) -> torch.dtype | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {value!r}")
    return value


def check_group(name: str, value) -> None:
    if value is not None and not isinstance(value, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None, got {qualified_name(value)}"
        )
