"""The Makefile's set-up, read as text: the CPU venv recipe installs nothing with dependency
resolution after the peers that pin what is not installed (pip would print an ERROR about
their pins)."""

from __future__ import annotations

import re
from pathlib import Path

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
