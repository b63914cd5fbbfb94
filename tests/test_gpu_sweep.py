"""The tuning sweep of the GPU kit (tools/gpu_sweep.py), checked without a GPU: a small subset
of its CPU walk (interpreter on a tiny shape, sm_90a compile), the JSONL it writes (one record
per candidate, flushed as written: a kill keeps them), the default config among the
candidates, the plan order, and how results become config entries (tools/sweep_pick.py,
make_config's TUNED lookup, backend="auto"'s TUNED_BACKENDS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "tools")) if p not in sys.path]

import gpu_check  # noqa: E402
import gpu_sweep  # noqa: E402
import sweep_pick  # noqa: E402
import sweep_space as space  # noqa: E402
from mtp.ops.grouped_gemm import config as gc  # noqa: E402

SUBSET = ["--families", "gg_fwd", "gg_wgrad", "bias_act", "--limit", "2", "--cases", "1",
          "--workers", "1"]  # fmt: skip


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    return env


def _sweep(jsonl: Path, *args: str, wait: bool = True):
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_sweep.py"), "--jsonl", str(jsonl), *args]
    if not wait:
        return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


def test_the_sweep_runs_first_in_the_plan():
    steps = [name for name, _ in gpu_check.PLAN]
    assert steps[:2] == ["env", "sweep"] and steps.index("sweep") < steps.index("grouped_gemm")
    assert dict(gpu_check.PLAN)["sweep"] == max(s for _, s in gpu_check.PLAN)
    assert sum(s for _, s in gpu_check.PLAN) <= 540


def test_candidates_start_with_todays_default_and_have_unique_names():
    for fam in space.GEMM_FAMILIES:
        for s in space.gemm_cases(fam):
            cands = space.gemm_candidates(fam, s, 9, 132)
            default = space.as_candidate(space.default_config(fam, s, 9, 132))
            assert cands[0].pop("baseline") is True and cands[0] == default, (fam, s)
            keys = [space.cand_key(c) for c in cands]
            assert len(keys) == len(set(keys)) and len(cands) > 10, (fam, s)
            assert not any(c.get("baseline") for c in cands[1:])
            for c in cands:  # the known-bad sm_90a form never reaches the list
                assert not space._known_bad(9, c["block_m"], c["num_warps"], c["warp_specialize"])
    for fam in space.MEMORY_FAMILIES:
        cands = space.memory_candidates(fam)
        assert cands[0]["baseline"] and len(cands) > 10
        modules = [__import__(name, fromlist=["_"]) for name in space.PATCHES[fam][0]]
        for k, v in cands[0].items():
            if k != "baseline":
                (owner,) = [m for m in modules if hasattr(m, k)]  # defined once
                assert getattr(owner, k) == v, (fam, k)
    tasks = gpu_sweep.plan(list(space.FAMILIES), 9, 132, None, None)
    assert 400 < len(tasks) < 1200  # a few hundred configs per lease
    assert [t["family"] for t in tasks] == sorted((t["family"] for t in tasks),
                                                  key=space.FAMILIES.index)  # fmt: skip


def test_patched_constants_rebuild_the_launch_plans():
    """A launch plan binds the constexprs of its first call: a candidate's constants must not
    reuse a plan built under others (every candidate would time the same build)."""
    import sweep_run

    import mtp.kernels.cross_entropy as ce

    lanes = ce.LANES
    ce._PLANS["stale"] = object()
    with sweep_run.patched((ce,), {"LANES": lanes // 2, "baseline": False}):
        assert ce.LANES == lanes // 2 and "stale" not in ce._PLANS
        ce._PLANS["built"] = object()
    with sweep_run.patched((ce,), {"LANES": lanes // 2}):
        assert "built" in ce._PLANS  # the same constants: kept
    with sweep_run.patched((ce,), {}):  # today's constants again
        assert "built" not in ce._PLANS
    assert ce.LANES == lanes
    with pytest.raises(AttributeError, match="NO_SUCH"):
        with sweep_run.patched((ce,), {"NO_SUCH": 1}):
            pass


def test_dry_run_subset_checks_and_compiles_every_candidate(tmp_path):
    """Interpreter on the tiny shape against float64, then the sm_90a compile with registers,
    spills and shared memory: one JSONL record each, the default config among them."""
    jsonl = tmp_path / "sweep.jsonl"
    proc = _sweep(jsonl, "--dry-run", *SUBSET)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = gpu_sweep.read_jsonl(jsonl)
    assert records[0]["stage"] == "env" and records[0]["triton_key"]
    planned = gpu_sweep.plan(["gg_fwd", "gg_wgrad", "bias_act"], 9, 132, 2, 1)
    baselines = {(t["family"], t["key"]) for t in planned if t["cand"].get("baseline")}
    assert {t["family"] for t in planned} == {f for f, _ in baselines}
    for stage in ("interp", "aot"):
        seen = {(r["family"], r["key"]) for r in records if r["stage"] == stage}
        assert baselines <= seen, (stage, baselines - seen)
    for r in records:
        if r["stage"] == "interp":
            assert r["ok"] and r["check"]["rel_err"] <= r["check"]["limit"], r
        if r["stage"] == "aot":
            assert r["cc"] == 90 and r["seconds"] > 0 and r["aot"], r
            for k in r["aot"]:
                assert {"name", "shared", "registers", "spill_stores", "spill_loads"} <= set(k)
    aot = {r["key"]: r for r in records if r["stage"] == "aot" and r["family"] == "gg_fwd"}
    default = next(k for f, k in baselines if f == "gg_fwd")
    assert aot[default]["ok"], aot[default]  # today's default: no spills, fits


def test_a_killed_sweep_keeps_the_records_written(tmp_path):
    jsonl = tmp_path / "sweep.jsonl"
    proc = _sweep(jsonl, "--dry-run", "--families", "gg_fwd", "--cases", "1", "--workers", "1",
                  wait=False)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(gpu_sweep.read_jsonl(jsonl)
                                                  if jsonl.exists() else []) < 3:  # fmt: skip
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    records = gpu_sweep.read_jsonl(jsonl)
    assert len(records) >= 3 and records[0]["stage"] == "env"
    assert all("family" in r and "key" in r for r in records[1:])


def _gpu_records() -> list[dict]:
    s = space.gemm_shape("gg_fwd", "Qwen3-30B-A3B")
    cands = space.gemm_candidates("gg_fwd", s, 9, 132)
    fast = cands[3]
    rec = dict(stage="gpu", family="gg_fwd", arch=9, shape=s.as_dict(), status="ok")
    return [
        dict(stage="env", device="NVIDIA H200", commit="abc123"),
        dict(rec, key=space.cand_key(cands[0]), cand=cands[0], baseline=True, ms=1.0),
        dict(rec, key=space.cand_key(fast), cand=fast, baseline=False, ms=0.8),
        dict(rec, key=space.cand_key(cands[4]), cand=cands[4], baseline=False, ms=0.7,
             status="failed"),  # faster, but its check failed: never chosen
        dict(rec, key="F.grouped_mm", cand={}, provider="F.grouped_mm", ms=0.9),
    ]


def test_pick_takes_the_fastest_checked_candidate_and_make_config_uses_it(tmp_path):
    records = _gpu_records()
    entries = sweep_pick.gemm_entries(records, "bench/results/X/sweep.jsonl", 0.03)
    s = space.gemm_shape("gg_fwd", "Qwen3-30B-A3B")
    key = (9, "bfloat16", "forward", "none", gc.shape_class(s.M, s.N, s.K, s.E))
    assert list(entries) == [key]
    entry = entries[key]
    assert entry["config"] == {k: v for k, v in records[2]["cand"].items()
                               if k not in ("baseline", "programs")}  # fmt: skip
    assert (entry["commit"], entry["ms"], entry["default_ms"]) == ("abc123", 0.8, 1.0)
    lines = gpu_sweep.summary_lines(records)
    assert "1.25x" in lines[1] and "F.grouped_mm" in lines[1], lines
    args = (9, torch.bfloat16, s.M, s.N, s.K, s.E)
    rule = gc.make_config(*args, tma_ok=True, sms=132)
    gc.TUNED.update(entries)
    try:
        cfg = gc.make_config(*args, tma_ok=True, sms=132)
        assert cfg.reason.startswith("measured: bench/results/X/sweep.jsonl at abc123")
        assert space.cand_key(space.as_candidate(cfg)) == records[2]["key"]
        assert cfg.programs == 132 or cfg.kernel == "pointer"
        wgrad = gc.make_config(*args, tma_ok=True, sms=132, gemm="wgrad")
        assert not wgrad.reason.startswith("measured")  # another key: the rules
        with gc.override(num_stages=2):  # overrides still win
            assert gc.make_config(*args, tma_ok=True, sms=132).num_stages == 2
    finally:
        for k in entries:
            del gc.TUNED[k]
        gc._tuned.cache_clear()
    assert gc.make_config(*args, tma_ok=True, sms=132) == rule
    # --write rewrites the table in a copy of config.py; the written text is valid Python
    copy = tmp_path / "config.py"
    copy.write_text(sweep_pick.CONFIG.read_text())
    sweep_pick.write_tables(entries, {}, copy)
    namespace: dict = {}
    start = copy.read_text().index("TUNED: dict")
    exec(copy.read_text()[start:].split("\n# The fastest")[0], namespace)  # noqa: S102
    assert namespace["TUNED"] == entries


def test_auto_backend_follows_the_measured_table_without_epilogues():
    records = _gpu_records()
    for fam in ("gg_dgrad", "gg_wgrad"):
        for r in records[1:]:
            if r["family"] == "gg_fwd":
                records.append(dict(r, family=fam))
    backends = sweep_pick.backend_entries(records, "sweep.jsonl", 0.03)
    assert backends == {}  # Triton's best (0.8 each) beats F.grouped_mm (0.9 each)
    for r in records:
        if r.get("provider") == "F.grouped_mm":
            r["ms"] = 0.5
    backends = sweep_pick.backend_entries(records, "sweep.jsonl", 0.03)
    (key, entry), = backends.items()
    assert entry["backend"] == "torch" and entry["ms"] == {"torch": 1.5, "triton": 2.4}
    s = space.gemm_shape("gg_fwd", "Qwen3-30B-A3B")
    assert gc.measured_backend(9, torch.bfloat16, s.M, s.N, s.K, s.E) is None
    gc.TUNED_BACKENDS.update(backends)
    try:
        assert gc.measured_backend(9, torch.bfloat16, s.M, s.N, s.K, s.E) == "torch"
        assert gc.measured_backend(10, torch.bfloat16, s.M, s.N, s.K, s.E) is None
    finally:
        gc.TUNED_BACKENDS.clear()


def test_every_table_entry_compiles_for_hopper_and_blackwell_without_spills():
    """Each TUNED entry (none until a lease measures) and the committed drop list's format."""
    from sweep_compile import precompile

    tasks = []
    for (arch, dtype, gemm, epilogue, klass), entry in gc.TUNED.items():
        E, K, N = (int(p[1:]) for p in klass.split()[:3])
        fam = {("wgrad", "none"): "gg_wgrad", ("forward", "none"): "gg_fwd"}.get(
            (gemm, epilogue), "gg_act")
        if dtype.startswith("fp8-"):  # measured in the recipe of its architecture: built there
            fam = "gg_fp8_wgrad" if gemm == "wgrad" else "gg_fp8_fwd"
        shape = space.Shape("table", E, 256 * E, K, N).as_dict()
        tasks += [dict(family=fam, shape=shape, cand=entry["config"], cc=cc, report=True,
                       id=len(tasks) + i)  # fmt: skip
                  for i, cc in enumerate((arch * 10,) if dtype.startswith("fp8-") else (90, 100))]
    # spawned workers: the compiler, not the interpreter the tests run under
    for res in precompile(tasks, 2):
        assert res.get("ok"), (tasks[res["id"]], res)
    if gpu_sweep.DROPS.exists():
        drops = json.loads(gpu_sweep.DROPS.read_text())
        assert set(drops) <= {"sm_90", "sm_100"}
        assert all(set(fams) <= set(space.FAMILIES) for fams in drops.values())


def test_captured_specialisations_replay_to_the_jit_cache_keys(tmp_path):
    """The bundle's Triton cache: a kernel's specialisation captured from the launch on meta
    tensors and compiled by JITFunction.preload lands under the same cache key as the JIT's own
    compile of that launch (so a cache built this way is what the GPU's launches look up); a
    cache stripped to its cubins, packed and unpacked elsewhere is still hit."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sweep_cache.py"), "verify",
                           str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["captured"] == 2 and len(found["jit"]) == 2, found  # expert rows + the GEMM
    assert found["same"] and found["hit_after_unpack"], found


def test_the_timing_loop_writes_one_checked_record_per_candidate(tmp_path):
    """The GPU run's loop on CPU (--cpu-loop: the interpreter on the tiny shapes, a host clock):
    the records the lease will write, the default first at each shape, the summary table."""
    jsonl = tmp_path / "sweep.jsonl"
    env = dict(_env(), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_sweep.py"), "--cpu-loop",
                           "--jsonl", str(jsonl), "--families", "gg_fwd", "bias_act", "--limit",
                           "2", "--cases", "1"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [r for r in gpu_sweep.read_jsonl(jsonl) if r["stage"] == "gpu"]
    assert len(records) == 2 + 2  # gg_fwd: the tiny shape; bias_act: its first smoke case
    for r in records:
        assert r["status"] == "ok" and r["check"]["ok"] and r["ms"] > 0, r
        assert ("tflops" in r) == (r["family"] == "gg_fwd")
    firsts = {}
    for r in records:
        firsts.setdefault((r["family"], json.dumps(r["shape"])), r)
    assert all(r["baseline"] for r in firsts.values())
    assert sum(r["baseline"] for r in records) == len(firsts) == 2
    assert "sweep: family | shape" in proc.stdout and "gg_fwd | tiny |" in proc.stdout


def test_fp8_families_are_swept_and_their_entries_reach_make_config():
    """The FP8 kernels are candidates of their own families (blockwise on sm_90, MXFP8 with
    128-row tiles on sm_100); a measured FP8 entry is keyed by its recipe, taken by
    make_config(recipe=...) only for that recipe, and builds for its architecture without
    spills."""
    from sweep_compile import precompile

    s = space.gemm_shape("gg_fp8_fwd", "Qwen3-30B-A3B")
    for arch in (9, 10):
        for fam in space.FP8_FAMILIES:
            cands = space.gemm_candidates(fam, space.gemm_shape(fam, "Qwen3-30B-A3B"), arch, 132)
            assert cands[0]["baseline"] and len(cands) > 10 and all(
                c["kernel"] == "pointer" for c in cands)
            if arch == 10:
                assert all(c["block_m"] >= 128 for c in cands)
            if arch == 9:  # a K step never straddles a 128-wide scale block
                assert all(128 % c["block_k"] == 0 for c in cands)
    cands = space.gemm_candidates("gg_fp8_fwd", s, 9, 132)
    rec = dict(stage="gpu", family="gg_fp8_fwd", arch=9, shape=s.as_dict(), status="ok")
    records = [dict(stage="env", device="NVIDIA H200", commit="abc123"),
               dict(rec, key=space.cand_key(cands[0]), cand=cands[0], baseline=True, ms=1.0),
               dict(rec, key=space.cand_key(cands[5]), cand=cands[5], baseline=False, ms=0.7),
               dict(rec, key="F.grouped_mm-bf16", cand={}, provider="F.grouped_mm-bf16", ms=1.2)]
    entries = sweep_pick.gemm_entries(records, "bench/results/X/sweep.jsonl", 0.03)
    key = (9, "fp8-blockwise", "forward", "none", gc.shape_class(s.M, s.N, s.K, s.E))
    assert list(entries) == [key]
    assert sweep_pick.backend_entries(records, "x", 0.03) == {}  # FP8 is not a BF16 backend
    args = (9, torch.bfloat16, s.M, s.N, s.K, s.E)
    gc.TUNED.update(entries)
    try:
        cfg = gc.make_config(*args, sms=132, recipe="blockwise")
        assert cfg.reason.startswith("measured: bench/results/X/sweep.jsonl")
        assert space.cand_key(space.as_candidate(cfg)) == space.cand_key(cands[5])
        assert not gc.make_config(*args, sms=132).reason.startswith("measured")  # BF16: rules
        assert not gc.make_config(*args, sms=132, recipe="mxfp8").reason.startswith("measured")
        with gc.override(num_warps=2):
            assert gc.make_config(*args, sms=132, recipe="blockwise").num_warps == 2
        # a spawned worker: the compiler, not the interpreter the tests run under
        (res,) = precompile([dict(family="gg_fp8_fwd", shape=space.Shape(
            "table", 8, 2048, 256, 128).as_dict(), cand=entries[key]["config"], cc=90,
            report=True)], 1)  # fmt: skip
        assert res.get("ok") and res["aot"][0]["registers"] > 0, res
    finally:
        gc.TUNED.clear()
        gc._tuned.cache_clear()
