"""Test and benchmark helpers (public: the test suite and ``bench/`` both use them).

- :func:`assert_close`: one tolerance table per dtype, with a failure message that says how far
  off the result is and where.
- :func:`run_distributed`: run ``fn(rank, world_size, *args)`` in real processes joined in a
  process group (gloo on CPU), re-raising the first failure with the child's traceback.
- :func:`compile_for_targets` / :func:`ptxas_info`: compile a Triton kernel ahead of time for
  sm_90 and sm_100 without a GPU, and read registers and spills from ``ptxas -v``.
- :func:`assert_graph_safe`: the CPU-side proxy for "a CUDA graph can capture this".
- :func:`count_collectives` / :func:`count_host_syncs`: count what a forward or backward sends
  over the wire and how often it waits for the device.
- :mod:`mtp.testing.traffic` (:func:`~mtp.testing.traffic.count_traffic`): bytes each Triton
  program reads and writes, counted by address under the interpreter, plus aten bytes, launches
  and host syncs: ``bytes / floor`` of an op.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import os
import pickle
import queue as queue_module
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "TOLERANCES",
    "tolerance",
    "assert_close",
    "RankFailedError",
    "run_distributed",
    "free_port",
    "KernelBuild",
    "KernelCompileError",
    "PtxasInfo",
    "SHARED_MEMORY_LIMIT",
    "compile_for_targets",
    "ptxas_info",
    "assert_graph_safe",
    "GraphSafetyError",
    "CollectiveCall",
    "count_collectives",
    "count_host_syncs",
]

# --------------------------------------------------------------------------------------------
# assert_close
# --------------------------------------------------------------------------------------------

#: (rtol, atol) per dtype of the result under test, for ops that compute in fp32 and round the
#: result to the dtype, compared with a float64 reference on the same inputs. An element passes
#: when ``|actual - expected| <= atol + rtol * |expected|``.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (3e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` from :data:`TOLERANCES` (exact for integer and bool)."""
    if not dtype.is_floating_point:
        return (0.0, 0.0)
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for dtype {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def _index_str(flat_index: int, shape: Sequence[int]) -> str:
    if len(shape) == 0:
        return "()"
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size)
        flat_index //= size
    return str(tuple(reversed(idx)))


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """Assert ``actual`` matches ``expected`` within the tolerance of ``dtype``.

    Args:
        actual: the result under test, any dtype and device.
        expected: the reference (typically float64), same shape.
        dtype: the dtype whose tolerance applies (default: ``actual.dtype``).
        rtol, atol: override the table (say why at the call site).
        msg: prefix for the failure message.

    NaN is only accepted where the reference is NaN; infinities must match exactly. The failure
    message reports the number of failing elements, the max absolute error, the max and RMS
    relative error (RMS of the error over RMS of the reference) and where the worst element is.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError("assert_close compares two tensors")
    prefix = f"{msg}: " if msg else ""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected "
            f"{tuple(expected.shape)}"
        )
    dtype = dtype or actual.dtype
    table_rtol, table_atol = tolerance(dtype)
    rtol = table_rtol if rtol is None else rtol
    atol = table_atol if atol is None else atol
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return
    nan_mismatch = torch.isnan(a) != torch.isnan(e)
    inf_mismatch = (torch.isinf(a) | torch.isinf(e)) & (a != e) & ~torch.isnan(a) & ~torch.isnan(e)
    both_special = (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(e) & (a == e))
    err = (a - e).abs()
    err = torch.where(both_special, torch.zeros_like(err), err)
    bound = atol + rtol * e.abs()
    bad = (err > bound) | nan_mismatch | inf_mismatch
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    finite = ~(torch.isnan(err) | torch.isinf(err))
    err_f = torch.where(finite, err, torch.zeros_like(err))
    rel = err_f / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(torch.argmax(torch.where(bad, err_f + 1.0, torch.zeros_like(err_f))))
    if bool(nan_mismatch.any()) or bool(inf_mismatch.any()):
        worst = int(torch.argmax((nan_mismatch | inf_mismatch).flatten().to(torch.int8)))
    rms_ref = float(e[finite].pow(2).mean().sqrt()) if bool(finite.any()) else float("nan")
    rms_err = float(err_f.pow(2).mean().sqrt())
    flat_a, flat_e = a.flatten(), e.flatten()
    lines = [
        f"{prefix}tensors are not close (tolerance of {str(dtype).replace('torch.', '')}: "
        f"rtol={rtol:g}, atol={atol:g})",
        f"  mismatched elements: {n_bad} / {a.numel()} ({100.0 * n_bad / a.numel():.3g}%)",
        f"  non-finite mismatches: {int(nan_mismatch.sum())} NaN, {int(inf_mismatch.sum())} inf",
        f"  max abs error: {float(err_f.max()):.6g} at {_index_str(int(err_f.argmax()), a.shape)}",
        f"  max rel error: {float(rel.max()):.6g} at {_index_str(int(rel.argmax()), a.shape)}",
        f"  RMS rel error: {rms_err / rms_ref if rms_ref > 0 else float('inf'):.6g}",
        f"  worst element {_index_str(worst, a.shape)}: actual {float(flat_a[worst]):.8g}, "
        f"expected {float(flat_e[worst]):.8g}",
    ]
    raise AssertionError("\n".join(lines))


# --------------------------------------------------------------------------------------------
# run_distributed
# --------------------------------------------------------------------------------------------


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


def _distributed_child(fn, rank, world_size, args, backend, port, timeout, results) -> None:
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
    processes = [
        ctx.Process(
            target=_distributed_child,
            args=(fn, rank, world_size, args, backend, port, timeout, results),
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


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation for sm_90 / sm_100
# --------------------------------------------------------------------------------------------

#: Largest dynamic shared memory one block may use on H100/H200 and B200 (227 KiB of the 228 KiB
#: per SM).
SHARED_MEMORY_LIMIT = 227 * 1024


class KernelCompileError(RuntimeError):
    """A Triton kernel failed to compile for a target; the message carries Triton's error."""


@dataclasses.dataclass
class PtxasInfo:
    """What ``ptxas -v`` reports for one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    output: str

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclasses.dataclass
class KernelBuild:
    """One ahead-of-time compilation of a Triton kernel.

    Attributes:
        name: kernel name.
        target: compute capability as an int (90, 100).
        arch: the PTX target (``sm_90a``, ``sm_100a``).
        ptx: the generated PTX text.
        cubin_size: size of the cubin in bytes.
        shared: static + dynamic shared memory the kernel needs, in bytes.
        num_warps, num_stages: the launch options it was compiled with.
    """

    name: str
    target: int
    arch: str
    ptx: str
    cubin_size: int
    shared: int
    num_warps: int
    num_stages: int

    @property
    def fits_shared_memory(self) -> bool:
        return self.shared <= SHARED_MEMORY_LIMIT

    def ptxas(self) -> PtxasInfo | None:
        """Registers and spills from ``ptxas -v`` (None when no ptxas is available)."""
        return ptxas_info(self)


def _ptx_arch(ptx: str) -> str:
    match = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    if not match:
        raise ValueError("PTX has no .target line")
    return match.group(1)


def _full_signature(kernel, signature: dict[str, str], constexprs: dict[str, Any]) -> dict:
    params = list(kernel.arg_names) if hasattr(kernel, "arg_names") else list(signature)
    full = {}
    for name in params:
        if name in constexprs:
            full[name] = "constexpr"
        elif name in signature:
            full[name] = signature[name]
        else:
            raise ValueError(
                f"kernel {kernel.__name__}: parameter {name!r} is neither in signature nor in "
                "constexprs"
            )
    unknown = (set(signature) | set(constexprs)) - set(params)
    if unknown:
        raise ValueError(f"kernel {kernel.__name__} has no parameters {sorted(unknown)}")
    return full


def _divisibility_attrs(full: dict[str, str], aligned: bool, divisible: Sequence[str]) -> dict:
    """``tt.divisibility`` hints as a real launch would specialise them: 16-byte aligned
    pointers (torch allocations are) and the integer arguments named in ``divisible``."""
    unknown = set(divisible) - set(full)
    if unknown:
        raise ValueError(f"divisible_by_16 names unknown parameters {sorted(unknown)}")
    attrs = {}
    for i, (name, ty) in enumerate(full.items()):
        if (aligned and ty.startswith("*")) or name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def _compile_here(
    kernel, signature, constexprs, targets, num_warps, num_stages, aligned, divisible
) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = _full_signature(kernel, signature, constexprs)
    attrs = _divisibility_attrs(full, aligned, divisible)
    builds = []
    for cc in targets:
        src = ASTSource(fn=kernel, signature=full, constexprs=dict(constexprs), attrs=attrs)
        try:
            compiled = triton.compile(
                src,
                target=GPUTarget("cuda", int(cc), 32),
                options={"num_warps": num_warps, "num_stages": num_stages},
            )
        except Exception as exc:
            raise KernelCompileError(
                f"{kernel.__name__} does not compile for sm_{cc}: {type(exc).__name__}: {exc}"
            ) from exc
        ptx = compiled.asm["ptx"]
        builds.append(
            dict(
                name=compiled.metadata.name,
                target=int(cc),
                arch=_ptx_arch(ptx),
                ptx=ptx,
                cubin_size=len(compiled.asm["cubin"]),
                shared=int(compiled.metadata.shared),
                num_warps=num_warps,
                num_stages=num_stages,
            )
        )
    return builds


def _send(stream, obj) -> None:
    blob = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(blob)))
    stream.write(blob)
    stream.flush()


def _recv(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("compile worker closed its pipe")
    (n,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(n))


def _load_kernel(module_name: str, module_file: str | None, qualname: str):
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if not module_file:
            raise
        spec = importlib.util.spec_from_file_location(f"_aot_{module_name}", module_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _aot_worker_main() -> None:
    """Entry point of the compile worker (a process without ``TRITON_INTERPRET``)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the pipe
    while True:
        try:
            request = _recv(stdin)
        except EOFError:
            return
        sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
        try:
            kernel = _load_kernel(request["module"], request["file"], request["qualname"])
            builds = _compile_here(kernel, *request["args"])
            _send(stdout, ("ok", builds))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            _send(stdout, ("error", type(exc).__name__, str(exc), traceback.format_exc()))


class _CompileWorker:
    """A long-lived subprocess that compiles kernels with the interpreter switched off."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        code = "from mtp.testing import _aot_worker_main; _aot_worker_main()"
        return subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def compile(self, request: dict) -> list[dict]:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            _send(self.proc.stdin, request)
            reply = _recv(self.proc.stdout)
        if reply[0] == "ok":
            return reply[1]
        _, exc_type, text, tb = reply
        if exc_type == "KernelCompileError":
            raise KernelCompileError(text)
        raise KernelCompileError(f"compile worker failed with {exc_type}: {text}\n{tb}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_WORKER = _CompileWorker()
atexit.register(_WORKER.close)


def compile_for_targets(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any] | None = None,
    targets: Sequence[int] = (90, 100),
    *,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: bool = True,
    divisible_by_16: Sequence[str] = (),
) -> dict[int, KernelBuild]:
    """Compile a ``@triton.jit`` kernel ahead of time for each target, without a GPU.

    Args:
        kernel: the kernel (a ``JITFunction``, or the ``InterpretedFunction`` that
            ``@triton.jit`` makes under ``TRITON_INTERPRET=1``: it is then compiled in a helper
            process without the interpreter, so it must be importable at module level).
        signature: Triton type of each runtime argument, e.g. ``{"x_ptr": "*bf16", "n": "i32"}``.
        constexprs: value of each ``tl.constexpr`` argument, e.g. ``{"BLOCK": 1024}``.
        targets: compute capabilities (90 = Hopper sm_90a, 100 = Blackwell sm_100a).
        num_warps, num_stages: launch options, as at a real launch.
        aligned: tell the compiler every pointer is 16-byte aligned, as Triton specialises a
            launch on torch tensors. Without it loads stay scalar and software pipelining is
            off, so registers, spills and shared memory would not be those of a real launch.
        divisible_by_16: integer arguments (strides, sizes) that are multiples of 16 at the
            launch being modelled; Triton specialises those too.

    Returns:
        ``{target: KernelBuild}`` with the PTX, cubin size and shared memory of each build.

    Raises:
        KernelCompileError: the kernel does not compile for some target.
    """
    constexprs = dict(constexprs or {})
    args = (
        signature, constexprs, tuple(targets), num_warps, num_stages, aligned,
        tuple(divisible_by_16),
    )
    fn = getattr(kernel, "fn", None)
    import triton

    if isinstance(kernel, triton.runtime.jit.JITFunction):
        builds = _compile_here(kernel, *args)
    elif fn is not None and hasattr(fn, "__module__"):
        request = dict(
            module=fn.__module__,
            file=getattr(sys.modules.get(fn.__module__), "__file__", None),
            qualname=fn.__qualname__,
            sys_path=list(sys.path),
            args=args,
        )
        builds = _WORKER.compile(request)
    else:
        raise TypeError(f"kernel must be a @triton.jit function, got {type(kernel).__name__}")
    return {b["target"]: KernelBuild(**b) for b in builds}


def _find_ptxas(arch: str) -> str | None:
    with contextlib.suppress(Exception):
        from triton.backends.nvidia.compiler import get_ptxas

        cc = int(re.sub(r"\D", "", arch))
        path = get_ptxas(cc).path
        if path and os.path.exists(path):
            return path
    for candidate in (
        shutil.which("ptxas"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas"),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def ptxas_info(build: KernelBuild) -> PtxasInfo | None:
    """Run ``ptxas -v`` on ``build.ptx``; None when no ptxas is found.

    Uses the ptxas Triton itself would use for that architecture (bundled with the triton wheel),
    falling back to ``ptxas`` on PATH or under ``$CUDA_HOME/bin``.
    """
    ptxas = _find_ptxas(build.arch)
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(build.ptx)
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name={build.arch}", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise KernelCompileError(f"ptxas failed for {build.name} ({build.arch}):\n{out}")

    def grab(pattern: str) -> int:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return PtxasInfo(
        registers=grab(r"Used (\d+) registers"),
        spill_stores=grab(r"(\d+) bytes spill stores"),
        spill_loads=grab(r"(\d+) bytes spill loads"),
        stack_frame=grab(r"(\d+) bytes stack frame"),
        output=out,
    )


# --------------------------------------------------------------------------------------------
# Host syncs and collectives
# --------------------------------------------------------------------------------------------

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
    name the caller used.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

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
    try:
        yield log
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


# --------------------------------------------------------------------------------------------
# Graph safety
# --------------------------------------------------------------------------------------------


class GraphSafetyError(AssertionError):
    """A routine is not graph-safe: host sync, data-dependent shape, or moving outputs."""


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _clone_args(tree):
    from torch.utils._pytree import tree_map

    def clone(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)

    return tree_map(clone, tree)


def _perturbed(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Same shape, dtype and value set per row, different arrangement (or value for scalars).

    Shuffling along the last dim keeps what callers rely on (a routing map keeps k experts per
    token, probabilities still sum to 1, counts keep their total) while changing the data.
    """
    if t.numel() == 0:
        return t.clone()
    if t.dim() == 0 or t.shape[-1] == 1:
        return t + 1 if t.dtype != torch.bool else ~t
    keys = torch.rand(t.shape, generator=generator).to(t.device)
    order = keys.argsort(dim=-1)
    return t.detach().gather(-1, order)


def _run_fake(fn, args, kwargs) -> None:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )
    from torch.utils._pytree import tree_map

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args, fake_kwargs = tree_map(
        lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    try:
        with mode:
            out = fn(*fake_args, **fake_kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise GraphSafetyError(
            f"not graph-safe: {type(exc).__name__} under FakeTensorMode ({exc}); a value was read "
            "on the host (.item(), .tolist(), a data-dependent if) or an output shape depends on "
            "the data (nonzero, masked_select, boolean indexing)"
        ) from exc
    # Outputs may be real tensors: a routine that writes into state allocated once (a module
    # buffer, a workspace) returns that state. Only symbolic sizes would be a problem.
    for t in _tensors(out):
        if any(not isinstance(s, int) for s in t.shape):
            raise GraphSafetyError(f"not graph-safe: output has a dynamic shape {t.shape}")


def assert_graph_safe(fn: Callable[..., Any], *args: Any, second_args=None, **kwargs: Any) -> Any:
    """Check the CPU-side proxy of "a CUDA graph can capture ``fn``".

    1. ``fn(*args, **kwargs)`` runs under ``FakeTensorMode``: reading a value on the host or
       producing a data-dependent shape raises there.
    2. On real tensors (copies of ``args``), ``fn`` runs twice; between the calls new values are
       copied *into the same input buffers*, as before a graph replay (``second_args`` if given,
       else each tensor shuffled along its last dim). No host sync may happen (counted as in
       :func:`count_host_syncs`), and every output must keep its ``data_ptr()``.

    Both runs happen inside :func:`mtp.utils.simulated_capture`, so data-dependent validation is
    skipped as it would be during a real capture. Returns the outputs of the second call.

    Raises:
        GraphSafetyError: with what went wrong.
    """
    from torch.utils._pytree import tree_map

    from mtp.utils import simulated_capture

    with simulated_capture():
        _run_fake(fn, args, kwargs)
        inputs = _clone_args((args, kwargs))
        with count_host_syncs() as syncs:
            first = fn(*inputs[0], **inputs[1])
        first_ptrs = [t.data_ptr() for t in _tensors(first)]
        if second_args is None:
            generator = torch.Generator().manual_seed(1234)
            new_values = tree_map(
                lambda x: _perturbed(x, generator) if isinstance(x, torch.Tensor) else x,
                inputs[0],
            )
        else:
            new_values = second_args
        targets, sources = _tensors(inputs[0]), _tensors(new_values)
        if len(targets) != len(sources):
            raise ValueError("second_args must hold as many tensors as args")
        with torch.no_grad():
            for dst, src in zip(targets, sources):
                dst.copy_(src)
        with count_host_syncs() as syncs_second:
            second = fn(*inputs[0], **inputs[1])
    events = syncs.events + syncs_second.events
    if events:
        raise GraphSafetyError(f"not graph-safe: host synchronisation(s) {events}")
    second_ptrs = [t.data_ptr() for t in _tensors(second)]
    if len(first_ptrs) != len(second_ptrs):
        raise GraphSafetyError(
            f"not graph-safe: {len(first_ptrs)} output tensors, then {len(second_ptrs)}"
        )
    moved = [i for i, (p, q) in enumerate(zip(first_ptrs, second_ptrs)) if p != q]
    if moved:
        raise GraphSafetyError(
            f"not graph-safe: outputs {moved} changed address between calls (allocate them once, "
            "e.g. in a workspace, and write into them)"
        )
    return second
