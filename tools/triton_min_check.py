"""Minimum-version check: compile every AOT-tested Triton kernel under the oldest Triton we run on.

The lent GPU machines run triton 3.6 (torch 2.11), CI the newest. A kernel that uses an API newer
than 3.6 would pass CI and fail on the GPU, in the few minutes a GPU is lent. This check runs, in
a separate small venv (``.venv-min/``: ``triton==3.6.*``, ``torch==2.13.0`` CPU, numpy, pytest),
every test that ahead-of-time compiles a kernel through :func:`mtp.testing.compile_for_targets`
(the real compile path, for sm_90a and sm_100a: ``GPUTarget("cuda", cc, 32)``; never the
interpreter), with the signatures and constexprs those tests already use. So a kernel added later
is covered as soon as its test compiles it.

How tests are found, automatically:

* files: ``tests/test_*.py`` that mention ``compile_for_targets``, plus the test files that import
  from those (their helpers, e.g. ``ptxas_table``);
* tests: the collected tests whose function reaches ``compile_for_targets`` through the
  functions it calls (names resolved in the test module, followed into other test modules);
  the rest are deselected. Collection errors (a kernel module that fails to import under 3.6)
  fail the run.

At the end the plugin lists which ``@triton.jit`` kernels of ``kernels/`` (subpackages included)
were compiled and which none of the tests compiles (those are not checked;
``MTP_MIN_TRITON_STRICT=1`` makes that an error). Usage::

    python tools/triton_min_check.py            # creates .venv-min on first use (~2 min)
    python tools/triton_min_check.py --list     # show the selected files and exit

This file is also the pytest plugin (``-p triton_min_check``) that the run loads.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
KERNELS = ROOT / "kernels"
MIN_TRITON = "3.6"
#: cuobjdump and the nvdisasm its -sass calls: the SASS checks (16-byte loads, TMA, HGMMA) run
#: under 3.6 too.
REQUIREMENTS = ("triton==3.6.*", "torch==2.13.0", "numpy<2.4", "pytest", "nvidia-cuda-cuobjdump",
                "nvidia-cuda-nvdisasm")
MARKER = "compile_for_targets"


# ----------------------------------------------------------------------------------------------
# Selection (runs in any Python: no torch, no triton)
# ----------------------------------------------------------------------------------------------


def _uses_compile_for_targets(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtp"):
            if any(alias.name == MARKER for alias in node.names):
                return True
        if isinstance(node, ast.Attribute) and node.attr == MARKER:
            return True
    return False


def _imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
    return names


def aot_test_files(tests: Path = TESTS) -> list[Path]:
    """Test files that import and use compile_for_targets (code, not strings), and the test
    files importing from those (transitively)."""
    files = {p.stem: p for p in sorted(tests.glob("test_*.py"))}
    trees = {name: ast.parse(p.read_text()) for name, p in files.items()}
    picked = {name for name, tree in trees.items() if _uses_compile_for_targets(tree)}
    imports = {name: _imported_modules(tree) for name, tree in trees.items()}
    changed = True
    while changed:
        changed = False
        for name in files:
            if name not in picked and imports[name] & picked:
                picked.add(name)
                changed = True
    return [files[n] for n in sorted(picked)]


def jit_kernels(kernels: Path = KERNELS) -> dict[str, set[str]]:
    """``{"module.function": names it calls}`` for every function in kernels/ (its subpackages
    included, e.g. ``grouped_gemm_details/``) decorated with (triton.)jit."""
    found = {}
    for path in sorted(kernels.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                calls = {
                    c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                    for c in ast.walk(node)
                    if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))
                }
                found[f"{path.stem}.{node.name}"] = calls
    return found


def covered_kernels(kernels: dict[str, set[str]], compiled) -> set[str]:
    """Kernels compiled directly, and the @triton.jit helpers they call (transitively)."""
    by_name: dict[str, list[str]] = {}
    for key in kernels:
        by_name.setdefault(key.split(".", 1)[1], []).append(key)
    done = {k for k in kernels if k in compiled}
    todo = list(done)
    while todo:
        for name in kernels[todo.pop()]:
            for key in by_name.get(name, ()):
                if key not in done:
                    done.add(key)
                    todo.append(key)
    return done


# ----------------------------------------------------------------------------------------------
# The pytest plugin (-p triton_min_check), loaded in the min venv
# ----------------------------------------------------------------------------------------------

_COMPILED: dict[str, set[int]] = {}


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def reaches(fn, target, seen=None, folder: Path | None = None) -> bool:
    """Whether ``fn`` calls ``target`` directly or through functions defined in the folder of
    ``fn``'s file (the test modules and their helpers)."""
    seen = set() if seen is None else seen
    fn = getattr(fn, "__wrapped__", fn)
    if not isinstance(fn, types.FunctionType) or fn in seen:
        return False
    seen.add(fn)
    folder = folder or Path(fn.__code__.co_filename).parent
    for name in _code_names(fn.__code__):
        obj = fn.__globals__.get(name)
        if obj is target:
            return True
        module_file = getattr(getattr(obj, "__code__", None), "co_filename", "")
        if isinstance(obj, types.FunctionType) and Path(module_file).parent == folder:
            if reaches(obj, target, seen, folder):
                return True
    return False


def _record(module: str, qualname: str, targets) -> None:
    key = f"{module.rsplit('.', 1)[-1]}.{qualname}"
    _COMPILED.setdefault(key, set()).update(int(t) for t in targets)


def _instrument() -> None:
    import mtp.testing.aot as mt

    worker_compile = mt._WORKER.compile
    compile_here = mt._compile_here

    def compile_via_worker(request):
        builds = worker_compile(request)
        _record(request["module"], request["qualname"], request["args"][2])
        return builds

    def compile_in_process(kernel, *args):
        builds = compile_here(kernel, *args)
        fn = getattr(kernel, "fn", kernel)
        _record(fn.__module__, fn.__qualname__, args[2])
        return builds

    mt._WORKER.compile = compile_via_worker
    mt._compile_here = compile_in_process


def pytest_configure(config):
    # The installed version, read without importing triton (tests/conftest.py must set
    # TRITON_INTERPRET before the first import).
    from importlib.metadata import version

    import pytest

    want, have = os.environ.get("MTP_MIN_TRITON", MIN_TRITON), version("triton")
    if not have.startswith(want + "."):
        raise pytest.UsageError(f"triton {have} is not the minimum {want}.x")


def pytest_collection_modifyitems(session, config, items):
    import pytest

    import mtp.testing

    keep, drop = [], []
    for item in items:
        fn = getattr(item, "obj", None)
        (keep if reaches(fn, mtp.testing.compile_for_targets) else drop).append(item)
    if not keep:
        raise pytest.UsageError("no test calls compile_for_targets: nothing to check")
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
    _instrument()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import triton

    kernels = jit_kernels()
    reached = covered_kernels(kernels, _COMPILED)
    covered = [k for k in kernels if k in _COMPILED]
    missing = [k for k in kernels if k not in reached]
    tr = terminalreporter
    tr.section(f"AOT compile under triton {triton.__version__}")
    for key in covered:
        archs = ", ".join(f"sm_{cc}a" for cc in sorted(_COMPILED[key]))
        tr.write_line(f"compiled    {key} for {archs}")
    for key in missing:
        tr.write_line(f"NOT CHECKED {key}: no test compiles it with compile_for_targets")
    tr.write_line(f"{len(reached)} of {len(kernels)} @triton.jit functions in kernels/ compiled "
                  f"({len(covered)} kernels, {len(reached) - len(covered)} helpers they call)")
    report = os.environ.get("MTP_MIN_TRITON_REPORT")
    if report:
        Path(report).write_text(json.dumps(
            {"triton": triton.__version__, "compiled": {k: sorted(v) for k, v in _COMPILED.items()},
             "not_checked": missing}, indent=1))  # fmt: skip
    if missing and os.environ.get("MTP_MIN_TRITON_STRICT") == "1" and exitstatus == 0:
        tr.write_line("MTP_MIN_TRITON_STRICT=1: kernels without an AOT test", red=True)
        config._min_triton_missing = True  # noqa: SLF001 - read in pytest_sessionfinish


def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "_min_triton_missing", False):
        session.exitstatus = 1


# ----------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------


def ensure_venv(venv: Path, python: str) -> Path:
    """Create ``venv`` with REQUIREMENTS unless its stamp says it already has them."""
    py = venv / "bin" / "python"
    stamp = venv / ".mtp-min-requirements"
    if py.exists() and stamp.exists() and stamp.read_text() == "\n".join(REQUIREMENTS):
        return py
    print(f"triton-min: creating {venv} ({', '.join(REQUIREMENTS)})", flush=True)
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    stamp.write_text("\n".join(REQUIREMENTS))
    return py


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-min")
    parser.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                        help="interpreter that creates the venv")
    parser.add_argument("--list", action="store_true", help="print the selected files and exit")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    files = aot_test_files()
    if args.list:
        print("\n".join(str(f.relative_to(ROOT)) for f in files))
        print(f"@triton.jit in kernels/: {', '.join(jit_kernels())}")
        return 0
    py = ensure_venv(args.venv, args.python)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tools")])
    env["MTP_MIN_TRITON"] = MIN_TRITON
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [str(py), "-m", "pytest", "-p", "triton_min_check", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=-ra --strict-markers", *map(str, files), *args.pytest_args]  # fmt: skip
    print("triton-min:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
