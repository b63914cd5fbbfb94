"""Byte-traffic instrument: what one call moves through memory, counted by address (no GPU).

:func:`count_traffic` runs a block of code and records, for every Triton launch made under the
interpreter (``TRITON_INTERPRET=1``), the bytes each program reads and writes -- the addresses
of the active (masked-in) lanes of every ``tl.load`` / ``tl.store`` / atomic, expanded to bytes
-- plus the bytes of the aten ops the call runs on the device, the launch and aten-op counts
and the host syncs. It is the CPU stand-in for "how close is this op to its HBM byte floor".

Two granularities:

- **per program** (``bytes_program``): the unique bytes of each program, summed over the
  programs of a launch. A byte read by two programs (or by two launches) counts twice: that is
  what a GPU pays when the data is not reused from cache, and what the floor rules of
  ARCHITECTURE.md ("a re-read by another program or another launch counts again") use.
- **per launch** (``bytes_launch``): the unique bytes of each launch, summed over launches
  (what an ideal cache would give).

Aten ops that do device work (not views, not ``empty*``; ``_assert_async`` counts: it is a
kernel on CUDA) count the ``nbytes`` of their tensor
inputs (read) and outputs (written); ops that only write their output argument (``fill_``,
``zero_``, ``copy_`` destination) count it as written only.

Example::

    from mtp.testing.traffic import count_traffic

    with count_traffic() as t:
        loss = op(x, y); loss.backward()
    print(t.ratio(floor_bytes), t.launches, t.aten_ops, t.host_syncs)

API (stable; other branches use it):

- ``count_traffic(execute=True) -> Traffic`` context manager.
- ``Traffic``: ``launches`` (list of :class:`LaunchTraffic`), ``aten`` (list of
  :class:`AtenTraffic`, device-work ops only), ``host_syncs`` (list of event names);
  properties ``bytes_program`` / ``bytes_launch`` / ``bytes_read`` / ``bytes_written`` /
  ``aten_bytes`` / ``num_launches`` / ``num_aten_ops`` / ``device_ops`` (launches + aten ops) /
  ``num_host_syncs``; ``ratio(floor, per="program")``; ``summary(floor=None)`` (JSON-ready);
  ``by_kernel()``; ``collectives`` (``c10d::`` op names; not counted as aten ops or bytes).
- ``LaunchTraffic``: ``name``, ``grid``, ``programs``, ``read_program``, ``write_program``,
  ``read_launch``, ``write_launch`` (bytes).
- ``AtenTraffic``: ``name``, ``read``, ``write`` (bytes).

Kernels run for real (results are correct) unless ``execute=False`` -- not supported here: bytes
need the kernel to run. Only interpreter launches are measured; a compiled launch on a GPU is
counted as a launch with 0 bytes (``measured=False``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["count_traffic", "Traffic", "LaunchTraffic", "AtenTraffic", "unique_bytes"]


@dataclasses.dataclass
class LaunchTraffic:
    """Bytes of one Triton launch (see the module doc for program vs launch)."""

    name: str
    grid: tuple
    programs: int = 0
    read_program: int = 0
    write_program: int = 0
    read_launch: int = 0
    write_launch: int = 0
    measured: bool = True

    @property
    def bytes_program(self) -> int:
        return self.read_program + self.write_program

    @property
    def bytes_launch(self) -> int:
        return self.read_launch + self.write_launch


@dataclasses.dataclass
class AtenTraffic:
    """Bytes of one aten op that does device work."""

    name: str
    read: int
    write: int


@dataclasses.dataclass
class Traffic:
    """What :func:`count_traffic` saw."""

    launches: list[LaunchTraffic] = dataclasses.field(default_factory=list)
    aten: list[AtenTraffic] = dataclasses.field(default_factory=list)
    host_syncs: list[str] = dataclasses.field(default_factory=list)
    #: ``c10d::`` ops seen by the dispatcher (collectives: not aten ops, not in the bytes).
    collectives: list[str] = dataclasses.field(default_factory=list)

    @property
    def aten_bytes(self) -> int:
        return sum(a.read + a.write for a in self.aten)

    @property
    def bytes_program(self) -> int:
        """Unique bytes per program summed over programs and launches, plus aten bytes."""
        return sum(x.bytes_program for x in self.launches) + self.aten_bytes

    @property
    def bytes_launch(self) -> int:
        """Unique bytes per launch summed over launches, plus aten bytes."""
        return sum(x.bytes_launch for x in self.launches) + self.aten_bytes

    @property
    def bytes_read(self) -> int:
        return sum(x.read_program for x in self.launches) + sum(a.read for a in self.aten)

    @property
    def bytes_written(self) -> int:
        return sum(x.write_program for x in self.launches) + sum(a.write for a in self.aten)

    @property
    def num_launches(self) -> int:
        return len(self.launches)

    @property
    def num_aten_ops(self) -> int:
        return len(self.aten)

    @property
    def device_ops(self) -> int:
        """Triton launches + aten ops that run device work (what a GPU would launch)."""
        return self.num_launches + self.num_aten_ops

    @property
    def num_host_syncs(self) -> int:
        return len(self.host_syncs)

    def ratio(self, floor: float, per: str = "program") -> float:
        """``bytes / floor`` with ``per="program"`` (default) or ``"launch"`` counting."""
        if per not in ("program", "launch"):
            raise ValueError(f"per must be 'program' or 'launch', got {per!r}")
        if floor <= 0:
            raise ValueError(f"floor must be > 0 bytes, got {floor!r}")
        return (self.bytes_program if per == "program" else self.bytes_launch) / floor

    def by_kernel(self) -> dict[str, dict[str, int]]:
        """``{kernel or aten name: {"calls", "read", "write"}}`` (per-program bytes)."""
        out: dict[str, dict[str, int]] = {}
        for x in self.launches:
            d = out.setdefault(x.name, {"calls": 0, "read": 0, "write": 0})
            d["calls"] += 1
            d["read"] += x.read_program
            d["write"] += x.write_program
        for a in self.aten:
            d = out.setdefault(a.name, {"calls": 0, "read": 0, "write": 0})
            d["calls"] += 1
            d["read"] += a.read
            d["write"] += a.write
        return out

    def summary(self, floor: float | None = None) -> dict:
        """The figures reports print (JSON-ready)."""
        out = {
            "bytes_program": self.bytes_program,
            "bytes_launch": self.bytes_launch,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "aten_bytes": self.aten_bytes,
            "triton_launches": self.num_launches,
            "aten_ops": self.num_aten_ops,
            "device_ops": self.device_ops,
            "host_syncs": self.num_host_syncs,
            "kernels": dict(Counter(x.name for x in self.launches)),
            "aten": dict(Counter(a.name for a in self.aten)),
        }
        if floor:
            out["floor_bytes"] = int(floor)
            out["bytes_over_floor"] = round(self.ratio(floor), 4)
            out["bytes_over_floor_launch"] = round(self.ratio(floor, "launch"), 4)
        return out


# --------------------------------------------------------------------------------------------
# Unique bytes of a set of accesses
# --------------------------------------------------------------------------------------------


_Accesses = list[tuple[np.ndarray, int]]


def unique_bytes(accesses: _Accesses) -> tuple[int, _Accesses]:
    """Unique bytes touched by ``accesses`` (``(start addresses uint64, element size)`` pairs).

    Returns ``(count, compact)`` where ``compact`` is an equivalent, deduplicated access list
    (to be merged again at a coarser level).
    """
    by_size: dict[int, list[np.ndarray]] = {}
    for addrs, size in accesses:
        if addrs.size:
            by_size.setdefault(size, []).append(addrs)
    compact = [(np.unique(np.concatenate(v)), s) for s, v in by_size.items()]
    if not compact:
        return 0, []
    if len(compact) == 1:
        u, s = compact[0]
        if u.size < 2 or int(np.diff(u).min()) >= s:  # no two elements overlap
            return int(u.size) * s, compact
    # mixed sizes or overlapping elements: count bytes
    every = np.unique(
        np.concatenate([(u[:, None] + np.arange(s, dtype=np.uint64)).ravel() for u, s in compact])
    )
    return int(every.size), [(every, 1)]


class _Launch:
    def __init__(self, name: str, grid) -> None:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        self.record = LaunchTraffic(name, grid)
        self.program_reads: list[tuple[np.ndarray, int]] = []
        self.program_writes: list[tuple[np.ndarray, int]] = []
        self.launch_reads: list[tuple[np.ndarray, int]] = []
        self.launch_writes: list[tuple[np.ndarray, int]] = []
        self.open = False

    def flush_program(self) -> None:
        if not self.open:
            return
        r, rc = unique_bytes(self.program_reads)
        w, wc = unique_bytes(self.program_writes)
        self.record.read_program += r
        self.record.write_program += w
        self.launch_reads += rc
        self.launch_writes += wc
        self.program_reads, self.program_writes = [], []
        self.record.programs += 1
        self.open = False

    def finish(self) -> LaunchTraffic:
        self.flush_program()
        self.record.read_launch, _ = unique_bytes(self.launch_reads)
        self.record.write_launch, _ = unique_bytes(self.launch_writes)
        return self.record


_state = threading.local()


def _current() -> _Launch | None:
    return getattr(_state, "launch", None)


def _active(ptrs, mask) -> tuple[np.ndarray, int]:
    """Addresses (uint64) of the active lanes and the element size of a pointer tensor."""
    addrs = np.asarray(ptrs.data).astype(np.uint64, copy=False).ravel()
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).ravel()
        addrs = addrs[m]
    elem = ptrs.get_element_ty()
    size = max(int(getattr(elem, "primitive_bitwidth", 8)) // 8, 1)
    return addrs, size


@contextlib.contextmanager
def _patch_interpreter() -> Iterator[None]:
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    own = dict(vars(builder))  # attributes already set on the instance (restored as they were)
    originals = {
        name: getattr(builder, name)
        for name in (
            "set_grid_idx",
            "create_masked_load",
            "create_masked_store",
            "create_atomic_rmw",
            "create_atomic_cas",
        )
        if hasattr(builder, name)
    }

    def set_grid_idx(x, y, z):
        launch = _current()
        if launch is not None:
            launch.flush_program()
            launch.open = True
        return originals["set_grid_idx"](x, y, z)

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        launch = _current()
        if launch is not None:
            launch.program_reads.append(_active(ptrs, mask))
        return originals["create_masked_load"](ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(ptrs, value, mask, cache_policy):
        launch = _current()
        if launch is not None:
            launch.program_writes.append(_active(ptrs, mask))
        return originals["create_masked_store"](ptrs, value, mask, cache_policy)

    def atomic_rmw(op, ptr, val, mask, sem, scope):
        launch = _current()
        if launch is not None:
            access = _active(ptr, mask)
            launch.program_reads.append(access)
            launch.program_writes.append(access)
        return originals["create_atomic_rmw"](op, ptr, val, mask, sem, scope)

    def atomic_cas(ptr, cmp, val, sem, scope):
        launch = _current()
        if launch is not None:
            access = _active(ptr, None)
            launch.program_reads.append(access)
            launch.program_writes.append(access)
        return originals["create_atomic_cas"](ptr, cmp, val, sem, scope)

    patched = {
        "set_grid_idx": set_grid_idx,
        "create_masked_load": masked_load,
        "create_masked_store": masked_store,
        "create_atomic_rmw": atomic_rmw,
        "create_atomic_cas": atomic_cas,
    }
    for name in originals:
        setattr(builder, name, patched[name])
    try:
        yield
    finally:
        for name in originals:
            if name in own:
                setattr(builder, name, own[name])
            else:
                delattr(builder, name)  # the original is the class's method


@contextlib.contextmanager
def _patch_launches(traffic: Traffic) -> Iterator[None]:
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    saved = [(cls, cls.__dict__.get("run")) for cls in classes]

    def wrap(cls, original):
        def run(self, *args, grid=None, warmup=False, **kwargs):
            if warmup or _current() is not None or getattr(_state, "depth", 0):
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            name = getattr(getattr(self, "fn", None), "__name__", type(self).__name__)
            launch = _Launch(name, grid if not callable(grid) else ("callable",))
            interpreted = cls is not jit.JITFunction
            if interpreted:
                _state.launch = launch
            _state.depth = getattr(_state, "depth", 0) + 1
            try:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                _state.depth -= 1
                _state.launch = None
                record = launch.finish()
                record.measured = interpreted
                traffic.launches.append(record)

        return run

    for cls, original in saved:
        if original is not None:
            cls.run = wrap(cls, original)
    try:
        yield
    finally:
        for cls, original in saved:
            if original is not None:
                cls.run = original


_ALLOC_OPS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
    "aten::set_",
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::_local_scalar_dense",  # a host read: counted as a sync, not as device work
}
_METADATA_OPS = {"aten::size", "aten::stride"}
_WRITE_ONLY = {"aten::fill_", "aten::zero_", "aten::copy_", "aten::zeros_like", "aten::full_like"}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _is_device_work(func, args, out) -> bool:
    name = func._schema.name
    if name in _ALLOC_OPS or name.startswith("aten::sym_") or name in _METADATA_OPS:
        return False
    if getattr(func, "is_view", False):
        return False
    arguments = func._schema.arguments
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in arguments)
    if not mutates and isinstance(out, torch.Tensor):
        try:
            ptr = out.untyped_storage().data_ptr()
        except RuntimeError:
            return True
        if ptr and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args
        ):
            return False  # .to()/.contiguous()/reshape() that returned its input
    return True


def _aten_record(func, args, kwargs, out) -> AtenTraffic:
    from torch.utils._pytree import tree_leaves

    name = func._schema.name
    written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    written_ptrs = {t.data_ptr() for t in written}
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if name in _WRITE_ONLY:
        # the mutated first argument is the output: only the others are read
        inputs = inputs[1:]
    elif name.endswith("_") or "out" in (kwargs or {}):
        pass  # an in-place op reads its input too
    else:
        inputs = [t for t in inputs if t.data_ptr() not in written_ptrs or t.numel() == 0]
    return AtenTraffic(name, sum(map(_nbytes, inputs)), sum(map(_nbytes, written)))


def _custom_op_impl(name: str):
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover
        return None
    opdef = OPDEFS.get(name)
    return getattr(opdef, "_init_fn", None)


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count bytes, launches, aten ops and host syncs of the code in the block.

    Needs ``TRITON_INTERPRET=1`` (set before triton is imported) for the Triton bytes; aten ops,
    launches and syncs are counted either way. Runs below autograd, so a ``backward()`` in the
    block is counted too; mtp custom ops are entered so their inner aten ops count.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from mtp.testing import count_host_syncs

    traffic = Traffic()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(_state, "depth", 0):  # the interpreter's own tensor traffic
                return func(*args, **kwargs)
            name = func._schema.name
            if name.startswith("mtp::"):
                impl = _custom_op_impl(name)
                if impl is not None:
                    with self:
                        return impl(*args, **kwargs)
            out = func(*args, **kwargs)
            if name.startswith("c10d::"):
                traffic.collectives.append(name)
            elif _is_device_work(func, args, out):
                traffic.aten.append(_aten_record(func, args, kwargs, out))
            return out

    with count_host_syncs() as syncs, _patch_interpreter(), _patch_launches(traffic):
        with _Mode():
            yield traffic
    traffic.host_syncs = list(syncs.events)
