"""Backend choice shared by every op: what ``backend="auto"`` means (one rule, documented per op
in :data:`mtp.settings.AUTO_BACKENDS` and ``docs/settings.md``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtp import settings
from mtp.kernels._common import gpu_like, launchable


def auto_backend(choices: Sequence[str], device: torch.device, reference: str = "reference") -> str:
    """The backend ``"auto"`` picks among ``choices`` for inputs on ``device``.

    The ``backend`` setting (``MTP_BACKEND``) when it names one of ``choices`` (``"reference"``
    meaning this op's plain-PyTorch backend, ``reference``; a value this op does not have is
    ignored, so one variable can steer several ops); otherwise ``"triton"`` on CUDA when the op
    has it, and ``reference`` elsewhere.
    """
    wanted = settings.current().backend
    if wanted == "reference":
        wanted = reference
    if wanted in choices:
        return wanted
    return "triton" if gpu_like(device) and "triton" in choices else reference


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

    ``"auto"`` is :func:`auto_backend`. The Triton backend on CPU tensors needs the interpreter
    (``TRITON_INTERPRET=1``).

    Raises:
        ValueError: unknown backend, or ``"triton"`` on CPU without the interpreter.
    """
    if not isinstance(backend, str):
        raise TypeError(f"{op}: backend must be a str, got {type(backend).__name__}")
    if backend == "auto":
        backend = auto_backend(choices, device)
    if backend not in choices:
        raise ValueError(
            f"{op}: unknown backend {backend!r}; choose one of {['auto', *choices]}"
        )
    if backend == "triton" and not launchable(device):
        raise ValueError(
            f"{op}: backend='triton' needs CUDA tensors (got {device}); on CPU use "
            "backend='reference', or set TRITON_INTERPRET=1 before importing mtp to run the "
            "kernel in the interpreter"
        )
    return backend
