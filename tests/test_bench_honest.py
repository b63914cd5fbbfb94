"""The bench's GPU figures must be honest, checked here without a GPU.

* the float64 check runs chunk by chunk (a 30 GB weight gradient never gets a float64 copy);
* a provider whose check fails is marked failed (timed, never summarised) without cancelling
  the others; a provider that cannot run a case is skipped, not failed; the loop backends are
  not timed in the quick run; past the time budget the remaining cases are skipped;
* ``results.json`` is rewritten after every case (a killed run keeps them), with the revision;
* the peers are called as their installed versions define them (Megatron-Core's permute map,
  Liger's SwiGLU on the same work), the raw ``F.grouped_mm`` provider, ``torch.compile`` with
  static shapes, an E=64 model, CUDA-graph providers skipped for forward+backward.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtp import settings
from mtp.bench import bench_bias_act, bench_grouped_gemm, bench_moe_layer, bench_permute, cli, core
from mtp.bench import runner
from mtp.bench.core import Case, Provider, Run, Skip


class _Float64Sizes(TorchDispatchMode):
    """Largest float64 tensor any aten op produces inside."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.largest = max(self.largest, t.numel())
        return out


def test_rel_err_is_chunked_and_exact():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(300, 500, generator=g).to(torch.bfloat16)
    a = (e.float() + 1e-2 * torch.randn(300, 500, generator=g)).to(torch.bfloat16)
    exact = ((a.double() - e.double()).norm() / e.double().norm()).item()
    with _Float64Sizes() as seen:
        got = core.rel_err([a], [e], chunk=4096)
    assert got == pytest.approx(exact, rel=1e-12)
    assert 0 < seen.largest <= 4096, seen.largest  # never a float64 copy of the whole tensor
    a[7, 9] = float("nan")
    assert core.rel_err([a], [e], chunk=4096) == float("inf")
    assert core.rel_err([a[:10]], [e]) == float("inf")  # shape mismatch
    assert core.rel_err([torch.arange(5)], [torch.arange(5)]) == 0.0


# --------------------------------------------------------------------------------------------
# The runner's GPU path, driven on CPU with a stand-in timer
# --------------------------------------------------------------------------------------------


class _Timer:
    def __init__(self):
        self.timed = []

    def measure(self, run):
        self.timed.append(run)
        return {"median_ms": 1.0 + len(self.timed), "p20_ms": 1.0, "p80_ms": 1.0}


def _fake_module():
    x = torch.randn(64, 8)

    def setup(case, provider, device):
        if provider == "skipper":
            raise Skip("cannot capture this case")
        if provider == "broken":
            raise RuntimeError("kernel exploded")
        wrong = provider == "wrong"
        return Run(lambda: (x * (2.0 if wrong else 1.0),))

    module = types.SimpleNamespace(FAMILY="fake", SETUP={"fake": setup})
    case = Case("fake", "n=64", {}, torch.float32, "fwd", bytes=512)
    providers = [Provider(name, kind) for name, kind in (
        ("good", "mtp"), ("wrong", "mtp"), ("skipper", "mtp"), ("broken", "peer"),
        ("sequential", "mtp"), ("reference", "baseline"))]  # fmt: skip
    return module, case, providers


def test_failed_check_marks_the_row_failed_and_others_still_time():
    module, case, providers = _fake_module()
    timer = _Timer()
    recs = runner.run_gpu_case(module, case, providers, timer, untimed=("sequential", "reference"))
    by = {r["provider"]: r for r in recs}
    assert by["good"]["status"] == "ok" and by["good"]["check"]["ok"]
    assert by["wrong"]["status"] == "failed" and "timing" in by["wrong"]  # timed, for the record
    assert "check failed" in by["wrong"]["note"]
    assert by["skipper"]["status"] == "skipped"
    assert by["skipper"]["note"] == "cannot capture this case"
    assert by["broken"]["status"] == "failed" and "kernel exploded" in by["broken"]["note"]
    assert by["sequential"]["status"] == by["reference"]["status"] == "skipped"
    assert len(timer.timed) == 2  # good and wrong only
    assert set(by["good"]["speedup_vs"]) == set()  # a failed row is nobody's baseline


def test_run_gpu_reports_each_case_and_stops_at_the_budget():
    module, case, providers = _fake_module()
    planned = [(module, case, providers)] * 3
    seen, partial = [], []

    def on_records(recs, final=True):
        (seen if final else partial).append([r["provider"] for r in recs])

    body = runner.run_gpu(planned, _Timer(), on_records=on_records, deadline=None)
    assert len(seen) == 3 and len(body["records"]) == 3 * len(providers)
    # each provider's end is reported with the case's providers so far (a kill keeps them)
    names = [p.name for p in providers]
    assert partial[: len(names)] == [names[: i + 1] for i in range(len(names))]
    seen.clear()
    body = runner.run_gpu(planned, _Timer(), on_records=on_records, deadline=0.0)
    assert len(seen) == 3
    assert all(r["status"] == "skipped" and "time budget" in r["note"] for r in body["records"])


def test_the_budget_stops_a_case_between_its_providers(monkeypatch):
    module, case, providers = _fake_module()
    clock = iter(range(100))
    monkeypatch.setattr(runner.time, "monotonic", lambda: next(clock))
    # the first provider starts before the deadline, the later ones after it
    recs = runner.run_gpu_case(module, case, providers, _Timer(), deadline=0.5)
    assert recs[0]["status"] == "ok"
    assert all(r["status"] == "skipped" and "time budget" in r["note"] for r in recs[1:])


def test_results_are_saved_after_every_case(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema": 1, "gpu_timing": True, "size": "quick", "dtype": "bf16",
                                "environment": {"device": "H"}, "records": [
                                    {"op": "permute", "provider": "triton", "run_date": "old"}]}))
    result = {"schema": 1, "gpu_timing": True, "size": "quick", "dtype": "bf16",
              "environment": {"device": "H"}, "ops": ["fake"], "providers": {},
              "structure": {}, "records": [], "complete": False}  # fmt: skip
    saver = cli._Saver(path, result, "today", merge=True)
    saver([{"op": "fake", "provider": "a"}])
    first = json.loads(path.read_text())
    assert not first["complete"] and [r["provider"] for r in first["records"]] == ["triton", "a"]
    saver([{"op": "fake", "provider": "b"}], final=False)  # a provider of a running case
    partial = json.loads(path.read_text())
    assert [r["provider"] for r in partial["records"]] == ["triton", "a", "b"]
    saver([{"op": "fake", "provider": "b"}, {"op": "fake", "provider": "c"}])
    second = json.loads(path.read_text())
    assert [r["provider"] for r in second["records"]] == ["triton", "a", "b", "c"]
    assert second["records"][-1]["run_date"] == "today"


def test_revision_comes_from_the_bundle_where_there_is_no_git(monkeypatch):
    from mtp.bench import env

    monkeypatch.setenv("MTP_REVISION", "abc123def456")
    settings.reload()
    assert env.git_revision() == "abc123def456"
    assert env.environment("cpu")["mtp_revision"] == "abc123def456"


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------


def test_quick_grouped_gemm_has_e64_and_one_routing_per_model():
    cases = bench_grouped_gemm.cases("quick", torch.bfloat16)
    models = [c.params["model"] for c in cases]
    assert list(dict.fromkeys(models)) == ["Qwen3-30B-A3B", "DeepSeek-like", "OLMoE-like",
                                           "Mixtral-like"]  # fmt: skip
    olmoe = [c for c in cases if c.params["model"] == "OLMoE-like"]
    assert {(c.params["E"], c.params["k"], c.params["K"], c.params["N"]) for c in olmoe} == {
        (64, 8, 2048, 1024)}
    assert {c.params["skew"] for c in cases} == {"balanced"}
    assert len(cases) == 4 * 2  # fwd and fwd+bwd per model
    full = bench_grouped_gemm.cases("full", torch.bfloat16)
    assert {c.params["skew"] for c in full} == {"balanced", "skewed"}


def test_raw_grouped_mm_provider_matches_the_reference():
    if bench_grouped_gemm.torch_grouped_mm() is None:
        pytest.skip("this PyTorch has no grouped_mm")
    names = [p.name for p in bench_grouped_gemm.providers()]
    assert bench_grouped_gemm.RAW_TORCH in names
    w = torch.randn(4, 16, 8, requires_grad=True)
    x = torch.randn(40, 16, requires_grad=True)
    counts = torch.tensor([10, 0, 25, 5])
    f, params = bench_grouped_gemm._provider_fn(bench_grouped_gemm.RAW_TORCH, w)
    ref, _ = bench_grouped_gemm._provider_fn(core.FLOAT64, w.double())
    assert core.rel_err([f(x, counts)], [ref(x.double(), counts)]) < 1e-6
    assert params == [w]


def test_megatron_permute_map_is_its_sorted_indices(monkeypatch):
    """Megatron-Core 0.16-0.19's permute returns (tokens, probs, sorted_indices, pad_offsets,
    tokens_per_expert); the bench's peer takes the map from output 2 (it took the last: None)."""
    calls = {}

    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                drop_and_pad=False, tokens_per_expert=None, align_size=0):
        calls["num_out_tokens"] = num_out_tokens
        idx = routing_map.T.contiguous().nonzero()[:, 1]
        return tokens.index_select(0, idx), None, idx, None, tokens_per_expert

    _install(monkeypatch, "megatron.core.transformer.moe.moe_utils", permute=permute)
    real = _real_signature("megatron.core.transformer.moe.moe_utils", "permute")
    if real is not None:
        assert "num_out_tokens" in real.parameters
    rm = torch.zeros(6, 3, dtype=torch.bool)
    rm[torch.arange(6), torch.tensor([0, 2, 1, 0, 2, 2])] = True
    rows, row_map = bench_permute._permute_fn("megatron", 6)(torch.randn(6, 4), rm)
    assert row_map is not None and row_map.shape == (6,) and calls["num_out_tokens"] == 6
    assert bench_permute.MEGATRON_MAP_OUTPUT == 2


def test_liger_swiglu_is_timed_on_the_same_silu_mul_and_checked_as_dx_dbias(monkeypatch):
    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return torch.nn.functional.silu(a) * b

        @staticmethod
        def backward(ctx, dy):
            a, b = ctx.saved_tensors
            with torch.enable_grad():
                a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
                y = torch.nn.functional.silu(a_) * b_
                return torch.autograd.grad(y, (a_, b_), dy)

    _install(monkeypatch, "liger_kernel.ops.swiglu", LigerSiLUMulFunction=SiLUMul)
    case = Case("bias_swiglu", "M=32 H=16", {"M": 32, "H": 16}, torch.float32, "fwd+bwd",
                bytes=1)
    run = bench_bias_act.setup_bias_swiglu(case, "liger", torch.device("cpu"))
    expected = bench_bias_act.setup_bias_swiglu(case, core.FLOAT64, torch.device("cpu")).fn()
    from mtp.bench.counting import count_ops

    with count_ops() as counted:
        out = run.fn()
    assert not {op for op in counted.aten if "cat" in op or "add" in op}  # no bias add, no copy
    assert core.rel_err(run.for_check(out), expected) < 1e-5
    liger = next(p for p in bench_bias_act.providers("bias_swiglu") if p.name == "liger")
    assert "no bias" in liger.note


def test_cudagraph_providers_skip_forward_backward():
    case = bench_moe_layer._case("Mixtral-like", 8, 2, 8, 16, 8, torch.float32, "fwd+bwd")
    with pytest.raises(Skip, match="forward only"):
        bench_moe_layer.setup_moe_layer(case, "triton+cudagraph", torch.device("cpu"))


def test_torch_compile_is_static(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    monkeypatch.setattr(core, "_COMPILED", {})
    core.compiled(lambda x: x)
    assert seen == {"dynamic": False}


def _install(monkeypatch, dotted: str, **attrs) -> None:
    """A stand-in module at ``dotted`` (and its parents) for the peer's call."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for key, value in attrs.items():
        setattr(sys.modules[dotted], key, value)


def _real_signature(module: str, attr: str):
    """The installed peer's signature, when it is installed (checked against it then)."""
    import importlib
    import inspect

    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == module.split(".")[0]}
    for k in saved:
        del sys.modules[k]
    try:
        return inspect.signature(getattr(importlib.import_module(module), attr))
    except Exception:  # not installed here
        return None
    finally:
        sys.modules.update(saved)
