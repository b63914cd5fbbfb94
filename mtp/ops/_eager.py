"""The eager path shared by every op: when it applies, and checks that run once per key.

Each op is a ``torch.library`` custom op with a fake, which is what ``torch.compile``, FakeTensor
tracing, ``make_fx`` and functorch see. An eager call on plain tensors does not need that layer
(about half of a small op's host time): the public function then runs the op's
``torch.autograd.Function`` (or, when nothing needs a gradient, its implementation) directly, on
the same launchers, so outputs are bit-identical. :func:`eager` says when that is allowed.
"""

from __future__ import annotations

import torch
from torch._C import _is_torch_function_mode_enabled, _len_torch_dispatch_stack
from torch._C._functorch import peek_interpreter_stack

__all__ = ["CheckedKeys", "autograd_apply", "eager", "needs_grad"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling


def eager(*tensors: torch.Tensor | None) -> bool:
    """True when the call may bypass the custom op: not compiling or tracing (Dynamo, a
    dispatch or torch-function mode such as FakeTensorMode or ``make_fx``, a functorch
    transform) and every tensor a plain ``torch.Tensor`` with data (no subclass such as DTensor
    or FakeTensor, no meta tensor: those take the custom op and its fake)."""
    if _is_compiling() or _len_torch_dispatch_stack() or _is_torch_function_mode_enabled():
        return False
    if peek_interpreter_stack() is not None:
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd records this call (grad mode on and an input requires grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


class CheckedKeys:
    """Keys whose argument checks passed: the checks depend only on the key (shapes, dtypes,
    devices, options), so they run once per key. Bounded: forgotten wholesale past ``limit``."""

    __slots__ = ("keys", "limit")

    def __init__(self, limit: int = 4096):
        self.keys: set = set()
        self.limit = limit

    def __contains__(self, key) -> bool:
        return key in self.keys

    def add(self, key) -> None:
        if len(self.keys) >= self.limit:
            self.keys.clear()
        self.keys.add(key)


def autograd_apply(function: type) -> object:
    """``function.apply`` (a ``torch.autograd.Function``) for the eager path: autograd's own
    (C) apply. The Python layer of ``Function.apply`` binds ``setup_context``'s arguments (not
    defined here) and unwraps functorch's dead wrappers for its transforms, which :func:`eager`
    rules out; it costs ~2 us a call. Falls back to ``function.apply`` where either differs."""
    base = getattr(torch._C, "_FunctionBase", None)
    plain = function.setup_context is torch.autograd.Function.setup_context
    if base is None or not plain or "apply" not in base.__dict__:
        return function.apply
    return base.__dict__["apply"].__get__(None, function)
