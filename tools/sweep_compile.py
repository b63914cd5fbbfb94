"""Compiling the sweep's candidates without launching them: the parallel pre-compile on the GPU
machine (fills Triton's cache before the timing loop) and the dry run's sm_90a report.

:func:`compile_only` makes every ``kernel[grid](...)`` a ``kernel.run(..., warmup=True)`` for a
fixed target (a stand-in driver: no GPU needed), so a launcher called on ``meta`` tensors
compiles exactly the kernels, with the same specialisation and cache key, that the real call
on the GPU compiles (16-byte aligned pointers, the same integers): the workers of
:func:`precompile` need no CUDA context. :func:`compile_task` is one worker task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator

#: Rows of the memory-bound families' cases when compiled without a GPU (the column sizes,
#: which decide the kernels' constexprs, stay the bench's; the row counts stay multiples of 16):
#: cross-entropy keeps its programs (up to 2048), so the same MAX_G.
AOT_ROWS = {"ce": 2048, "bias_act": 64, "permute": 64}


class TargetDriver:
    """The part of a Triton driver that ``JITFunction.run(warmup=True)`` reads, for a fixed
    target; ``launcher_cls`` is the real CUDA launcher where it can be built (GPU machine)."""

    def __init__(self, cc: int, warp_size: int = 32):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", cc, warp_size)

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return self.target.arch  # the JIT keeps its binders per device: one per target

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compile_only(cc: int) -> Iterator[list]:
    """Inside: ``kernel[grid](*args)`` compiles for sm_``cc`` and launches nothing; the
    compiled kernels (Triton's ``CompiledKernel``) are appended to the yielded list."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []
    original = JITFunction.__getitem__

    def getitem(self, grid):
        def call(*args, **kwargs):
            compiled.append(self.run(*args, grid=grid, warmup=True, **kwargs))

        return call

    from mtp.kernels._launch import set_direct

    previous = driver._active  # None until a real driver was needed: none is made here
    driver.set_active(TargetDriver(cc))
    JITFunction.__getitem__ = getitem
    set_direct(True)  # mtp's launch plans go through kernel[grid] as well
    try:
        yield compiled
    finally:
        set_direct(False)
        JITFunction.__getitem__ = original
        driver._active = previous


def _build_launcher(kernel) -> None:
    """The kernel's C launcher into Triton's cache (built at the first launch otherwise)."""
    from triton.backends.nvidia.driver import CudaLauncher

    CudaLauncher(kernel.src, kernel.metadata)


def report(kernel, cc: int) -> dict:
    """Registers, spills and shared memory of one compiled kernel (``ptxas -v`` on its PTX)."""
    from mtp.testing.aot import KernelBuild, ptxas_info

    md = kernel.metadata
    build = KernelBuild(md.name, cc, f"sm_{cc}a", kernel.asm["ptx"], len(kernel.asm["cubin"]),
                        int(md.shared), md.num_warps, md.num_stages)  # fmt: skip
    info = ptxas_info(build)
    out = {"name": md.name, "shared": int(md.shared), "fits": build.fits_shared_memory}
    if info is not None:
        out.update(registers=info.registers, spill_stores=info.spill_stores,
                   spill_loads=info.spill_loads)  # fmt: skip
    return out


def kernels_ok(reports: list[dict]) -> bool:
    """No spills, shared memory within the 227 KiB a block may use."""
    from mtp.testing.aot import SHARED_MEMORY_LIMIT

    return all(r["fits"] and r["shared"] <= SHARED_MEMORY_LIMIT and not r.get("spill_stores")
               and not r.get("spill_loads") for r in reports)  # fmt: skip


def _run_family(task: dict) -> None:
    import torch

    from sweep_fp8 import gemm_run
    from sweep_run import MemoryRun, memory_cases
    from sweep_space import Shape

    family, cand = task["family"], task["cand"]
    if family.startswith("gg_"):
        gemm_run(family, Shape(**task["shape"]), "meta", task["cc"] // 10).run(cand)
        return
    import mtp.ops._backend as backend_module  # the op layer runs "triton" on CPU tensors here

    backend_module.launchable = lambda device: True
    case = memory_cases(family, "quick")[task["case"]]
    params = dict(case.params)
    for key in ("rows", "M", "T"):
        if key in params:
            params[key] = AOT_ROWS[family]
    case = dataclasses.replace(case, params=params)
    run = MemoryRun(family, case, torch.device("cpu"))
    run.fn(cand)()


def compile_task(task: dict) -> dict:
    """One worker task: compile the kernels of ``task`` (family, shape or case index, cand) for
    sm_``task["cc"]``; ``task["report"]``: registers/spills/shared of each; ``task["launcher"]``:
    also build the C launchers. Returns the task's id, seconds, kernels and any error."""
    t0 = time.monotonic()
    out = {"id": task.get("id"), "cc": task["cc"]}
    try:
        with compile_only(task["cc"]) as compiled:
            _run_family(task)
        unique = {k.hash: k for k in compiled if k is not None}
        out["kernels"] = [k.metadata.name for k in unique.values()]
        if task.get("report"):
            out["aot"] = [report(k, task["cc"]) for k in unique.values()]
            out["ok"] = kernels_ok(out["aot"])
        if task.get("launcher"):
            for k in unique.values():
                _build_launcher(k)
    except Exception as exc:  # noqa: BLE001 - one candidate's failure is its record
        out["error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
        out["ok"] = False
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _init_worker(path: list[str]) -> None:
    import sys

    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.pop("TRITON_INTERPRET", None)


def precompile(tasks: list[dict], workers: int, deadline: float | None = None,
               on_result=None) -> list[dict]:  # fmt: skip
    """Run :func:`compile_task` over ``tasks`` in ``workers`` spawned processes (no CUDA in
    them), in order of submission; stops taking results at ``deadline`` (monotonic), the rest
    compiled by the first launch instead. ``on_result(result)`` is called as each ends."""
    import multiprocessing as mp
    import sys

    results: list[dict] = []
    if not tasks:
        return results
    ctx = mp.get_context("spawn")
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # the workers import triton compiled
    try:
        pool = ctx.Pool(max(1, workers), initializer=_init_worker, initargs=(list(sys.path),))
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    with pool:
        pending = pool.imap_unordered(compile_task, tasks)
        for _ in tasks:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                res = pending.next(timeout=left)
            except mp.TimeoutError:
                break
            results.append(res)
            if on_result is not None:
                on_result(res)
        pool.terminate()
    return results
