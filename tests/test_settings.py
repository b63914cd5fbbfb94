"""mtp.settings: every MTP_* variable parsed in one place (good and bad values), override()
scoping, configure/reset, the table in docs/settings.md, the settings reaching the ops and the
spawned ranks, and no module outside mtp/settings.py reading an MTP_* variable."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mtp import settings
from mtp.testing import run_distributed

ROOT = Path(__file__).resolve().parent.parent

# variable -> (text, parsed value) pairs that parse, and texts that must raise
GOOD = {
    "MTP_BACKEND": [("triton", "triton"), (" reference ", "reference"), ("torch", "torch"),
                    ("sequential", "sequential"), ("", None), ("auto", None)],
    "MTP_VALIDATE": [("sync", "sync"), ("DEVICE", "device"), ("off", "off"), ("0", "off"),
                     ("false", "off"), ("", "device")],
    "MTP_POISON_OUTPUTS": [("1", True), ("true", True), ("YES", True), ("on", True),
                           ("0", False), ("false", False), ("no", False), ("", False)],
    "MTP_CHECK_COLLECTIVES": [("1", True), ("on", True), ("0", False), ("false", False),
                              ("", False)],
    "MTP_ABORT_ON_ERROR": [("abort", "abort"), ("1", "abort"), ("true", "abort"),
                           ("exit", "exit"), ("0", "off"), ("false", "off"), ("", "off")],
    "MTP_TRITON_TMA": [("1", True), ("0", False), ("true", True), ("off", False), ("", None),
                       ("auto", None)],
    "MTP_REVISION": [("abc123", "abc123"), ("  ", None)],
}
BAD = {
    "MTP_BACKEND": ["trtion", "cuda"],
    "MTP_VALIDATE": ["maybe", "1", "true"],
    "MTP_POISON_OUTPUTS": ["2", "maybe"],
    "MTP_CHECK_COLLECTIVES": ["sometimes", "10"],
    "MTP_ABORT_ON_ERROR": ["sometimes"],
    "MTP_TRITON_TMA": ["2", "tma"],
    "MTP_REVISION": [],
}


def test_the_table_covers_every_variable_and_field():
    names = [v.name for v in settings.VARIABLES]
    assert sorted(names) == sorted(GOOD) == sorted(BAD)
    fields = [f.name for f in settings.Settings.__dataclass_fields__.values()]
    assert [v.field for v in settings.VARIABLES] == fields
    defaults = {v.field: v.default for v in settings.VARIABLES}
    assert settings.Settings() == settings.Settings(**defaults)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_each_variable_parses_its_values(monkeypatch, name):
    field = next(v.field for v in settings.VARIABLES if v.name == name)
    monkeypatch.delenv(name, raising=False)
    assert getattr(settings.reload(), field) == getattr(settings.Settings(), field)  # default
    for text, want in GOOD[name]:
        monkeypatch.setenv(name, text)
        assert getattr(settings.reload(), field) == want, (name, text)
        assert settings.parse(name, text) == want and settings.parse(field, text) == want


@pytest.mark.parametrize("name", sorted(n for n in BAD if BAD[n]))
def test_bad_values_name_the_variable(monkeypatch, name):
    for text in BAD[name]:
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"{name} must be .*got {text!r}"):
            settings.reload()
        with pytest.raises(ValueError, match=name):
            settings.current()  # still wrong: not cached as valid
    monkeypatch.delenv(name)
    settings.reload()


def test_environment_is_read_once(monkeypatch):
    monkeypatch.setenv("MTP_VALIDATE", "sync")
    assert settings.reload().validate == "sync"
    monkeypatch.setenv("MTP_VALIDATE", "off")
    assert settings.current().validate == "sync"  # not read again until reload()
    assert settings.reload().validate == "off"


def test_override_is_scoped_and_nests():
    base = settings.current()
    with settings.override(validate="sync", poison_outputs=False) as inside:
        assert inside.validate == "sync" and settings.current() is inside
        with settings.override(validate="off", backend="torch"):
            assert settings.current().validate == "off"
            assert settings.current().backend == "torch"
            assert settings.current().poison_outputs is False
        assert settings.current() == inside
    assert settings.current() == base


def test_override_restores_after_an_error_and_checks_values():
    base = settings.current()
    with pytest.raises(RuntimeError, match="boom"):
        with settings.override(check_collectives=True):
            assert settings.current().check_collectives
            raise RuntimeError("boom")
    assert settings.current() == base
    with pytest.raises(ValueError, match="MTP_VALIDATE must be one of"):
        with settings.override(validate="sometimes"):
            pass
    with pytest.raises(TypeError, match="unknown setting 'valdiate'"):
        with settings.override(valdiate="sync"):
            pass
    with settings.override(abort_on_error=False, triton_tma="1", validate="OFF"):
        s = settings.current()
        assert (s.abort_on_error, s.triton_tma, s.validate) == ("off", True, "off")
    assert settings.current() == base


def test_override_is_process_wide():
    """Autograd's backward runs in other threads: they see the override too."""
    seen = []
    with settings.override(validate="sync"):
        t = threading.Thread(target=lambda: seen.append(settings.current().validate))
        t.start()
        t.join()
    assert seen == ["sync"]


def test_configure_lasts_until_reset(monkeypatch):
    monkeypatch.setenv("MTP_BACKEND", "triton")
    settings.reload()
    settings.configure(backend="reference")
    assert settings.current().backend == "reference"
    with settings.override(backend="torch"):
        assert settings.current().backend == "torch"
        assert settings.explicit() == {"backend": "torch"}
    assert settings.reload().backend == "reference"  # configure survives a reload
    assert settings.explicit() == {"backend": "reference"}
    assert settings.reset().backend == "triton"  # ... not a reset
    assert settings.explicit() == {}


def test_the_fixture_resets_between_tests_part_1():
    settings.configure(validate="sync")


def test_the_fixture_resets_between_tests_part_2():
    assert settings.explicit() == {}
    assert settings.current().validate == "device"


def test_current_takes_no_lock_and_reads_no_environment(monkeypatch):
    """What torch.compile traces may call it: the writers rebuild the settings, current() only
    reads them (here while another thread would hold the writers' lock)."""
    settings.configure(validate="sync")
    monkeypatch.setattr(settings.os, "environ", None)  # any read would fail
    with settings._lock:
        assert settings.current().validate == "sync"
    monkeypatch.undo()


def test_ops_read_the_settings():
    import mtp.utils as mu
    from mtp.ops._backend import auto_backend, resolve_backend

    assert mu.poison_enabled()  # tests/conftest.py sets MTP_POISON_OUTPUTS=1
    with settings.override(poison_outputs=False):
        assert not mu.poison_enabled()
    assert torch.isnan(mu.empty((3,), dtype=torch.float32, device="cpu")).all()
    with settings.override(validate="sync"):
        assert mu.validation_mode(True) == "sync" and mu.validation_mode("device") == "device"
    cpu = torch.device("cpu")
    with settings.override(backend="sequential"):
        choices = ("triton", "sequential", "reference")
        assert resolve_backend("gg", "auto", cpu, choices) == "sequential"
        assert resolve_backend("gelu", "auto", cpu, ("triton", "reference")) == "reference"
    with settings.override(backend="reference"):  # linear CE's plain-PyTorch backend is "torch"
        assert auto_backend(("triton", "fused", "torch"), cpu, reference="torch") == "torch"


def test_every_op_backend_is_a_known_name():
    import importlib

    from mtp.moe.config import LAYER_BACKENDS as _LAYER_BACKENDS
    from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS

    mods = [importlib.import_module(f"mtp.ops.{m}") for m in
            ("bias_act", "cross_entropy", "linear_cross_entropy", "moe_permute")]
    names = {*GROUPED_GEMM_BACKENDS, *_LAYER_BACKENDS} - {"auto"}
    for m in mods:
        names |= set(getattr(m, "_BACKENDS", ())) | set(getattr(m, "BACKENDS", ())) - {"auto"}
    assert names <= set(settings.BACKEND_NAMES), names - set(settings.BACKEND_NAMES)


def test_docs_hold_the_table():
    text = (ROOT / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in text, "docs/settings.md: paste settings.markdown_table()"
    for name, _, _ in settings.TOOL_VARIABLES:
        assert f"`{name}`" in text
    for ops in settings.AUTO_BACKENDS:
        assert ops in text


def _rank_settings(rank, world):
    return settings.current().validate, settings.current().poison_outputs


def test_run_distributed_carries_the_settings():
    with settings.override(validate="sync", poison_outputs=False):
        assert run_distributed(_rank_settings, 2) == [("sync", False)] * 2


def test_settings_import_no_torch():
    code = "import sys, mtp.settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# No MTP_* variable read outside mtp/settings.py
# --------------------------------------------------------------------------------------------

#: Reads that stay, with the reason (none: the grouped GEMM's TMA switch is read through
#: ``settings.current().triton_tma`` by its config module).
ALLOWED: dict[str, str] = {}


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def env_reads(path: Path) -> list[str]:
    """``line: key`` of each MTP_* key this file reads or writes through os.environ/os.getenv."""
    text = path.read_text()
    tree = ast.parse(text)
    consts = _constants(tree)

    def key_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return consts.get(node.id, "")
        return ""

    found: dict[int, str] = {}
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(key_of(node.slice))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and _is_environ(func.value) and node.args:
                keys.append(key_of(node.args[0]))  # environ.get / pop / setdefault
            if isinstance(func, ast.Attribute) and func.attr == "getenv" and node.args:
                keys.append(key_of(node.args[0]))
            if isinstance(func, ast.Attribute) and _is_environ(func.value):
                keys += [k.arg or "" for k in node.keywords]  # environ.update(MTP_X=...)
        found.update((node.lineno, k) for k in keys if k.startswith("MTP_"))
    # and the plain text, for forms the walk does not know (a name built at run time)
    for i, line in enumerate(text.splitlines(), 1):
        if re.search(r"\b(environ|getenv)\b", line) and "MTP_" in line and i not in found:
            found[i] = line.strip()
    return [f"{i}: {k}" for i, k in sorted(found.items())]


def test_the_env_scan_sees_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('import os\nNAME = "MTP_X"\na = os.environ.get(NAME)\nb = os.environ["MTP_Y"]\n'
                   'c = os.getenv("MTP_Z")\nos.environ.update(MTP_W="1")\n'
                   'd = os.environ.get("HOME")\n')
    assert [r.split(":")[0] for r in env_reads(src)] == ["3", "4", "5", "6"]


def test_no_module_reads_mtp_variables_outside_settings():
    offenders = {}
    for folder in ("mtp", "kernels", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "mtp/settings.py" or rel in ALLOWED:
                continue
            reads = env_reads(path)
            if reads:
                offenders[rel] = reads
    assert not offenders, f"read MTP_* through mtp.settings.current() instead: {offenders}"
    for rel in ALLOWED:
        assert env_reads(ROOT / rel), f"{rel} no longer reads MTP_*: drop it from ALLOWED"
