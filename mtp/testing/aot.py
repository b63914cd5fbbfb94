"""Ahead-of-time compilation of Triton kernels for sm_90 and sm_100 without a GPU:
:func:`compile_for_targets` (PTX, cubin size, shared memory) and :func:`ptxas_info` (registers
and spills from ``ptxas -v``).

Under ``TRITON_INTERPRET=1`` a kernel is compiled in a long-lived helper process that runs
without the interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from typing import Any

__all__ = [
    "KernelBuild",
    "KernelCompileError",
    "PtxasInfo",
    "SHARED_MEMORY_LIMIT",
    "compile_for_targets",
    "ptxas_info",
]

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
    kernel, signature, constexprs, targets, num_warps, num_stages, aligned, divisible,
    maxnreg=None,
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
                options={"num_warps": num_warps, "num_stages": num_stages,
                         **({} if maxnreg is None else {"maxnreg": maxnreg})},
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
        code = "from mtp.testing.aot import _aot_worker_main; _aot_worker_main()"
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
    maxnreg: int | None = None,
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
        maxnreg: the ``maxnreg`` launch option (a register cap per thread), or None.
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
        tuple(divisible_by_16), maxnreg,
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
