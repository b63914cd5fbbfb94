"""The grouped GEMM's one config (mtp.ops.grouped_gemm.config): every branch gives a reason, the
scoped override (nesting, threads, unknown fields), the MTP_TRITON_TMA setting read in one
function, and the layout rules of the grouped GEMM's files (one home, imports only downward)."""

from __future__ import annotations

import ast
import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from mtp import settings

from mtp.ops.grouped_gemm import config as gc

ROOT = Path(__file__).resolve().parent.parent
GROUPED_FILES = [
    *sorted((ROOT / "kernels" / "grouped_gemm_details").glob("*.py")),
    *sorted((ROOT / "mtp" / "ops" / "grouped_gemm").glob("*.py")),
    ROOT / "mtp" / "ops" / "grouped_mlp.py",
]


def _configs():
    """Configs of every branch of make_config."""
    for arch in (0, 8, 9, 10):
        for dtype in (torch.float32, torch.bfloat16):
            for M, E in ((8 * 64, 8), (8 * 512, 8), (8 * 4096, 8)):
                for tma_ok in (False, True):
                    kw = dict(tma_ok=tma_ok and dtype != torch.float32, sms=132 * (arch > 0))
                    yield gc.make_config(arch, dtype, M, 4096, 4096, E, **kw)
                    yield gc.make_config(arch, dtype, M, 4096, 4096, E, bias=True, **kw)
                    yield gc.make_config(arch, dtype, M, 4096, 4096, E, gemm="wgrad", **kw)
                    for act in ("swiglu", "clamped_swiglu"):
                        yield gc.make_config(arch, dtype, M, 4096, 4096, E, activation=act, **kw)


def test_every_branch_says_why():
    seen = set()
    for cfg in _configs():
        assert cfg.reason, cfg
        assert cfg.kernel in ("tma", "pointer")
        assert cfg.kernel == "pointer" or cfg.persistent, cfg  # TMA kernels are persistent
        seen.add((cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps))
    assert {k for k, *_ in seen} == {"tma", "pointer"}


def test_tma_only_where_the_operands_allow(monkeypatch):
    monkeypatch.delenv("MTP_TRITON_TMA", raising=False)
    settings.reload()
    args = (torch.bfloat16, 8 * 512, 4096, 4096, 8)
    assert gc.make_config(9, *args, tma_ok=True, sms=132).kernel == "tma"
    assert gc.make_config(8, *args, tma_ok=True, sms=108).kernel == "pointer"  # pre-Hopper
    assert gc.make_config(0, *args, tma_ok=True).kernel == "pointer"  # interpreter default
    for setting in ("1", "0"):
        monkeypatch.setenv("MTP_TRITON_TMA", setting)
        settings.reload()
        assert gc.make_config(0, *args, tma_ok=True).kernel == ("tma" if setting == "1"
                                                                 else "pointer")
        assert gc.make_config(9, *args, tma_ok=False, sms=132).kernel == "pointer"
    monkeypatch.setenv("MTP_TRITON_TMA", "1")
    settings.reload()
    with gc.override(kernel="pointer"):  # the override wins over the setting
        assert gc.make_config(9, *args, tma_ok=True, sms=132).kernel == "pointer"
    with gc.override(kernel="tma"):  # never where the operands do not allow
        assert gc.make_config(9, *args, tma_ok=False, sms=132).kernel == "pointer"


def test_override_nests_restores_and_reaches_other_threads(monkeypatch):
    monkeypatch.delenv("MTP_TRITON_TMA", raising=False)
    settings.reload()
    args = (9, torch.bfloat16, 8 * 512, 4096, 4096, 8)
    default = gc.make_config(*args, tma_ok=True, sms=132)
    with gc.override(kernel="pointer"):
        assert gc.make_config(*args, tma_ok=True, sms=132).kernel == "pointer"
        with gc.override(block_m=32, split=3):
            inner = gc.make_config(*args, tma_ok=True, sms=132)
            assert (inner.kernel, inner.block_m, inner.split) == ("pointer", 32, 3)
            seen = []  # autograd runs CUDA backwards on its own threads: they see it too
            thread = threading.Thread(target=lambda: seen.append(
                gc.make_config(*args, tma_ok=True, sms=132)))
            thread.start()
            thread.join()
            assert seen == [inner]
        assert gc.make_config(*args, tma_ok=True, sms=132).block_m == default.block_m
    assert gc.make_config(*args, tma_ok=True, sms=132) == default
    with pytest.raises(ValueError, match="unknown GroupedGemmConfig fields.*block_p"):
        with gc.override(block_p=16):
            pass
    with pytest.raises(ValueError, match="kernel must be"):
        dataclasses.replace(default, kernel="cutlass")


def test_hardware_findings_survive_in_the_tables():
    """The sm_90a rules the H200 showed (see FORWARD_TABLE / WGRAD_TABLE): a warp-specialised
    128-row forward tile has 8 warps, and the weight gradient is not warp-specialised."""
    for (arch, _), cfg in gc.FORWARD_TABLE.items():
        if arch == 9 and cfg.warp_specialize and cfg.block_m >= 128:
            assert cfg.num_warps >= 8, cfg
    for cfg in _configs():
        if cfg.kernel == "tma" and cfg.warp_specialize and cfg.block_m >= 128:
            assert cfg.num_warps >= 8 or "sm_100a" in cfg.reason, cfg
    assert not gc.WGRAD_TABLE[9].warp_specialize


def _environ_reads(tree: ast.AST) -> list[str]:
    """Functions (or "<module>") that read os.environ / os.getenv."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            name = (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else where)
            if isinstance(child, ast.Attribute) and child.attr in ("environ", "getenv"):
                found.append(where)
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_environment_read_in_one_function():
    reads = {}
    for path in GROUPED_FILES:
        for where in _environ_reads(ast.parse(path.read_text())):
            reads.setdefault(f"{path.name}:{where}", 0)
            reads[f"{path.name}:{where}"] += 1
    # MTP_TRITON_TMA comes through mtp.settings (read once there); these files read nothing
    assert reads == {}, reads
    assert "settings.current().triton_tma" in (ROOT / "mtp/ops/grouped_gemm/config.py").read_text()


def test_files_are_short_and_import_only_downward():
    for path in GROUPED_FILES:
        text = path.read_text()
        assert len(text.splitlines()) <= 500, path
        tree = ast.parse(text)
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if "kernels" in path.parts:  # device code: nothing above mtp.kernels
            assert all(not m.startswith("mtp.") or m.startswith("mtp.kernels") for m in imported)
            assert "os" not in {a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                                for a in n.names}, path  # fmt: skip
