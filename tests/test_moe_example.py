"""examples/moe_train.py runs under torchrun with EP = 2 on CPU (gloo) and its first step equals
the single-process model's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_moe_example_ep2():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "examples" / "moe_train.py"),
        "--ep",
        "2",
        "--check",
        "--steps",
        "6",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "rank 0: experts [0, 1] of 4, ep=2" in out and "rank 1: experts [2, 3] of 4, ep=2" in out
    assert out.count("check ok") == 2
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[-1] < losses[0]
