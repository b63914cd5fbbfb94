"""``make gpu-bundle``: prepare ``.gpu/``, what a lent GPU machine needs and cannot download.

The GPU machines (H100/H200: Python 3.12, torch 2.11 CUDA 13, triton 3.6, nvcc 13, ninja,
pybind11, pytest, hypothesis, pytest-xdist; no network) lack the CUTLASS headers, and the
CUTLASS module built here (Python 3.11) cannot load there. This script fills the ignored folder
``.gpu/`` with:

* ``.gpu/cutlass/include/``: the CUTLASS/CuTe headers that ``csrc/`` includes, transitively
  (every ``#include`` followed regardless of ``#if``, so a superset of what any architecture's
  device or host pass reads), copied from the pinned ``nvidia-cutlass`` package that
  ``csrc/build_ext.py`` finds (or ``CUTLASS_DIR``). ``CUTLASS_DIR=.gpu/cutlass`` points the
  build at them.
* ``.gpu/wheels/``: wheels of the test-time packages mtp needs beyond torch, triton, numpy and
  pytest (``hypothesis``, ``pytest-xdist`` and their needs) and of the bench's peers
  (``liger-kernel``, ``megatron-core``). ``tools/gpu_check.py`` installs one only when its
  import fails there.
* ``.gpu/ext/_cuda_gemm.cpython-312-x86_64-linux-gnu.so``: the CUTLASS module itself, built
  here for sm_90a and sm_100a by a CPython 3.12 (the GPU machine's Python; ``--build-python``,
  default ``build/py312-venv``, made from pyenv's 3.12 with the build inputs), so the lease
  spends no nvcc minutes: ``tools/gpu_check.py`` copies it next to ``mtp/__init__.py`` and
  builds only when it does not import there. The module links the CUDA runtime statically and
  no torch, so one build serves any torch there.
* ``.gpu/triton-cache.tar.xz``: Triton's cache of the tuning sweep's grouped GEMM kernels,
  compiled here for sm_90a by CPython 3.12 with the PyPI triton 3.6.0 wheel
  (``tools/sweep_cache.py``), so the lease skips those compiles where its triton is that wheel
  (``triton_key`` in the manifest; ``tools/gpu_check.py`` unpacks it and sets
  ``TRITON_CACHE_DIR``).
* ``.gpu/MANIFEST.json``: CUTLASS version, file counts and sizes, and the bytes that travel.

It then prints the folder to carry and the command to run on the GPU machine. The working tree
plus ``.gpu/`` must stay under the device tool's 64 MiB; the script fails when it does not.

Usage: ``python tools/gpu_bundle.py [--out .gpu] [--no-wheels] [--no-ext] [--check-only]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 64 * 2**20  # the device tool's limit on what travels
# Test-time packages and the bench's peers, pinned: pure Python (py3-none-any) but for
# megatron-core (cp312 manylinux), 3.2 MB for the two peers. Liger-Kernel needs only torch and
# triton; Megatron-Core also numpy and packaging, which the GPU image has. Transformer Engine
# (a CUDA build of several hundred MB) does not fit the 64 MiB the device tool carries.
WHEELS = ("hypothesis==6.170.15", "sortedcontainers==2.4.0", "pytest-xdist==3.8.0",
          "execnet==2.1.2", "pytest-timeout==2.4.0", "liger-kernel==0.8.5",
          "megatron-core==0.19.2")  # fmt: skip
# The module each wheel provides, for gpu_check's "install only when missing".
WHEEL_MODULES = {"hypothesis": "hypothesis", "sortedcontainers": "sortedcontainers",
                 "pytest_xdist": "xdist", "execnet": "execnet", "pytest_timeout": "pytest_timeout",
                 "liger_kernel": "liger_kernel", "megatron_core": "megatron.core"}  # fmt: skip
EXT_FOLDER = "ext"  # .gpu/ext/: the prebuilt CUTLASS module
TRITON_CACHE = "triton-cache.tar.xz"  # .gpu/: the sweep's kernels, compiled for the GPU's Python
GPU_PYTHON = "3.12"  # the GPU machines' CPython
EXT_ARCHS = "9.0a;10.0a"
BUILD_INPUTS = ("nvidia-cutlass==4.2.*", "pybind11>=2.12", "ninja")
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".cpp")
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def load_build_ext():
    """csrc/build_ext.py as a module (it is no package; it must not import torch)."""
    path = ROOT / "csrc" / "build_ext.py"
    spec = importlib.util.spec_from_file_location("_mtp_build_ext_bundle", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def csrc_sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "csrc").iterdir() if p.suffix in SOURCE_SUFFIXES)


def header_closure(sources: list[Path], include: Path) -> list[Path]:
    """Headers under ``include`` reachable from ``sources`` through ``#include`` lines.

    Quoted includes resolve against the including file's folder first, then ``include``;
    angle includes against ``include`` only; anything else (CUDA, the C++ library, pybind11)
    is not ours to carry. Conditionals are ignored, so the result is a superset of what any
    compiler pass reads. Returns paths relative to ``include``, sorted.
    """
    include = include.resolve()
    seen: set[Path] = set()
    todo = list(sources)
    while todo:
        current = todo.pop()
        for kind, name in _INCLUDE.findall(current.read_text(errors="ignore")):
            candidates = ([current.parent / name] if kind == '"' else []) + [include / name]
            for cand in candidates:
                if cand.is_file():
                    real = cand.resolve()
                    if real.is_relative_to(include) and real not in seen:
                        seen.add(real)
                        todo.append(real)
                    break
    # find_cutlass() checks for cutlass/version.h and cute/ before it accepts a folder.
    version = include / "cutlass" / "version.h"
    if version.is_file():
        seen.add(version.resolve())
    return sorted(p.relative_to(include) for p in seen)


def copy_headers(include: Path, dest: Path, sources: list[Path] | None = None) -> list[Path]:
    """Copy the header closure of ``sources`` (default: csrc/) into ``dest`` (wiped first)."""
    files = header_closure(sources or csrc_sources(), include)
    if dest.exists():
        shutil.rmtree(dest)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(include / rel, target)
    return files


def download_wheels(dest: Path, specs=WHEELS) -> list[Path]:
    """cp312 manylinux-compatible wheels (binary only, no dependencies resolved) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
           "-d", str(dest), *specs]  # fmt: skip
    subprocess.run(cmd, check=True)
    pinned = {tuple(s.replace("-", "_").lower().split("==")) for s in specs}
    for whl in dest.glob("*.whl"):  # one version of each: drop leftovers of older pins
        name, version = whl.name.split("-")[:2]
        if (name.lower(), version) not in pinned:
            whl.unlink()
    return sorted(dest.glob("*.whl"))


def find_python(version: str = GPU_PYTHON) -> Path | None:
    """A CPython ``version`` interpreter here: ``$GPU_PYTHON``, pyenv's, or ``pythonX.Y``."""
    if os.environ.get("GPU_PYTHON"):
        return Path(os.environ["GPU_PYTHON"])
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(pyenv.glob(f"{version}.*/bin/python{version}")) if pyenv.is_dir() else []
    if found:
        return found[-1]
    which = shutil.which(f"python{version}")
    return Path(which) if which else None


def build_python(venv: Path) -> Path:
    """``venv``'s interpreter, creating the venv (CPython 3.12 + the build inputs) if needed."""
    python = venv / "bin" / "python"
    if not python.exists():
        base = find_python()
        if base is None:
            raise SystemExit(f"gpu-bundle: no CPython {GPU_PYTHON} here (set GPU_PYTHON)")
        subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *BUILD_INPUTS], check=True)
    return python


def build_extension(out: Path, python: Path, jobs: int | None = None) -> Path:
    """Build the CUTLASS module with ``python`` (3.12) for sm_90a + sm_100a in
    ``build/cuda-cp312`` (ninja: incremental) and copy it to ``out/ext/``."""
    build_dir = ROOT / "build" / "cuda-cp312"
    env = dict(os.environ, MTP_CUDA_ARCH_LIST=EXT_ARCHS)
    cmd = [str(python), str(ROOT / "csrc" / "build_ext.py"), "--build-dir", str(build_dir)]
    subprocess.run(cmd + (["-j", str(jobs)] if jobs else []), check=True, env=env, cwd=ROOT)
    built = sorted(build_dir.glob("_cuda_gemm.cpython-312-*.so"))
    if not built:
        raise SystemExit(f"gpu-bundle: no cp312 module in {build_dir}")
    dest = out / EXT_FOLDER
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return Path(shutil.copy2(built[-1], dest / built[-1].name))


def travelling_files(root: Path = ROOT) -> list[Path]:
    """What the device tool sends: tracked and untracked-not-ignored files (and shared/)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    )  # fmt: skip
    files = [root / p for p in out.stdout.decode().split("\0") if p]
    shared = root / "shared"
    if shared.is_dir():
        files += [p for p in shared.rglob("*") if p.is_file()]
    return [p for p in dict.fromkeys(files) if p.is_file()]


def tree_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def folder_bytes(folder: Path) -> int:
    return tree_bytes(folder.rglob("*")) if folder.exists() else 0


def git_commit(root: Path = ROOT) -> str | None:
    """HEAD of the checkout (``+dirty`` with uncommitted changes): the GPU copy has no .git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def build_triton_cache(out: Path) -> dict | None:
    """``out/triton-cache.tar.xz``: the sweep's GEMM kernels compiled for sm_90a by CPython 3.12
    with the PyPI triton 3.6.0 (``tools/sweep_cache.py``; captured in ``.venv-min``, which
    ``make test-triton-min`` creates). None, with a note, when either Python is missing."""
    sys.path.insert(0, str(ROOT / "tools"))
    import sweep_cache

    capture, base = ROOT / ".venv-min" / "bin" / "python", find_python()
    if not capture.exists() or base is None:
        print(f"gpu-bundle: no Triton cache (needs {capture}: `make test-triton-min`, and a "
              f"CPython {GPU_PYTHON})")  # fmt: skip
        return None
    info = sweep_cache.build(out / TRITON_CACHE, capture, base, ROOT / "build" / "triton-cache",
                             max(1, (os.cpu_count() or 2) - 1))  # fmt: skip
    print(f"gpu-bundle: {TRITON_CACHE}: {info['kernels']} kernels, "
          f"{info['archive_bytes'] / 2**20:.1f} MiB (triton_key {info['triton_key']})")
    return info


def device_command(carry: str = ".gpu") -> str:
    """The one command a GPU session runs (device tool ``run``, carry=[".gpu"])."""
    return f"PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --bundle {carry}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu", help="bundle folder (.gpu)")
    parser.add_argument("--no-wheels", action="store_true", help="headers only (no pip download)")
    parser.add_argument("--no-ext", action="store_true", help="no prebuilt CUTLASS module")
    parser.add_argument("--build-python", type=Path, default=None,
                        help="a CPython 3.12 with the build inputs (default: build/py312-venv)")
    parser.add_argument("--check-only", action="store_true", help="measure an existing bundle")
    parser.add_argument("--no-triton-cache", action="store_true",
                        help=f"no {TRITON_CACHE} (the sweep's kernels, compiled for the GPU's "
                             "CPython 3.12 and triton 3.6)")  # fmt: skip
    args = parser.parse_args(argv)
    out = args.out.resolve()
    previous = out / "MANIFEST.json"
    triton_cache = None
    ext_archs = json.loads(previous.read_text()).get("extension_archs") if previous.exists() \
        else None
    build_ext = load_build_ext()
    include = build_ext.find_cutlass()
    version = ".".join(map(str, build_ext.cutlass_version(include)))
    if not args.check_only:
        files = copy_headers(include, out / "cutlass" / "include")
        print(f"gpu-bundle: {len(files)} CUTLASS {version} headers from {include}")
        if not args.no_wheels:
            wheels = download_wheels(out / "wheels")
            print(f"gpu-bundle: wheels {', '.join(w.name for w in wheels)}")
        if not args.no_ext:
            python = args.build_python or build_python(ROOT / "build" / "py312-venv")
            so = build_extension(out, python)
            ext_archs = EXT_ARCHS
            print(f"gpu-bundle: {so.name} for {EXT_ARCHS} ({so.stat().st_size / 2**20:.1f} MiB)")
        if not args.no_triton_cache:
            triton_cache = build_triton_cache(out)
    headers = folder_bytes(out / "cutlass")
    wheels_b = folder_bytes(out / "wheels")
    tree = tree_bytes(travelling_files())
    total = tree + folder_bytes(out)
    manifest = {
        "commit": git_commit(),
        "cutlass_version": version,
        "cutlass_source": str(include),
        "headers": sum(1 for p in (out / "cutlass").rglob("*") if p.is_file()),
        "header_bytes": headers,
        "wheels": sorted(p.name for p in (out / "wheels").glob("*.whl")),
        "wheel_bytes": wheels_b,
        "extension": sorted(p.name for p in (out / EXT_FOLDER).glob("*.so")),
        "extension_archs": ext_archs if (out / EXT_FOLDER).is_dir() else None,
        "working_tree_bytes": tree,
        "total_bytes": total,
        "limit_bytes": LIMIT_BYTES,
        "triton_cache": triton_cache if not args.check_only else (
            json.loads(previous.read_text()).get("triton_cache") if previous.exists() else None),
        "command": device_command(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    mib = 2**20
    print(f"gpu-bundle: {out} = {folder_bytes(out) / mib:.1f} MiB (headers {headers / mib:.1f}, "
          f"wheels {wheels_b / mib:.1f}); working tree {tree / mib:.1f} MiB; "
          f"travels {total / mib:.1f} of {LIMIT_BYTES / mib:.0f} MiB")  # fmt: skip
    if total >= LIMIT_BYTES:
        print("gpu-bundle: too large for the device tool", file=sys.stderr)
        return 1
    rel = os.path.relpath(out, ROOT)
    print("\nOn the GPU machine (device tool `run`, carry=[\"%s\"], timeout_s=600):" % rel)
    print(f"  {device_command(rel)}")
    print("Then (here): tar xzf <files_at>/gpu-check.tar.gz -C bench/results   # and commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
