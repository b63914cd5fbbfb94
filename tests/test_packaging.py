"""Plain imports: ``mtp.kernels`` and ``mtp.bench`` (the top-level ``kernels/`` and ``bench/``
folders, linked from ``mtp/``) import as ordinary subpackages from a checkout on ``PYTHONPATH``,
an editable install and a wheel, with no import hook of mtp's own; and the import graph of mtp
(module-level and function-level imports alike) has no cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from import_graph import cycles

ROOT = Path(__file__).resolve().parent.parent

#: Python run with only the standard library and ``where`` on its path (no installed mtp and no
#: import hook of the venv's editable install): it prints where mtp and its two linked
#: subpackages come from, and whether importing mtp added a finder to ``sys.meta_path``.
_PROBE = """
import glob, importlib.util, site, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "site-packages" not in p]
where = sys.argv[1]
if glob.glob(where + "/*.pth"):
    site.addsitedir(where)  # an installed editable wheel: its .pth installs setuptools' finder
else:
    sys.path.insert(0, where)
before = list(sys.meta_path)
import mtp, mtp.settings
print(mtp.__file__)
print(importlib.util.find_spec("mtp.kernels").origin)
print(importlib.util.find_spec("mtp.bench").origin)
print(importlib.util.find_spec("mtp.kernels.cross_entropy").origin)
print(sys.meta_path == before)
"""


def _probe(where: Path, cwd: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(where)], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _assert_found(lines: list[str], base: Path) -> None:
    mtp_file, kernels, bench, module, same_finders = lines
    assert Path(mtp_file) == base / "mtp" / "__init__.py"
    assert Path(kernels) == base / "mtp" / "kernels" / "__init__.py"
    assert Path(bench) == base / "mtp" / "bench" / "__init__.py"
    source = (ROOT / "kernels" / "cross_entropy.py").read_bytes()
    assert Path(module).resolve().read_bytes() == source
    assert same_finders == "True", "importing mtp must not install an import hook"


def test_links_point_at_the_top_level_folders():
    for name in ("kernels", "bench"):
        link = ROOT / "mtp" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert (link / "__init__.py").resolve() == ROOT / name / "__init__.py"


def test_checkout_on_pythonpath(tmp_path):
    _assert_found(_probe(ROOT, tmp_path), ROOT)


def _build(out: Path, hook: str) -> Path:
    """The wheel setuptools' PEP 517 ``hook`` (``build_wheel``, ``build_editable``) builds from
    the checkout, as pip would, without installing anything (``pip install --prefix`` would
    uninstall the venv's own mtp)."""
    code = "import sys; from setuptools import build_meta; print(build_meta.%s(sys.argv[1]))" % hook
    env = {**os.environ, "MTP_BUILD_CUDA": "0"}
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out / done.stdout.split()[-1]


def test_editable_install_and_wheel(tmp_path):
    """One test, so that two xdist workers never build in the checkout's build/ at once."""
    editable = tmp_path / "editable"
    zipfile.ZipFile(_build(tmp_path / "dist-e", "build_editable")).extractall(editable)
    assert not (editable / "mtp").exists()  # a finder and a .pth, not a copy
    _assert_found(_probe(editable, tmp_path), ROOT)

    wheel = _build(tmp_path / "dist", "build_wheel")
    names = zipfile.ZipFile(wheel).namelist()
    for folder in ("kernels", "bench"):
        for src in (ROOT / folder).glob("*.py"):
            assert f"mtp/{folder}/{src.name}" in names, src
    assert not [n for n in names if n.startswith(("kernels/", "bench/", "tests/"))]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    _assert_found(_probe(site, tmp_path), site)


# --------------------------------------------------------------------------------------------
# The import graph
# --------------------------------------------------------------------------------------------

#: Import cycles tolerated: none (the test fails on an entry that is no longer a cycle).
KNOWN_CYCLES: list[list[str]] = []


def module_files() -> dict[str, Path]:
    """Every module of mtp by dotted name (``mtp.kernels.*`` and ``mtp.bench.*`` included)."""
    out = {}
    for path in sorted((ROOT / "mtp").rglob("*.py")):  # rglob does not enter the links
        parts = ["mtp", *path.relative_to(ROOT / "mtp").with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for folder in ("kernels", "bench"):  # through the links: subpackages too
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = ["mtp", folder, *path.relative_to(ROOT / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _nodes(node: ast.AST):
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (n for c in child.orelse for n in _nodes(c))
        else:
            yield from _nodes(child)


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mtp modules ``name`` imports anywhere in its source (in functions too; not under
    ``if TYPE_CHECKING``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = node.module if not node.level else (
                f"{base}.{node.module}" if node.module else base)
            for alias in node.names:
                child = f"{module}.{alias.name}"
                found |= {child} if child in modules else ({module} if module in modules else set())
    return found - {name}


def test_cycle_finder():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle():
    modules = module_files()
    assert {"mtp.settings", "mtp.kernels.cross_entropy", "mtp.bench.cli",
            "mtp.kernels.grouped_gemm_details.tma"} <= set(modules)
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "mtp.settings" in graph["mtp.utils"]
    found = cycles(graph)
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer cycles, drop them from KNOWN_CYCLES: {gone}"


@pytest.mark.parametrize("name", ["mtp.settings", "mtp.dtypes", "mtp.kernels"])
def test_low_modules_import_nothing_above_them(name):
    """The bottom of the layering: settings (standard library only), the dtype table (torch
    only) and the kernels import nothing else of mtp."""
    modules = module_files()
    above = set()
    for mod, path in modules.items():
        if mod == name or mod.startswith(name + "."):
            above |= {t for t in imported(mod, path, modules) if not t.startswith(name)}
    assert not above, above


# --------------------------------------------------------------------------------------------
# One home per op, short files
# --------------------------------------------------------------------------------------------

#: The op families with several parts: a package each in mtp/ops, device code under kernels/.
OP_PACKAGES = ("cross_entropy", "linear_cross_entropy", "moe_permute", "grouped_gemm", "quantize")


def test_library_files_are_at_most_500_lines():
    long = {}
    for folder in ("mtp", "kernels", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if "results" in path.parts or path.is_symlink() or not path.is_file():
                continue
            lines = len(path.read_text().splitlines())
            if lines > 500:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}, long


def test_each_op_is_one_package_and_the_index_names_every_part():
    """mtp/ops holds one module or package per op family and nothing private at its top but
    the two dispatch rules every op shares (the backend choice and the eager path); every
    module of an op package is named in mtp/ops/__init__'s index."""
    import mtp.ops

    top = sorted(p.name for p in (ROOT / "mtp" / "ops").iterdir() if p.name != "__pycache__")
    assert [n for n in top if n.startswith("_")] == ["__init__.py", "_backend.py", "_eager.py"], top
    for name in OP_PACKAGES:
        package = ROOT / "mtp" / "ops" / name
        assert (package / "__init__.py").is_file(), name
        for part in package.glob("*.py"):
            if part.stem != "__init__":
                assert f"``.{part.stem}" in mtp.ops.__doc__, f"{name}.{part.stem}"
                module = __import__(f"mtp.ops.{name}.{part.stem}", fromlist=["_"])
                assert module.__name__ == f"mtp.ops.{name}.{part.stem}"
