"""``mtp-bench`` in its CPU mode (smoke check + structural figures), as ``make bench`` runs it,
and the GPU reporting path driven by a stand-in timer (no GPU figure is produced here)."""

import json
import subprocess
import sys

import pytest
import torch

from mtp.bench import cli, report, runner
from mtp.bench.peaks import match_peak
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS

ALL_OPS = {"bias_gelu", "bias_swiglu", "cross_entropy", "linear_cross_entropy", "permute",
           "unpermute", "quantize_fp8", "grouped_gemm", "moe_layer"}  # fmt: skip
FP8 = {"triton-fp8", "triton-mxfp8"}
BACKENDS = {
    "bias_gelu": {"triton", "reference"},
    "bias_swiglu": {"triton", "reference"},
    "cross_entropy": {"triton", "reference"},
    "linear_cross_entropy": {"triton", "torch", "unfused", "reference"},
    "permute": {"triton", "reference"},
    "unpermute": {"triton", "reference"},
    "quantize_fp8": {"triton", "reference"},
    "grouped_gemm": set(GROUPED_GEMM_BACKENDS) | FP8,
    "moe_layer": set(GROUPED_GEMM_BACKENDS) | {"triton-unfused"} | FP8,
}
RECORD_KEYS = {"op", "family", "case", "group", "params", "dtype", "pass", "provider", "kind",
               "status", "note", "bytes", "flops"}  # fmt: skip


def test_cli_cpu_mode(tmp_path):
    """One run of ``mtp-bench --quick`` on CPU (one test, so that pytest-xdist runs it once),
    then its outputs checked part by part."""
    code = cli.main(["--quick", "--mode", "cpu", "--out", str(tmp_path), "--no-progress"])
    folder = tmp_path / "cpu-structural"
    result = json.loads((folder / "results.json").read_text())
    assert code == 0
    assert (folder / "results.md").exists()
    assert all((folder / name).exists() for name in result["plots"])
    _check_schema(result)
    _check_every_op_and_backend(result)
    _check_smoke(result)
    _check_structure(result)
    _check_no_speeds(folder, result)


def _check_schema(result):
    assert result["schema"] == report.SCHEMA
    env = result["environment"]
    for key in ("device", "driver", "torch", "triton", "mtp_revision", "date", "python"):
        assert key in env
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert result["gpu_timing"] is False and result["statement"] == report.NO_GPU_STATEMENT
    assert result["size"] == "smoke" and result["dtype"] == "bf16"
    for rec in result["records"]:
        assert RECORD_KEYS <= set(rec), rec
        assert rec["status"] in ("ok", "skipped", "failed")
        assert "timing" not in rec and "speedup_vs" not in rec
    assert result["formulas"] and all(f["bytes"] > 0 for f in result["formulas"])


def _check_every_op_and_backend(result):
    assert set(result["ops"]) == ALL_OPS
    for op, backends in BACKENDS.items():
        seen = {r["provider"] for r in result["records"] if r["op"] == op}
        assert backends <= seen, (op, backends - seen)
        assert backends <= set(result["providers"][op])


def _check_smoke(result):
    ran = [r for r in result["records"] if r["status"] != "skipped"]
    assert ran and all(r["status"] == "ok" for r in ran), [r for r in ran if r["status"] != "ok"]
    checked = [r for r in ran if "check" in r]
    assert {r["op"] for r in checked} == ALL_OPS
    assert all(r["check"]["ok"] and r["check"]["against"] == "float64" for r in checked)
    for r in ran:
        assert r["counts"]["device_ops"] >= 1
    triton = [r for r in ran if r["provider"] == "triton"]
    assert all(r["counts"]["triton_launches"] >= 1 for r in triton)
    assert all(r["counts"]["host_syncs"] == 0 for r in triton)
    skipped = [r for r in result["records"] if r["status"] == "skipped"]
    assert all(r["note"] for r in skipped)
    assert any(r["provider"] == "torch.compile" for r in skipped)


def _check_structure(result):
    ce = result["structure"]["cross_entropy_collectives"]
    assert {(r["backend"], r["pass"]) for r in ce} == {
        (b, p) for b in ("triton", "reference") for p in ("fwd", "bwd")
    }
    for r in ce:
        assert r["bytes_per_rank"] == r["formula_bytes_per_rank"] and r["same_on_all_ranks"]
        fwd = ["agreement", "all_gather"]
        assert [c["name"] for c in r["calls"]] == (fwd if r["pass"] == "fwd" else [])
        assert r["rel_err"] < 1e-5
    traffic = [r for r in result["structure"]["traffic"] if r["op"] == "cross_entropy"]
    assert {r["pass"] for r in traffic} == {"fwd", "fwd+bwd"}
    for r in traffic:
        assert r["bytes_over_floor"] <= 1.10 and r["host_syncs"] == 0, r
        # fwd+bwd: + the upstream ones_like that autograd.grad makes
        assert r["device_ops"] <= (1 if r["pass"] == "fwd" else 3), r
    assert any(r.get("traffic") for r in result["records"] if r["provider"] == "triton")
    lce = {(r["reduction"], r["dtype"], r["backend"]): r
           for r in result["structure"]["linear_cross_entropy_loss_bytes"]}
    for dtype in ("fp32", "bf16"):
        # mean: the forward reads the logits once and writes their gradient over them; the
        # backward scales the gradients (d_weight, d_hidden), no logits
        mean = lce[("mean", dtype, "triton")]
        assert mean["fwd_loss_bytes_over_logits"] <= 2.1 and mean["bwd_triton_launches"] == 0, lce
        assert mean["bwd_loss_bytes_over_logits"] <= 0.6, lce
        # none: one read forward, one read + write backward (the logits recomputed)
        assert lce[("none", dtype, "triton")]["fwd_loss_bytes_over_logits"] <= 1.1, lce
        assert lce[("none", dtype, "triton")]["bwd_loss_bytes_over_logits"] <= 2.4, lce
        assert lce[("mean", dtype, "torch")]["fwd_loss_bytes_over_logits"] >= 5, lce
    assert all(r["fwd_host_syncs"] == r["bwd_host_syncs"] == 0 for r in lce.values())
    moe = result["structure"]["moe_layer_forward"]
    by = {(r["E"], r["backend"]): r for r in moe}
    assert by[(8, "triton")]["device_ops"] <= 10 and by[(8, "triton")]["fwd_bwd_device_ops"] <= 24
    for E in (8, 64, 128, 256):
        assert by[(E, "triton")]["host_syncs"] == 0 and by[(E, "triton")]["graph_safe"] == "yes"
        # the same launches for any E (a large routing: + the row map's count launch)
        assert by[(E, "triton")]["device_ops"] <= by[(8, "triton")]["device_ops"] + 1
        # the dispatch inside fc1, only x and h kept: less activation memory than unfused
        assert (by[(E, "triton")]["saved_bytes_per_token"]
                < by[(E, "triton-unfused")]["saved_bytes_per_token"])  # fmt: skip
        # fused epilogues: the activation and the probability scaling are no extra op
        assert by[(E, "triton")]["device_ops"] + 2 <= by[(E, "triton-unfused")]["device_ops"]
        assert by[(E, "sequential")]["host_syncs"] >= 1
        assert by[(E, "sequential")]["graph_safe"].startswith("no")
    assert by[(256, "sequential")]["device_ops"] > by[(8, "sequential")]["device_ops"]
    _check_moe_peers(result["structure"]["moe_layer_peers"])


def _check_moe_peers(rows):
    """mtp's triton layer next to each installed peer: fewer device ops and saved bytes."""
    assert not [r for r in rows if r.get("error")], rows
    for E in (8, 64, 128):
        by = {r["provider"]: r for r in rows if r["E"] == E}
        mtp = by.pop("triton")
        assert mtp["host_syncs"] == 0, rows
        for peer in by.values():
            assert mtp["device_ops"] < peer["device_ops"], (mtp, peer)
            assert mtp["fwd_bwd_device_ops"] < peer["fwd_bwd_device_ops"], (mtp, peer)
            assert mtp["saved_bytes_per_token"] < peer["saved_bytes_per_token"], (mtp, peer)


def _check_no_speeds(folder, result):
    text = (folder / "results.md").read_text()
    assert report.NO_GPU_STATEMENT in text
    rest = text.replace(report.NO_GPU_STATEMENT, "")
    assert "GB/s" not in rest and "TFLOP/s" not in rest and "µs" not in rest
    printed = report.stdout_table(result)
    assert report.NO_GPU_STATEMENT in printed
    assert "GB/s" not in printed.replace(report.NO_GPU_STATEMENT, "")


def test_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "mtp.bench", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--quick" in out.stdout and "mtp-bench" in out.stdout


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="unknown op"):
        runner.plan(runner.load_modules(), ["gemm"], "smoke", torch.bfloat16)


class _FakeTimer:
    """Stands in for GpuTimer: fixed medians per provider (the reporting path, not a speed)."""

    medians = {"triton": 1.0, "reference": 2.0}

    def __init__(self):
        self.provider = None

    def measure(self, run):
        med = self.medians[run.provider_name]
        return {"median_ms": med, "p20_ms": med * 0.9, "p80_ms": med * 1.1, "host_us": 10.0,
                "kernels": 1, "memcpy_memset": 0, "peak_mem_bytes": 1024}  # fmt: skip


def test_gpu_reporting_path(tmp_path, monkeypatch):
    """run_gpu_case's check/figures/speedups and the GPU Markdown and plots, on CPU tensors."""
    modules = runner.load_modules()
    planned = [
        (m, c, [p for p in provs if p.name in ("triton", "reference")])
        for m, c, provs in runner.plan(modules, ["bias_gelu"], "smoke", torch.bfloat16)
    ][:2]
    module = planned[0][0]
    setup = module.SETUP["bias_gelu"]

    def tagged(case, provider, device):
        run = setup(case, provider, device)
        run.provider_name = provider
        return run

    monkeypatch.setitem(module.SETUP, "bias_gelu", tagged)
    peak = match_peak("NVIDIA H100 80GB HBM3").__dict__
    ceilings = {"copy_bytes_per_s": 3e12, "bf16_matmul_flops_per_s": 8e14}
    body = runner.run_gpu(planned, _FakeTimer(), peak, ceilings)
    recs = body["records"]
    assert len(recs) == 4 and all(r["status"] == "ok" and r["check"]["ok"] for r in recs)
    tri = next(r for r in recs if r["provider"] == "triton")
    assert tri["timing"]["gbps"] == pytest.approx(tri["bytes"] / 1e-3 / 1e9)
    assert tri["timing"]["floor_fraction"] == pytest.approx(tri["bytes"] / 3.35e12 / 1e-3)
    assert tri["timing"]["ceiling_fraction"] == pytest.approx(tri["bytes"] / 3e12 / 1e-3)
    assert tri["speedup_vs"] == {"reference": pytest.approx(2.0)}
    result = {"schema": report.SCHEMA, "command": "test", "gpu_timing": True, "size": "smoke",
              "dtype": "bf16", "peak": peak, "ceilings": ceilings, **body,
              "environment": {"device": "stand-in", "date": "-", "torch": "-", "triton": "-",
                              "python": "-", "platform": "-", "cpu_count": 1, "driver": None,
                              "cuda": None, "mtp_revision": None}}  # fmt: skip
    plots, note = report.write_plots(tmp_path, result)
    if note is None:  # matplotlib installed (the bench extra)
        assert plots and all((tmp_path / p).exists() for p in plots)
    result["plots"] = plots
    text = report.write_markdown(tmp_path / "r.md", result).read_text()
    assert "GB/s" in text and "reference 2.00x" in text
    assert "median" in report.stdout_table(result)
