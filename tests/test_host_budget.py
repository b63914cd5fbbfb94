"""Host-path budgets: Python function calls and kernel launches per eager call, per op and pass.

Run in one subprocess without ``TRITON_INTERPRET`` under the null-GPU stand-in
(:mod:`mtp.testing.null_gpu`: kernels compiled for sm_90a, Triton's launch path real, the C
launcher a counting stub), on the host benchmark's own cases (:data:`bench.host.CASES`). No
timing is asserted: the number of Python calls (``sys.setprofile``) is what a change that re-adds
host work moves, deterministically for pinned versions; the budgets leave ~15 % for other
torch/triton releases. With :func:`mtp.kernels._launch.set_verify` on, every cached launch is
checked against the build Triton itself would pick, on aligned and misaligned inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: (case, pass) -> (most Python calls, launches). Launches are exact.
BUDGETS = {
    ("bias_gelu", "fwd"): (90, 1),
    ("bias_gelu", "fwd+bwd"): (235, 3),
    ("bias_swiglu", "fwd"): (90, 1),
    ("bias_swiglu", "fwd+bwd"): (235, 3),
    ("cross_entropy", "fwd"): (112, 1),
    ("cross_entropy", "fwd+bwd"): (215, 2),
    # --- grouped_gemm / grouped_mlp: the tile map (with the counts' status word) and the GEMMs
    ("grouped_gemm", "fwd"): (98, 2),
    ("grouped_gemm", "fwd+bwd"): (250, 4),
    ("grouped_mlp", "fwd"): (157, 3),
    ("grouped_mlp", "fwd+bwd"): (422, 7),
    # --- quantize: one launch; the FP8 grouped GEMM: forward the tile map (its status word),
    # x (row- and column-wise) and w quantised, the GEMM; backward dY quantised once, 2 GEMMs
    ("quantize", "fwd"): (95, 1),
    ("grouped_gemm_fp8", "fwd"): (350, 4),
    ("grouped_gemm_fp8", "fwd+bwd"): (630, 7),
    # --- linear_cross_entropy: one chunk; its three GEMMs are aten ops, the backward only scales
    ("linear_cross_entropy", "fwd"): (140, 1),
    ("linear_cross_entropy", "fwd+bwd"): (195, 1),
    # row map (place; a routing this small is counted in it) and the token scatter; backward:
    # one token-major combine
    ("permute", "fwd"): (114, 2),
    ("permute", "fwd+bwd"): (223, 3),
    # with the token map permute built: one launch each way
    ("unpermute", "fwd"): (80, 1),
    ("unpermute", "fwd+bwd"): (196, 2),
    # without it: the row map inverted first (one launch), then as above
    ("unpermute_no_map", "fwd"): (126, 2),
    ("unpermute_no_map", "fwd+bwd"): (242, 3),
    # router, row map (with the counts), fc1 reading its rows through it (no token scatter),
    # fc2 (TMA: its tile map and the GEMM), the token combine; backward: the combine's gather,
    # the experts' kernels (fc1's data gradient summed per token with the probs gradient in one
    # token-major combine) and the router's
    ("moe_layer", "fwd"): (565, 6),
    ("moe_layer", "fwd+bwd"): (1050, 13),
}

_WORKER = r"""
import json, sys, torch
torch.set_num_threads(1)
from mtp.testing import null_gpu
from mtp.kernels import _launch
null_gpu.install()
_launch.set_verify(True)
from bench.host import CASES, count_calls
rows = {}
for name in sys.argv[1:]:
    case = CASES[name]()
    for pas, fn in case["mtp"].items():
        fn()
        fn()
        before = null_gpu.launches()
        fn()
        launches = null_gpu.launches() - before
        _launch.set_verify(False)
        calls = count_calls(fn)
        _launch.set_verify(True)
        rows[f"{name}|{pas}"] = [calls, launches]
import _host_plans
_host_plans.run()
print("ROWS" + json.dumps(rows))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "MTP_POISON_OUTPUTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    names = sorted({case for case, _ in BUDGETS})
    proc = subprocess.run([sys.executable, "-c", _WORKER, *names], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ROWS"))
    return {tuple(k.split("|")): v for k, v in json.loads(line[4:]).items()}


@pytest.mark.parametrize("case,pas", sorted(BUDGETS))
def test_host_budget(measured, case, pas):
    calls, launches = measured[(case, pas)]
    most_calls, want_launches = BUDGETS[(case, pas)]
    assert launches == want_launches, f"{case} {pas}: {launches} launches, budget {want_launches}"
    assert calls <= most_calls, (
        f"{case} {pas}: {calls} Python calls per eager call, budget {most_calls} "
        "(host work was added to the eager path: see docs/ops.md, 'Eager and compiled paths')"
    )


def test_host_bench_cli_writes_rows(tmp_path):
    """``mtp-bench --host`` re-runs itself without the interpreter and writes a row per pass with
    the op's µs, the bare floor and their ratio, launches and Python calls."""
    out = tmp_path / "host.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "bench", "--host", "bias_gelu", "--repeat", "5",
                           "--json", str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["pass"]) for r in rows] == [("bias_gelu", "fwd"), ("bias_gelu", "fwd+bwd")]
    for r in rows:
        assert r["mtp_us"] > 0 and r["bare_us"] > 0
        assert r["ratio_bare"] == pytest.approx(r["mtp_us"] / r["bare_us"])
        assert r["launches"] == BUDGETS[("bias_gelu", r["pass"])][1]
    assert "bare us" in proc.stdout
