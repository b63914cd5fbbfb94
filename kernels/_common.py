"""Helpers shared by the Triton launchers (host side only).

Under the Triton interpreter (``TRITON_INTERPRET=1``, used on CPU-only machines) kernels run on
CPU tensors. The interpreter computes ``tl.dot`` on bfloat16 operands wrongly (triton 3.6 to 3.9
return garbage), so launchers pass ``UPCAST_DOT=dot_upcast()`` and kernels cast dot operands to
float32 when it is set. On a GPU it is always False and the tensor-core path is compiled.
"""

import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1``).

    A plain ``os.environ`` read, not ``triton.knobs``: it runs inside ``torch.compile``'d code
    (backend choice), and Dynamo traces ``os.environ`` but not Triton's C ``getenv_bool``."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
