"""The examples run (under torchrun, on CPU with gloo)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, nproc: int, *args: str, timeout: int = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "examples" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_parallel_groups_example():
    out = torchrun("parallel_groups.py", 4, "--tp", "2", "--ep", "2", "--etp", "1")
    lines = sorted(re.findall(r"rank +\d+: .*?edp=\[[\d, ]*\]", out))
    assert len(lines) == 4, out
    assert "rank   3: tp=[2, 3] pp=[3] dp=[1, 3] cp=[3] ep=[2, 3] etp=[3] edp=[1, 3]" in lines
