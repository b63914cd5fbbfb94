"""A Triton cache for the GPU machine, built here, so the sweep's compile minutes are not spent
on the lease (``make gpu-bundle`` puts it in ``.gpu/triton-cache.tar.xz``; ``tools/gpu_check.py``
unpacks it there and points ``TRITON_CACHE_DIR`` at it).

Triton finds a compiled kernel under a hash of ``triton_key()`` (its compiler's sources and
``libtriton.so``: the CPython 3.11 and 3.12 wheels of triton 3.6.0 differ only in that file),
the kernel's source, its specialisation (argument types, 16-byte alignment and divisibility),
its constexprs and the compile options. So the cache is built in two steps:

1. ``capture`` (any CPython with torch and triton 3.6, e.g. ``.venv-min``): the sweep's GEMM
   launches on ``meta`` tensors under :func:`sweep_compile.compile_only`, with Triton's
   ``jit_cache_hook`` recording each kernel's specialisation data (what ``JITFunction.preload``
   takes) and skipping the compile;
2. ``replay`` (CPython 3.12 with the PyPI triton 3.6.0 wheel, no torch: the kernel modules are
   imported under a stand-in ``torch``): ``preload`` compiles each into ``--cache``; the
   cache is then stripped to what a hit reads (cubin and metadata) and packed.

Usage: ``python tools/sweep_cache.py capture OUT.json [--families ...]``;
``python3.12 tools/sweep_cache.py replay IN.json --cache DIR [--workers N]``;
``python tools/sweep_cache.py pack DIR OUT.tar.xz``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tarfile
import time
import types
from collections.abc import Callable
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
KEEP = (".cubin", ".json")  # what a cache hit reads (CompiledKernel: the binary + metadata)


def _tasks(families: list[str], cc: int, sms: int, limit: int | None,
           cases: int | None = None) -> list[dict]:  # fmt: skip
    sys.path[:0] = [p for p in (str(ROOT), str(TOOLS)) if p not in sys.path]
    import gpu_sweep

    return [t for t in gpu_sweep.plan(families, cc // 10, sms, limit, cases,
                                      gpu_sweep.dropped(cc // 10)) if "shape" in t]  # fmt: skip


def launch_all(tasks: list[dict], cc: int) -> None:
    """The tasks' launches under :func:`sweep_compile.compile_only` (compiled, not run)."""
    from sweep_compile import compile_only
    from sweep_fp8 import gemm_run
    from sweep_space import Shape

    with compile_only(cc):
        for task in tasks:
            gemm_run(task["family"], Shape(**task["shape"]), "meta", cc // 10).run(task["cand"])


def capture(families: list[str], cc: int = 90, sms: int = 132, limit: int | None = None,
            cases: int | None = None) -> list[dict]:  # fmt: skip
    """Specialisation data of every GEMM kernel the sweep launches (nothing compiled)."""
    from triton import knobs

    tasks = _tasks(families, cc, sms, limit, cases)
    seen: dict[str, dict] = {}

    def hook(*, fn, compile, **_):
        data = compile["specialization_data"]
        seen.setdefault(data, {"module": fn.module, "name": fn.name, "data": data, "cc": cc})
        return True  # recorded: do not compile

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        launch_all(tasks, cc)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(seen.values())


class _Stand(types.ModuleType):
    """A stand-in module: any attribute is another stand-in (the kernel modules' host code
    mentions torch; their ``@triton.jit`` functions never do)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stand(f"{self.__name__}.{name}")


def _kernel(module: str, name: str):
    """The ``@triton.jit`` function, its module imported without mtp's package inits."""
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.modules["torch"] = _Stand("torch")
    for pkg, path in (("mtp", ROOT / "mtp"), ("mtp.kernels", ROOT / "kernels")):
        if pkg not in sys.modules:
            stub = types.ModuleType(pkg)
            stub.__path__ = [str(path)]
            sys.modules[pkg] = stub
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _replay_one(entry: dict) -> tuple[float, str]:
    sys.path[:0] = [p for p in (str(ROOT), str(TOOLS)) if p not in sys.path]
    from triton.runtime import driver

    from sweep_compile import TargetDriver

    driver.set_active(TargetDriver(entry["cc"]))
    t0 = time.monotonic()
    try:
        _kernel(entry["module"], entry["name"]).preload(entry["data"])
        return time.monotonic() - t0, ""
    except Exception as exc:  # noqa: BLE001
        return time.monotonic() - t0, f"{entry['name']}: {type(exc).__name__}: {exc}"[:300]


def replay(entries: list[dict], cache: Path, workers: int = 1) -> list[tuple[float, str]]:
    """Compile every captured kernel into ``cache`` (``TRITON_CACHE_DIR``)."""
    import multiprocessing as mp

    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    os.environ.pop("TRITON_INTERPRET", None)
    if workers <= 1:
        return [_replay_one(e) for e in entries]
    with mp.get_context("spawn").Pool(workers) as pool:
        return pool.map(_replay_one, entries, chunksize=4)


def _regroup(cache: Path, names: Callable[[Path, dict], dict]) -> None:
    for group in cache.glob("*/__grp__*.json"):
        paths = json.loads(group.read_text())["child_paths"]  # {file name: absolute path}
        group.write_text(json.dumps({"child_paths": names(group.parent, paths)}))


def strip(cache: Path) -> int:
    """Keep what a hit reads (each group's cubin and metadata); the rest (IRs, PTX, source)
    goes. A group file names its files by absolute path, which a hit checks: they are
    written relative here and made absolute where the cache is unpacked. Returns the bytes."""

    def keep(folder: Path, paths: dict) -> dict:
        for name in paths:
            if not name.endswith(KEEP):
                (folder / name).unlink(missing_ok=True)
        return {name: name for name in sorted(paths) if name.endswith(KEEP)}

    _regroup(cache, keep)
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())


def pack(cache: Path, dest: Path) -> int:
    with tarfile.open(dest, "w:xz") as tar:
        for child in sorted(cache.iterdir()):
            tar.add(child, arcname=child.name)
    return dest.stat().st_size


def unpack(archive: Path, cache: Path) -> int:
    """The GPU machine's side: the entries of ``archive`` into ``cache``; their count."""
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data") if hasattr(tarfile, "data_filter") \
            else tar.extractall(cache)  # fmt: skip
    _regroup(cache, lambda folder, paths: {n: str(folder / n) for n in paths})
    return sum(1 for _ in cache.glob("*"))


def verify(work: Path, families: list[str], limit: int, cases: int) -> dict:
    """The captured specialisations, compiled by ``preload``, land under the cache keys of the
    JIT's own compile of the same launches (capture first: it leaves the JIT's memory empty)."""
    entries = capture(families, limit=limit, cases=cases)
    os.environ["TRITON_CACHE_DIR"] = str(work / "jit")
    launch_all(_tasks(families, 90, 132, limit, cases), 90)
    replay(entries, work / "replay")
    names = {d: sorted(p.name for p in (work / d).iterdir()) for d in ("jit", "replay")}
    # stripped, packed and unpacked elsewhere, the JIT cache is still hit (nothing compiled)
    strip(work / "jit")
    pack(work / "jit", work / "cache.tar.xz")
    unpack(work / "cache.tar.xz", work / "moved")
    for entry in entries:
        _kernel(entry["module"], entry["name"]).device_caches.clear()
    os.environ["TRITON_CACHE_DIR"] = str(work / "moved")
    files = sorted(str(p) for p in (work / "moved").rglob("*"))
    launch_all(_tasks(families, 90, 132, limit, cases), 90)
    hit = files == sorted(str(p) for p in (work / "moved").rglob("*"))
    return {"captured": len(entries), **names, "same": names["jit"] == names["replay"],
            "hit_after_unpack": hit}  # fmt: skip


TRITON_PIN = "triton==3.6.0"  # the GPU machines' (its cp312 wheel's libtriton.so is hashed)
KEY_PROBE = ("import hashlib; from triton.runtime.cache import triton_key; "
             "print(hashlib.sha256(triton_key().encode()).hexdigest()[:16])")


def build(archive: Path, capture_python: Path, base_python: Path, work: Path,
          workers: int) -> dict:  # fmt: skip
    """``make gpu-bundle``'s cache: capture with ``capture_python`` (triton 3.6 and torch,
    ``.venv-min``), replay with a CPython 3.12 venv made from ``base_python`` holding the PyPI
    ``triton==3.6.0`` wheel (``work/py312-triton``), strip, pack into ``archive``. Incremental:
    the cache under ``work`` is kept, kernels already there are hits."""
    import subprocess

    venv = work / "py312-triton"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([str(base_python), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", TRITON_PIN],
                       check=True)  # fmt: skip
    entries, cache = work / "entries.json", work / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    t0 = time.monotonic()
    subprocess.run([str(capture_python), __file__, "capture", str(entries)], check=True,
                   env=dict(env, PYTHONPATH=str(ROOT)))  # fmt: skip
    t1 = time.monotonic()
    subprocess.run([str(python), __file__, "replay", str(entries), "--cache", str(cache),
                    "--workers", str(workers)], check=True, env=env)  # fmt: skip
    t2 = time.monotonic()
    key = subprocess.run([str(python), "-c", KEY_PROBE], capture_output=True, text=True,
                         check=True, env=env).stdout.strip()  # fmt: skip
    stripped = strip(cache)
    return {"kernels": len(json.loads(entries.read_text())), "stripped_bytes": stripped,
            "archive_bytes": pack(cache, archive), "triton": TRITON_PIN.split("==")[1],
            "triton_key": key, "capture_s": round(t1 - t0), "replay_s": round(t2 - t1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("capture")
    p.add_argument("out", type=Path)
    p.add_argument("--families", nargs="+", default=None)
    p.add_argument("--limit", type=int, default=None, help="candidates per shape")
    p.add_argument("--cases", type=int, default=None, help="shapes per family")
    p = sub.add_parser("verify", help="capture, JIT-compile and replay the same launches in "
                       "one process: the replayed cache keys must be the JIT's")  # fmt: skip
    p.add_argument("work", type=Path)
    p.add_argument("--families", nargs="+", default=["gg_wgrad"])
    p.add_argument("--limit", type=int, default=1)
    p.add_argument("--cases", type=int, default=1)
    p = sub.add_parser("replay")
    p.add_argument("entries", type=Path)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p = sub.add_parser("pack")
    p.add_argument("cache", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "capture":
        sys.path[:0] = [str(TOOLS)]
        import sweep_space

        t0 = time.monotonic()
        entries = capture(args.families or list(sweep_space.GEMM_FAMILIES), limit=args.limit,
                          cases=args.cases)  # fmt: skip
        args.out.write_text(json.dumps(entries) + "\n")
        print(f"sweep-cache: {len(entries)} kernels captured in {time.monotonic() - t0:.0f} s")
    elif args.cmd == "verify":
        print(json.dumps(verify(args.work, args.families, args.limit, args.cases)))
    elif args.cmd == "replay":
        t0 = time.monotonic()
        results = replay(json.loads(args.entries.read_text()), args.cache, args.workers)
        errors = [e for _, e in results if e]
        print(f"sweep-cache: {len(results) - len(errors)} compiled, {len(errors)} failed in "
              f"{time.monotonic() - t0:.0f} s (sum {sum(s for s, _ in results):.0f} s)")  # fmt: skip
        for e in errors[:10]:
            print("  ", e)
    else:
        size = strip(args.cache)
        packed = pack(args.cache, args.out)
        print(f"sweep-cache: {size / 2**20:.1f} MiB stripped, {packed / 2**20:.1f} MiB packed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
