"""What a block of code costs besides its arithmetic: :func:`count_host_syncs` (how often it makes
the host wait for the device), :func:`count_collectives` (every ``torch.distributed`` call
and the bytes this rank contributes) and :func:`saved_activation_bytes` (what autograd keeps
for the backward). Bytes moved by Triton programs are counted in
:mod:`mtp.testing.traffic`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "CollectiveCall",
    "count_collectives",
    "count_host_syncs",
    "saved_activation_bytes",
]

# aten ops that make the host wait for the device (or produce a data-dependent shape).
_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::equal",
    "aten::is_nonzero",
}


def _is_sync_op(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in _SYNC_OPS and name != "aten::nonzero_static":
        return True
    if name == "aten::repeat_interleave" and (kwargs or {}).get("output_size") is None:
        return len(args) == 1 or isinstance(args[1], torch.Tensor)
    if name in ("aten::_to_copy", "aten::copy_"):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        dst = (kwargs or {}).get("device")
        if name == "aten::copy_" and len(tensors) >= 2:
            return tensors[1].device.type == "cuda" and tensors[0].device.type == "cpu"
        if name == "aten::_to_copy" and tensors and dst is not None:
            return tensors[0].device.type == "cuda" and torch.device(dst).type == "cpu"
    return False


class _SyncLog:
    def __init__(self) -> None:
        self.events: list[str] = []

    @property
    def count(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"HostSyncs({self.count}: {self.events})"


@contextlib.contextmanager
def count_host_syncs() -> Iterator[_SyncLog]:
    """Count host synchronisations inside the block.

    Counts aten ops that wait for the device or produce a data-dependent shape (``item``,
    ``nonzero``, ``masked_select``, ``unique``, device-to-host copies, ...) and calls of
    ``Tensor.tolist``/``Tensor.cpu``/``Tensor.numpy`` (host reads that do not reach the
    dispatcher on CPU tensors). ``log.events`` names each one.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    log = _SyncLog()
    inside = threading.local()  # a counted Tensor method: its own aten ops are not counted again

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not getattr(inside, "method", False) and _is_sync_op(func, args, kwargs):
                log.events.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def wrap(name, original):
        @functools.wraps(original)
        def method(self, *a, **k):
            if getattr(inside, "method", False):
                return original(self, *a, **k)
            log.events.append(f"Tensor.{name}")
            inside.method = True
            try:
                return original(self, *a, **k)
            finally:
                inside.method = False

        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        with _Mode():
            yield log
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@dataclasses.dataclass
class CollectiveCall:
    """One torch.distributed call seen by :func:`count_collectives`.

    ``nbytes`` is what this rank contributes (its input tensor or tensors), ``group_size`` the
    number of ranks in the group it ran on.
    """

    name: str
    nbytes: int
    group_size: int


class _CollectiveLog:
    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []

    def count(self, name: str | None = None) -> int:
        return sum(1 for c in self.calls if name is None or c.name == name)

    def nbytes(self, name: str | None = None) -> int:
        return sum(c.nbytes for c in self.calls if name is None or c.name == name)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def clear(self) -> None:
        self.calls.clear()

    def __repr__(self) -> str:
        return f"Collectives({self.calls})"


# name -> index of the argument whose bytes this rank contributes (None: all tensor args).
_COLLECTIVES: dict[str, int | None] = {
    "all_reduce": 0,
    "all_gather": 1,
    "all_gather_into_tensor": 1,
    "all_gather_single": 1,  # torch >= 2.13 name of all_gather_into_tensor
    "_all_gather_base": 1,
    "reduce_scatter": 1,
    "reduce_scatter_tensor": 1,
    "reduce_scatter_single": 1,  # torch >= 2.13 name of reduce_scatter_tensor
    "_reduce_scatter_base": 1,
    "all_to_all": 1,
    "all_to_all_single": 1,
    "broadcast": 0,
    "reduce": 0,
    "gather": 0,
    "scatter": 1,
    "send": 0,
    "recv": 0,
    "isend": 0,
    "irecv": 0,
    "barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
}


def _payload_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_payload_bytes(v) for v in value)
    return 0


@contextlib.contextmanager
def count_collectives() -> Iterator[_CollectiveLog]:
    """Record every ``torch.distributed`` collective and point-to-point call in the block.

    Works by wrapping the functions on the ``torch.distributed`` module, so the code under test
    must call them through the module (``torch.distributed.all_reduce(...)`` or
    ``dist.all_reduce(...)``), as mtp does. A collective implemented by calling another one
    (torch 2.13's ``all_gather_into_tensor`` calls ``all_gather_single``) counts once, under the
    name the caller used. The agreement row mtp exchanges before each tensor-parallel collective
    (:mod:`mtp.parallel.collective_check`) is logged as ``"agreement"``.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from mtp.parallel import collective_check

    log = _CollectiveLog()
    saved: list[tuple[Any, str, Any]] = []

    depth = threading.local()

    def wrap(name, original, arg_index):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            if getattr(depth, "inside", False):
                return original(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            payload = args[arg_index] if arg_index is not None and len(args) > arg_index else None
            log.calls.append(CollectiveCall(name, _payload_bytes(payload), size))
            depth.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                depth.inside = False

        return collective

    for name, arg_index in _COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is None:
            continue
        wrapper = wrap(name, original, arg_index)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                saved.append((module, name, original))
                setattr(module, name, wrapper)
    # the agreement row before each tensor-parallel collective: logged under its own name
    saved.append((collective_check, "exchange_rows", collective_check.exchange_rows))
    collective_check.exchange_rows = wrap("agreement", collective_check.exchange_rows, 1)
    try:
        yield log
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def saved_activation_bytes(fn, *args, skip=()) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn(*args)`` runs
    (each storage once, however many views of it are saved), those of the tensors in ``skip``
    (e.g. the parameters) left out."""
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skipped:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())
