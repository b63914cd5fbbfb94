"""`make demo`, short: the dense and MoE GPT train under torchrun (4 CPU ranks, gloo) with
tp=2 x dp=2 (x ep=2), the distributed optimizer and the vocab-parallel loss (the MoE variant
with the LM head fused into it, VocabParallelLinearCrossEntropy); the loss falls and
every tensor-parallel rank computes the same loss at every step."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "variant", [[], ["--moe", "--fused-loss"]], ids=["dense", "moe-fused-loss"]
)
def test_demo_loss_falls_and_tp_ranks_agree(tmp_path, variant):
    out = tmp_path / "summary.json"
    png = tmp_path / "curve.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--standalone", str(ROOT / "examples" / "demo_train.py"),
        "--steps", "20", "--seq", "32", "--log-every", "5",
        "--json", str(out), "--png", str(png), *variant,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    losses = summary["losses"]
    assert (summary["tp"], summary["dp"]) == (2, 2)
    assert summary["ep"] == (2 if variant else 1)
    assert summary["tp_ranks_equal"] is True
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] > 4.0  # about ln(128) at the start
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses
    assert summary["tokens_per_s"] > 0
    assert "tokens/s" in proc.stdout and "done: loss" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:  # in the test extra
        assert png.stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in proc.stdout
