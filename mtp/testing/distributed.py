"""Real multi-process tests: :func:`run_distributed` runs ``fn(rank, world_size, *args)`` in
spawned processes joined in a process group (gloo on CPU) and re-raises the first failure with
the child's traceback.

The settings set by :func:`mtp.settings.configure` and open :func:`mtp.settings.override`
blocks travel to the children (as environment variables did before there was a settings
module).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from mtp import settings

__all__ = [
    "RankFailedError",
    "run_distributed",
    "free_port",
]


class RankFailedError(RuntimeError):
    """A rank of :func:`run_distributed` raised (or died); carries the child's traceback.

    Attributes:
        rank: the failing rank.
        world_size: the number of ranks.
        exc_type: name of the exception class raised in the child (or ``"exit"``).
        child_traceback: the formatted traceback from the child process.
    """

    def __init__(self, rank: int, world_size: int, exc_type: str, child_traceback: str):
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.child_traceback = child_traceback
        super().__init__(
            f"rank {rank} of {world_size} failed with {exc_type}\n"
            f"--- traceback from rank {rank} ---\n{child_traceback.rstrip()}"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_child(fn, rank, world_size, args, backend, port, timeout, results, chosen) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        settings.configure(**chosen)
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        try:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        except Exception as exc:  # noqa: BLE001
            if "address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc):
                # Another process took the port between free_port() and the bind: the parent
                # retries on a new one (nothing of fn has run).
                results.put((rank, "port_in_use", None, None, None))
                return
            raise
        value = fn(rank, world_size, *args)
        dist.barrier()  # rank 0 hosts the store: nobody leaves while others may still need it
        dist.destroy_process_group()
        results.put((rank, "ok", value, None, None))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - unpicklable exception: the traceback is enough
            blob = None
        results.put((rank, "error", type(exc).__name__, tb, blob))


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 180.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` freshly spawned processes.

    Each process joins a ``torch.distributed`` process group (``backend``, rendezvous on a free
    127.0.0.1 port) before ``fn`` runs, uses one CPU thread, and leaves the group afterwards.
    ``fn`` and ``args`` must be picklable (define ``fn`` at module level).

    Returns:
        The values ``fn`` returned, indexed by rank.

    Raises:
        RankFailedError: the first rank that raised or died, with its traceback (chained to the
            original exception when it can be pickled). The other ranks are terminated.
        TimeoutError: some rank did not finish within ``timeout`` seconds (they are killed).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"run_distributed needs a picklable fn and args (a module-level function): {exc}"
        ) from exc
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, args, backend, timeout)
        except _PortInUse:
            if attempt == _PORT_ATTEMPTS - 1:
                raise RankFailedError(0, world_size, "DistNetworkError",
                                      f"the rendezvous port was taken {_PORT_ATTEMPTS} times "
                                      "in a row (address already in use)") from None  # fmt: skip
    raise AssertionError("unreachable")


#: Rendezvous attempts of :func:`run_distributed` when the free port is taken before the bind.
_PORT_ATTEMPTS = 3


class _PortInUse(Exception):
    """A rank could not bind the rendezvous port (taken after :func:`free_port` chose it)."""


def _run_once(fn, world_size, args, backend, timeout) -> list[Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    chosen = settings.explicit()
    processes = [
        ctx.Process(
            target=_distributed_child,
            args=(fn, rank, world_size, args, backend, port, timeout, results, chosen),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(
                    f"run_distributed: ranks {pending} of {world_size} did not finish within "
                    f"{timeout:g}s (a hang in a collective, or a rank waiting on a failed one)"
                )
            try:
                rank, status, a, b, blob = results.get(timeout=min(0.2, remaining))
            except queue_module.Empty:
                for rank, p in enumerate(processes):
                    if rank not in values and p.exitcode not in (None, 0):
                        raise RankFailedError(
                            rank, world_size, "exit", f"process exited with code {p.exitcode}"
                        ) from None
                continue
            if status == "ok":
                values[rank] = a
                continue
            if status == "port_in_use":
                raise _PortInUse()
            original = None
            if blob is not None:
                with contextlib.suppress(Exception):
                    original = pickle.loads(blob)
            raise RankFailedError(rank, world_size, a, b) from original
    finally:
        _stop(processes)
    return [values[r] for r in range(world_size)]
