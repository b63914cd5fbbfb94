"""Structural counts that need no GPU: what one call issues on the host.

:func:`count_ops` records, for the code run inside it,

- every aten op dispatched (also the ones inside mtp's custom ops, which a plain
  ``TorchDispatchMode`` would see as one opaque call), classified as ``compute`` (it would run
  device work), ``view`` (aliases an input: views, no-op ``.to``, ``detach``) or ``alloc``
  (``empty*``: memory only);
- every Triton kernel launch (kernel name and grid), optionally without running the kernel
  (``execute=False``: the launch is recorded and skipped, which makes counting at large expert
  counts cheap under the interpreter; the values computed afterwards are then meaningless);
- host synchronisations, through :func:`mtp.testing.count_host_syncs`.

``device_ops = compute aten ops + Triton launches`` estimates the kernel launches of the same
call on a GPU (an aten op can launch more than one kernel, e.g. a sort; a GPU run counts the
real kernels with the profiler, see :mod:`mtp.bench.timing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Iterator

import torch

__all__ = ["OpCount", "count_ops", "triton_launch_hook"]

_ALLOC_OPS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
    "aten::set_",
    "aten::detach",
    "aten::alias",
}


@dataclasses.dataclass
class OpCount:
    """What :func:`count_ops` saw."""

    aten: Counter = dataclasses.field(default_factory=Counter)  # op name -> calls (all kinds)
    compute: Counter = dataclasses.field(default_factory=Counter)  # op name -> calls
    mtp_ops: Counter = dataclasses.field(default_factory=Counter)  # custom op -> calls
    triton: Counter = dataclasses.field(default_factory=Counter)  # kernel name -> launches
    host_syncs: list[str] = dataclasses.field(default_factory=list)

    @property
    def aten_ops(self) -> int:
        return sum(self.aten.values())

    @property
    def compute_ops(self) -> int:
        return sum(self.compute.values())

    @property
    def triton_launches(self) -> int:
        return sum(self.triton.values())

    @property
    def device_ops(self) -> int:
        return self.compute_ops + self.triton_launches

    def summary(self) -> dict:
        """The figures the reports print (JSON-ready)."""
        return {
            "aten_ops": self.aten_ops,
            "compute_ops": self.compute_ops,
            "triton_launches": self.triton_launches,
            "device_ops": self.device_ops,
            "host_syncs": len(self.host_syncs),
            "mtp_ops": dict(self.mtp_ops),
            "triton_kernels": dict(self.triton),
            "sync_events": list(self.host_syncs),
        }


_state = threading.local()


def _in_kernel() -> bool:
    return getattr(_state, "in_kernel", 0) > 0


@contextlib.contextmanager
def triton_launch_hook(record, execute: bool = True) -> Iterator[None]:
    """Call ``record(kernel_name, grid)`` at every Triton launch in the block.

    Patches ``run`` of ``triton.runtime.jit.JITFunction`` and, when present, of the
    interpreter's ``InterpretedFunction`` (both are what ``kernel[grid](...)`` calls, triton 3.2
    to 3.9). Autotuner benchmarking launches are not counted twice: the hook only counts the
    outermost launch of a call. ``execute=False`` records without running the kernel.
    """
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    saved = [(cls, cls.run) for cls in classes]

    def wrap(original):
        def run(self, *args, grid=None, warmup=False, **kwargs):
            if warmup or _in_kernel():
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            name = getattr(getattr(self, "fn", None), "__name__", type(self).__name__)
            record(name, grid)
            if not execute:
                return None
            _state.in_kernel = getattr(_state, "in_kernel", 0) + 1
            try:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                _state.in_kernel -= 1

        return run

    for cls, original in saved:
        cls.run = wrap(original)
    try:
        yield
    finally:
        for cls, original in saved:
            cls.run = original


def _custom_op_impl(name: str):
    """The Python implementation of an ``mtp::`` custom op (to count the aten ops inside it)."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - torch without the registry
        return None
    opdef = OPDEFS.get(name)
    return getattr(opdef, "_init_fn", None)


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _aliases_input(out, args) -> bool:
    if not isinstance(out, torch.Tensor):
        return False
    try:
        ptr = out.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return any(
        isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr and ptr != 0
        for a in args
    )


def _classify(func, args, out) -> str:
    name = func._schema.name
    metadata = name.startswith("aten::sym_") or name in ("aten::size", "aten::stride")
    if name in _ALLOC_OPS or metadata:
        return "alloc" if name.startswith("aten::empty") or "new_empty" in name else "view"
    if getattr(func, "is_view", False):
        return "view"
    if not _mutates(func) and _aliases_input(out, args):
        return "view"  # .to()/.contiguous()/reshape() that returned its input
    return "compute"


@contextlib.contextmanager
def count_ops(execute_kernels: bool = True) -> Iterator[OpCount]:
    """Count aten ops, Triton launches and host syncs of the code in the block (see module doc).

    Counting happens below autograd, so a backward run inside the block is counted too.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from mtp.testing import count_host_syncs

    log = OpCount()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _in_kernel():  # the interpreter's own tensor traffic
                return func(*args, **kwargs)
            name = func._schema.name
            if name.startswith("mtp::"):
                log.mtp_ops[name] += 1
                impl = _custom_op_impl(name)
                if impl is not None:
                    with self:
                        return impl(*args, **kwargs)
                log.compute[name] += 1
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            log.aten[name] += 1
            if _classify(func, args, out) == "compute":
                log.compute[name] += 1
            return out

    def record(kernel, grid):
        log.triton[kernel] += 1

    with count_host_syncs() as syncs, triton_launch_hook(record, execute=execute_kernels):
        with _Mode():
            yield log
    log.host_syncs = list(syncs.events)
