"""Imports of mtp.parallel and the MoE layers: no cycle (module- or function-level), the
Megatron getters are plain functions a reader and a type checker can see, and mtp.parallel binds
its names with plain imports (no module ``__getattr__``)."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import pytest
from import_graph import cycles, run_importing

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ("mtp.parallel", "mtp.moe", "mtp.tensor_parallel", "mtp.ops")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (ROOT / "mtp").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The mtp modules ``name`` imports anywhere in its body (functions included, the
    ``TYPE_CHECKING`` blocks left out), plus the packages those imports run."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    edges = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            dep = ".".join(parts[:i])
            if dep in modules and dep != name and not name.startswith(dep + "."):
                edges.add(dep)
    return edges


def test_no_import_cycle_through_the_parallel_and_moe_layers():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    mine = [c for c in cycles(graph) if any(m.startswith(CHECKED) for m in c)]
    assert mine == [], mine


def test_agreement_does_not_reach_into_parallel_state_privates():
    text = (ROOT / "mtp" / "parallel" / "parallel_state.py").read_text()
    assert "_ABORTED" not in text
    assert "agreement" not in text.split('"""', 2)[2].split("\n__all__")[0]  # no import of it


def test_megatron_getters_are_written_out():
    from mtp.parallel import parallel_state as ps

    getters = [n for n in ps.__all__ if n.startswith("get_") and n.endswith("_group")]
    assert len(getters) >= 12
    source = inspect.getsource(ps)
    for name in ps.__all__:
        fn = getattr(ps, name)
        if callable(fn) and name.startswith(("get_", "is_")):
            assert fn.__name__ == name and f"def {name}(" in source, name
            assert fn.__module__ == ps.__name__ and fn.__doc__, name


def test_package_names_are_plain_imports():
    """No module-level ``__getattr__`` anywhere in mtp, and every name ``mtp.parallel``
    hands out is the one object of the module that defines it."""
    for path in (ROOT / "mtp").rglob("*.py"):
        tree = ast.parse(path.read_text())
        lazy = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                and n.name == "__getattr__"]  # fmt: skip
        assert lazy == [], path
    import mtp.parallel as mp
    from mtp.parallel import agreement, device_mesh, dims, mappings, parallel_state, params
    from mtp.parallel import random, rank_generator

    for module in (device_mesh, dims, mappings, parallel_state, params, random, rank_generator):
        for name in module.__all__:
            assert getattr(mp, name) is getattr(module, name), name
            assert name in mp.__all__, name
    assert mp.set_check_collectives is agreement.set_check_collectives


@pytest.mark.parametrize("module", ["mtp.parallel", "mtp.parallel.__main__"])
def test_layout_tool_imports_no_torch(module):
    """``python -m mtp.parallel`` answers without importing torch (``-X importtime`` lists
    every module the run imports)."""
    stdout, imported = run_importing("-m", module, "--world-size", "8", "--tp", "2")
    assert "tp 2" in stdout and "mtp.parallel.rank_generator" in imported
    assert not {m for m in imported if m.split(".")[0] == "torch"}, "torch loaded"


def test_importing_the_package_binds_the_torch_names():
    """A plain ``import mtp.parallel`` binds every name, also while ``sys.argv[0]`` is ``"-m"``
    for a run whose target is not the layout tool (here ``python -c``)."""
    code = ("import sys; sys.argv[0] = '-m'; import mtp.parallel as mp; "
            "assert mp.initialize_model_parallel and mp.ParallelDims and mp.params")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
