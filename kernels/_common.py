"""Helpers shared by the Triton launchers (host side only).

Under the Triton interpreter (``TRITON_INTERPRET=1``, used on CPU-only machines) kernels run on
CPU tensors. The interpreter computes ``tl.dot`` on bfloat16 operands wrongly (triton 3.6 to 3.9
return garbage), so launchers pass ``UPCAST_DOT=dot_upcast()`` and kernels cast dot operands to
float32 when it is set. On a GPU it is always False and the tensor-core path is compiled.
"""

import os

import torch


# Read once: Triton itself decides at decoration time (import) whether kernels are interpreted,
# and an environment read must not run per call or under a trace.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_NULL_GPU = [False]


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` when this module
    was imported, which is when Triton decorated the kernels)."""
    return _INTERPRET


def set_null_gpu(on: bool) -> None:
    """Treat CPU tensors as a GPU's (:mod:`mtp.testing.null_gpu`, the host-cost stand-in)."""
    _NULL_GPU[0] = bool(on)


def gpu_like(device: torch.device) -> bool:
    """True for tensors compiled kernels are launched on: CUDA, or CPU under the null-GPU
    stand-in. Launchers choose their GPU configs (persistent grids, tiles) on these."""
    return device.type == "cuda" or _NULL_GPU[0]


def launchable(device: torch.device) -> bool:
    """True when Triton kernels can run on tensors of ``device``: :func:`gpu_like`, or any
    device under the interpreter."""
    return _INTERPRET or device.type == "cuda" or _NULL_GPU[0]


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels must cast ``tl.dot`` operands of ``dtype`` to fp32 (interpreter bf16 bug)."""
    return interpreting() and dtype == torch.bfloat16


def fp32_dot_precision() -> str:
    """``tl.dot`` input precision for fp32 operands, following PyTorch's TF32 setting.

    PyTorch computes fp32 matmuls in full precision unless the user allowed TF32
    (``torch.backends.cuda.matmul.allow_tf32``); the kernels follow the same switch.
    """
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
