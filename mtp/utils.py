"""Small conventions shared by every op and layer.

- :func:`data_checks_enabled` implements the project rule for data-dependent validation: a check
  that must read tensor values runs by default, is skipped automatically while tracing, compiling
  or capturing a CUDA graph, and is turned off by ``validate=False``.
- :func:`validation_mode` / :func:`check_values` say *how* it runs. The default
  (``validate=True``) never synchronises the host: the condition is checked on the device with
  ``torch._assert_async`` (a device-side assert on CUDA, PyTorch's own convention for
  out-of-range targets and ids; on CPU it raises ``RuntimeError`` at once with the message).
  ``validate="sync"`` (or ``MTP_VALIDATE=sync`` in the environment) reads the condition on the
  host and raises the typed Python error (``ValueError`` and friends), at the cost of one sync:
  for debugging. ``validate=False`` (or ``MTP_VALIDATE=off``) turns data checks off.
- :func:`empty` allocates op outputs. With ``MTP_POISON_OUTPUTS=1`` (the test suite sets it) the
  buffer is filled with NaN (floats) or a large sentinel (integers) so that an element a kernel
  forgot to write cannot pass a test by luck.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

import torch

from mtp import settings
from mtp.dtypes import dtype_name

class _State(threading.local):
    capturing = False  # a class default: no AttributeError raised and caught per lookup


_state = _State()


@contextlib.contextmanager
def simulated_capture() -> Iterator[None]:
    """Behave as if a CUDA graph were being captured (used by ``mtp.testing.assert_graph_safe``).

    Inside this context :func:`data_checks_enabled` returns False, exactly as it does during a
    real ``torch.cuda.graph`` capture, so a graph-safety check sees what a capture would run.
    """
    previous = getattr(_state, "capturing", False)
    _state.capturing = True
    try:
        yield
    finally:
        _state.capturing = previous


def is_fake(t: torch.Tensor) -> bool:
    """True for a FakeTensor or a meta tensor (shape propagation, no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _is_fake_or_traced(t: torch.Tensor) -> bool:
    kind = type(t)
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # the common case, decided at once
        return t.is_meta
    if is_fake(t):
        return True
    # Functional / proxy tensors used by export and AOTAutograd are wrapper subclasses.
    return not isinstance(t, torch.nn.Parameter)


_CUDA: list[bool] = []  # torch.cuda.is_available(), asked once (it reads the environment)


def is_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream, or simulated."""
    if getattr(_state, "capturing", False):
        return True
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
    return _CUDA[0] and torch.cuda.is_current_stream_capturing()


def capturing_on(t: torch.Tensor) -> bool:
    """:func:`is_capturing` for work on ``t``'s device, cheaper: only CUDA streams capture."""
    if getattr(_state, "capturing", False):
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def data_checks_enabled(validate: bool | str, *tensors: torch.Tensor) -> bool:
    """Whether a data-dependent check should run now.

    Args:
        validate: the op's ``validate`` argument; False (or ``"off"``) turns the check off.
        tensors: the tensors the check would read; fake/meta/traced tensors disable it.
    """
    if not validate or validate == "off":
        return False
    if torch.compiler.is_compiling() or is_capturing():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and _is_fake_or_traced(t):
            return False
    return True


def validation_mode(validate: bool | str) -> str:
    """``"device"``, ``"sync"`` or ``"off"`` for an op's ``validate`` argument.

    ``True`` means the ``validate`` setting (``MTP_VALIDATE``, default ``"device"``; see
    :mod:`mtp.settings`); ``False`` is always ``"off"``; a string is taken as it is.
    Raises ``ValueError`` naming ``validate`` for anything else.
    """
    if validate is False:
        return "off"
    if validate is True:
        return settings.current().validate
    if isinstance(validate, str) and validate in ("device", "sync", "off"):
        return validate
    raise ValueError(f"validate must be True, False, 'device', 'sync' or 'off'; got {validate!r}")


def check_values(
    cond: torch.Tensor | None,
    message: str,
    *,
    validate: bool | str,
    error: type[Exception] = ValueError,
    tensors: Sequence[torch.Tensor] = (),
) -> None:
    """Run one data-dependent check under the project's validation rule.

    Args:
        cond: a 0-d bool tensor on the data's device, True when the data is valid. ``None`` (or
            a fake/traced tensor) skips the check.
        message: the error message; it must name the argument.
        validate: the op's ``validate`` argument (see :func:`validation_mode`).
        error: the exception type raised in ``"sync"`` mode.
        tensors: the inputs the condition was computed from (fake/traced ones skip the check).

    Default mode: ``torch._assert_async(cond, message)``, no host sync (device-side assert on
    CUDA; an immediate ``RuntimeError`` carrying ``message`` on CPU). ``"sync"``: ``bool(cond)``
    and ``raise error(message)``.
    """
    mode = validation_mode(validate)
    if mode == "off" or cond is None:
        return
    if not data_checks_enabled(True, cond, *tensors):
        return
    if mode == "sync":
        if not bool(cond):
            raise error(message)
        return
    torch._assert_async(cond, message)


def poison_enabled() -> bool:
    """True when the ``poison_outputs`` setting (``MTP_POISON_OUTPUTS``) asks for poisoned output
    buffers (tests and debugging)."""
    return settings.current().poison_outputs


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no correct kernel writes: NaN, or the dtype's max int."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


def empty(
    shape: Sequence[int] | torch.Size,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """``torch.empty`` for op outputs; poisoned when :func:`poison_enabled`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if settings.current().poison_outputs and not _is_fake_or_traced(out):
        poison_(out)
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`empty` with ``t``'s shape and device (and dtype unless given)."""
    return empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate an op argument; raise ``TypeError``/``ValueError`` naming it.

    Args:
        name: the argument name used in the message (``"logits"``).
        value: the object to check; must be a ``torch.Tensor``.
        ndim: required number of dimensions (an int or a collection of allowed ints).
        dtypes: allowed dtypes.
        device: required device (compared by type and index).

    Returns the tensor, so calls can be chained.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(
                f"{name} must be {want}, got a {value.dim()}-D tensor of shape {tuple(value.shape)}"
            )
    if dtypes is not None and value.dtype not in dtypes:
        want = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({want}), got {dtype_name(value.dtype)}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} must be on {device} (like the other inputs), got {value.device}")
    return value


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """Validate a Python int argument (``bool`` is rejected) that must be ``>= minimum``.

    Raises ``TypeError`` or ``ValueError`` naming the argument; returns the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive(name: str, value: object, allow_none: bool = True) -> float | None:
    """A finite number > 0 (or None when ``allow_none``); raise ``TypeError``/``ValueError``
    naming the argument."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or None, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def qualified_name(obj: object) -> str:
    """``module.QualName`` of ``obj``'s class (of ``obj`` itself when it is a class), for error
    messages: ``torch.nn.modules.linear.Linear``, not ``Linear``, so that classes of the same
    name from different libraries (mtp's and Megatron-Core's ``ColumnParallelLinear``) differ."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
