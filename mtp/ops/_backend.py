"""Backend choice shared by every op."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from mtp.kernels._common import interpreting


def resolve_backend(
    op: str, backend: str, device: torch.device, choices: Sequence[str]
) -> str:
    """Turn an op's ``backend`` argument into a concrete backend name.

    Args:
        op: the op name, for messages (``"bias_gelu"``).
        backend: ``"auto"`` or one of ``choices``.
        device: where the inputs live.
        choices: the concrete backends this op has; must include ``"reference"`` and usually
            ``"triton"``.

    ``"auto"`` first honours ``MTP_BACKEND`` when it names one of ``choices`` (a value that this
    op does not have is ignored, so one variable can steer several ops); otherwise it is
    ``"triton"`` on CUDA and ``"reference"`` elsewhere. The Triton backend on CPU tensors needs
    the interpreter (``TRITON_INTERPRET=1``).

    Raises:
        ValueError: unknown backend, or ``"triton"`` on CPU without the interpreter.
    """
    if not isinstance(backend, str):
        raise TypeError(f"{op}: backend must be a str, got {type(backend).__name__}")
    if backend == "auto":
        env = os.environ.get("MTP_BACKEND", "").strip()
        if env in choices:
            backend = env
        else:
            backend = "triton" if device.type == "cuda" and "triton" in choices else "reference"
    if backend not in choices:
        raise ValueError(
            f"{op}: unknown backend {backend!r}; choose one of {['auto', *choices]}"
        )
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{op}: backend='triton' needs CUDA tensors (got {device}); on CPU use "
            "backend='reference' or set TRITON_INTERPRET=1 to run the kernel in the interpreter"
        )
    return backend
