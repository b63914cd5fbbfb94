"""The dtype table: which dtypes mtp's ops take, and the int codes ranks exchange for them.

- :data:`KERNEL_FLOATS`: float32, float16, bfloat16, what the fused kernels compute on (fp32
  accumulation).
- :data:`FLOATS`: those and float64, what the plain-PyTorch paths (references, the ops whose
  reference backend is their CPU path) take.
- :data:`INDEX_DTYPES`: int32, int64, for counts, ids and targets.
- :data:`WIRE_DTYPES`, :func:`dtype_code`, :func:`dtype_from_code`: a stable int per dtype
  (1-based, 0 for a dtype not in the table), the same on every rank and in every release, for
  metadata that travels in collectives.
"""

from __future__ import annotations

import torch

__all__ = [
    "KERNEL_FLOATS",
    "FLOATS",
    "INDEX_DTYPES",
    "WIRE_DTYPE_NAMES",
    "dtype_code",
    "dtype_from_code",
    "dtype_name",
]

KERNEL_FLOATS: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
FLOATS: tuple[torch.dtype, ...] = (*KERNEL_FLOATS, torch.float64)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)

#: The code of a dtype is its position here plus one. Append only: codes must not change.
WIRE_DTYPE_NAMES: tuple[str, ...] = (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
    "uint64", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
_CODE = {getattr(torch, n): i + 1 for i, n in enumerate(WIRE_DTYPE_NAMES) if hasattr(torch, n)}


def dtype_code(dtype: torch.dtype) -> int:
    """The stable int of ``dtype`` (0 when it is not in :data:`WIRE_DTYPE_NAMES`)."""
    return _CODE.get(dtype, 0)


def dtype_from_code(code: int) -> torch.dtype | None:
    """The dtype of ``code`` (None for 0, an unknown code or a dtype this torch lacks)."""
    if 0 < code <= len(WIRE_DTYPE_NAMES):
        return getattr(torch, WIRE_DTYPE_NAMES[code - 1], None)
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")
