"""Launch plans: a kernel's compiled build bound to its grid and constexprs (host side only).

``kernel[grid](*args, **constexprs)`` re-derives on every call what Triton specialises on
(dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), parses the options and looks
the build up by a string key: ~12 us of host time per launch where the launch itself costs ~4.
A launcher instead keeps a :class:`Launch` per key that covers everything the build depends on
(the shapes and strides its integer arguments come from, dtypes, :func:`aligned` of its
pointers, the values it passes as constexpr, the device) and calls it with the runtime
arguments only: the compiled kernel's own launcher runs, nothing else.

Under the interpreter (or :func:`set_direct`) a :class:`Launch` is
``kernel[grid](*args, **constexprs)``. With
:func:`set_verify` on (the tests), every call also asks Triton which build it would have used
and raises when it is not the cached one: a key that misses a specialisation fails loudly.
"""

from __future__ import annotations

import weakref

from triton import knobs
from triton.runtime import driver

from mtp.kernels._common import interpreting

__all__ = ["Launch", "Plans", "aligned", "set_direct", "set_verify"]

_VERIFY = [False]
_DIRECT = [False]
_ALL_PLANS: list[weakref.ref] = []  # every Plans made (module-level caches: a few dozen)
_CHAIN = getattr(knobs, "HookChain", None)  # newer Tritons: launch hooks are chains


def set_verify(on: bool) -> None:
    """Check every cached launch against Triton's own build choice (slow; tests only)."""
    _VERIFY[0] = bool(on)


def set_direct(on: bool) -> None:
    """Every launch through ``kernel[grid]`` (for tools that intercept it, e.g. compile-only
    builds for another GPU); every plan is forgotten, so none built in the other mode stays."""
    _DIRECT[0] = bool(on)
    for ref in _ALL_PLANS:
        plans = ref()
        if plans is not None:
            plans.clear()


def aligned(*tensors) -> int:
    """A bit per tensor: set when its address is a multiple of 16 bytes (Triton specialises
    pointers on it). None counts as aligned."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is None or not t.data_ptr() & 15:
            bits |= 1 << i
    return bits


class Launch:
    """One build of ``kernel`` for one grid: ``launch(*args)`` runs it on the runtime arguments
    (the kernel's leading, non-constexpr parameters, in order)."""

    __slots__ = ("kernel", "grid", "kwargs", "compiled", "run", "function", "packed", "consts")

    def __init__(self, kernel, grid: tuple, args: tuple, kwargs: dict):
        self.kernel, self.kwargs = kernel, kwargs
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.compiled = None
        if interpreting() or _DIRECT[0]:
            return
        self.consts = _trailing_constants(kernel, len(args), kwargs)
        self.compiled = kernel.warmup(*args, grid=self.grid, **kwargs)
        if self.compiled is None:  # a jit_cache_hook declined the compile (compile-only tools)
            return  # every call then goes through ``kernel[grid]``, as the hook expects
        self.run = self.compiled.run  # loads the binary and builds Triton's launcher once
        self.function = self.compiled.function
        self.packed = self.compiled.packed_metadata

    def __call__(self, *args) -> None:
        if self.compiled is None:
            self.kernel[self.grid](*args, **self.kwargs)
            return
        if _VERIFY[0]:
            self._verify(args)
        active = driver.active
        stream = active.get_current_stream(active.get_current_device())
        full = (*args, *self.consts)
        g0, g1, g2 = self.grid
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # Newer Tritons hold empty hook chains: no launch metadata, no calls into them.
        if ((enter is None or enter.__class__ is _CHAIN and not enter.calls)
                and (leave is None or leave.__class__ is _CHAIN and not leave.calls)):
            self.run(g0, g1, g2, stream, self.function, self.packed, None, None, None, *full)
            return
        meta = None if enter is None else self.compiled.launch_metadata(self.grid, stream, *full)
        self.run(g0, g1, g2, stream, self.function, self.packed, meta, enter, leave, *full)

    def _verify(self, args: tuple) -> None:
        build = self.kernel.warmup(*args, grid=self.grid, **self.kwargs)
        if build is not self.compiled:
            raise RuntimeError(
                f"launch plan of {self.kernel.fn.__name__}: its key misses a specialisation "
                "Triton makes on these arguments (a different build would run)"
            )


def _trailing_constants(kernel, n_args: int, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after the first ``n_args``: constexprs from
    ``kwargs`` or their defaults (what ``kernel[grid]`` passes to the compiled launcher)."""
    name = kernel.fn.__name__
    consts = []
    for param in kernel.params[n_args:]:
        if not param.is_constexpr:
            raise TypeError(
                f"{name}: runtime parameter {param.name} must be passed positionally, before "
                "the constexprs"
            )
        if param.name in kwargs:
            consts.append(kwargs[param.name])
        elif param.has_default:
            consts.append(param.default)
        else:
            raise TypeError(f"{name}: constexpr {param.name} is neither passed nor defaulted")
    return tuple(consts)


class Plans(dict):
    """Launches by key, forgotten wholesale past ``limit`` entries (shapes that never repeat
    must not grow it without bound)."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit
        _ALL_PLANS.append(weakref.ref(self))

    def add(self, key, launch):
        if len(self) >= self.limit:
            self.clear()
        self[key] = launch
        return launch

    def run(self, key, kernel, grid, args: tuple, options) -> None:
        """Launch ``kernel`` on ``args`` through the plan of ``key``, built the first time from
        ``grid`` and ``options()`` (a callable: the constexprs and launch options are only
        assembled when the plan is built)."""
        launch = self.get(key)
        if launch is None:
            launch = self.add(key, Launch(kernel, grid, args, options()))
        launch(*args)
