"""The Makefile's set-up and bench targets, read as text: the CPU venv recipe installs nothing
with dependency resolution after the peers that pin what is not installed (pip would print an
ERROR about their pins), and ``make bench`` writes where git does not look, ``make
bench-refresh`` into the committed results."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = (ROOT / "Makefile").read_text()


def _recipe(target: str) -> list[str]:
    """The command lines of ``target``'s rule (tab-indented, conditionals included)."""
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n|(?:ifeq|ifneq|else|endif).*\n)*)",
                      MAKEFILE, flags=re.M)  # fmt: skip
    assert match, f"no rule for {target}"
    return match.group(1).splitlines()


def test_cpu_venv_resolves_nothing_after_the_no_deps_peers():
    """pip checks, after an install, the requirements of every installed package that depends
    on what it installed: once torchtitan (installed without its data and logging
    requirements) is there, an install with dependencies prints an ERROR about its pins."""
    lines = _recipe("$(VENV)/.installed")
    cpu = lines[max(i for i, line in enumerate(lines) if line.startswith("else")):]
    installs = [line for line in cpu if "$(PIP) install" in line]
    peers = next(i for i, line in enumerate(installs) if "$(PEER_NODEPS)" in line)
    assert "--no-deps" in installs[peers]
    after = [line for line in installs[peers + 1:] if "--no-deps" not in line]
    assert not after, f"installs that resolve dependencies after the peers: {after}"
    needs = next(i for i, line in enumerate(installs) if "$(PEER_NEEDS)" in line)
    assert needs < peers


def _out_of(target: str) -> str:
    (line,) = [line for line in _recipe(target) if "-m bench" in line]
    match = re.search(r"--out\s+(\S+)", line)
    assert match, f"make {target} does not say where it writes: {line}"
    return match.group(1)


def test_make_bench_writes_where_git_does_not_look():
    out = _out_of("bench")
    assert out != "bench/results" and out.startswith("bench/results/")
    assert _out_of("bench-refresh") == "bench/results"
    try:
        probe = f"{out}/cpu-structural/results.json"
        ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT,
                                 timeout=60).returncode  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no git")
    if ignored == 128:
        pytest.skip("not a git checkout")
    assert ignored == 0, f"{out} is not ignored by git"
