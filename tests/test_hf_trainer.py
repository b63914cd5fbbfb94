"""mtp.integrations.hf.Trainer through examples/hf_trainer_tp.py (torchrun, gloo on CPU): at tp=2
and tp=2 x dp=2 every optimizer step equals the single-process transformers.Trainer run on the
plain HF model (loss, clipped global grad norm, every weight); the saved model loads with
from_pretrained and gives the same logits; a run resumed from the step-2 checkpoint ends with
the same weights; plain transformers.Trainer over the split model raises, naming
mtp.integrations.hf.Trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_tp.py"


def _run(nproc: int, *args: str, expect_ok: bool = True) -> tuple[list[dict], str]:
    launcher = [] if nproc == 0 else ["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={nproc}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *launcher, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{\"")]
    return records, proc.stdout + proc.stderr


def _close(a: list[float], b: list[float], rtol: float = 2e-5) -> bool:
    return all(abs(x - y) <= rtol * max(abs(y), 1e-3) for x, y in zip(a, b)) and len(a) == len(b)


def _logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_trainer_tp2_and_tp2_dp2_equal_single_process(tmp_path):
    ref, _ = _run(0, "--reference", "--out", str(tmp_path / "ref"))
    tp2, _ = _run(2, "--tp", "2", "--resume-check", "--out", str(tmp_path / "tp2"))
    tp2dp2, _ = _run(4, "--tp", "2", "--out", str(tmp_path / "tp2dp2"))
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    assert tp2[0] == {"resumed_equal": True}, tp2[0]
    for name, run in (("tp2", tp2[1:]), ("tp2dp2", tp2dp2)):
        assert [r["step"] for r in run] == [1, 2, 3, 4], (name, run)
        for r, e in zip(run, ref):
            assert _close([r["loss"], r["grad_norm"]], [e["loss"], e["grad_norm"]]), (name, r, e)
            assert _close(r["weights"], e["weights"]), (name, r["step"])
        assert max(e["grad_norm"] for e in ref) > 0.5  # max_grad_norm=0.5: clipping was active
        # save -> from_pretrained -> the same logits as the single-process model
        got, want = _logits(tmp_path / name / "final"), _logits(tmp_path / "ref" / "final")
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (name, (got - want).abs().max())


def test_trainer_moe_with_experts_over_tp_and_dp_ranks_equals_single_process(tmp_path):
    """A Mixtral under mtp.integrations.hf.Trainer at tp=2 x dp=2 with its experts over all four
    ranks (ep=4): every step (loss, clipped grad norm, weights) equals the single-process run,
    a resumed run ends with the same weights, and the saved model loads in from_pretrained."""
    ref, _ = _run(0, "--reference", "--moe", "--out", str(tmp_path / "ref"))
    run, _ = _run(4, "--tp", "2", "--moe", "--ep", "4", "--resume-check",
                  "--out", str(tmp_path / "ep4"))  # fmt: skip
    assert run[0] == {"resumed_equal": True}, run[0]
    assert [r["step"] for r in run[1:]] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for r, e in zip(run[1:], ref):
        assert _close([r["loss"], r["grad_norm"]], [e["loss"], e["grad_norm"]]), (r, e)
        assert _close(r["weights"], e["weights"]), r["step"]
    got, want = _logits(tmp_path / "ep4" / "final"), _logits(tmp_path / "ref" / "final")
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def test_plain_transformers_trainer_over_split_model_raises(tmp_path):
    _, out = _run(2, "--tp", "2", "--plain-trainer", "--out", str(tmp_path), expect_ok=False)
    assert "RuntimeError" in out and "Use mtp.integrations.hf.Trainer" in out, out[-3000:]
