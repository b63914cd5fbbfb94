"""``make gpu-check``: validate and benchmark mtp on a lent GPU in one call of at most 9 minutes.

A lent GPU machine gives a session 15 minutes in all (its start and every idle second count),
at most 10 per command, and returns at most 8 files from ``$OUT``. So this script runs a fixed
plan ordered by value, each step in its own process group with a deadline, and re-packs
``$OUT`` after every step (and on SIGTERM/SIGINT): a command killed at its limit still returns
every finished step. ``python tools/gpu_check.py --plan`` prints the plan.

Steps, in run order (seconds are shares; a step that ends early gives its time to the next,
since each step's deadline is the sum of the shares up to it):

``env``: versions, the GPU and its clocks, the bundle's commit; the carried CUTLASS module
(``.gpu/ext/``, built here by ``make gpu-bundle``) copied next to ``mtp/__init__.py``.
``sweep``: ``tools/gpu_sweep.py``: candidate configs of every kernel family at the bench shapes,
compiled in parallel, checked and timed against today's defaults and the peers
(``gpu-check/sweep.jsonl``, one record per candidate as it ends; ``sweep-summary.txt``).
``smoke``: ``tools/gpu_smoke.py``: import every mtp module, one tiny call per op family against
its reference (a torch/triton mismatch shows in seconds).
``build``: only when the carried CUTLASS module does not import: ``csrc/build_ext.py`` for this
GPU (its time comes out of the later steps).
``graphs``, ``grouped_gemm``, ``linear_cross_entropy``, ``moe_layer``: the quick bench (``python
-m bench OP --quick --no-plots --budget-s``: no profiler pass, no timing of the loop backends,
``results.json`` rewritten after every case).
``pytest``: ``-m gpu``, no ``-x``, a per-test timeout, xdist workers, the Triton tests before
the CUTLASS ones, failing test ids written to ``failures.txt`` as they happen.
``cross_entropy``, ``bias_act``, ``permute``, ``quantize``: the memory-bound families.
``ncu``: only on time left over (share 0): ``tools/gpu_ncu.py``, one Nsight Compute reading of
each of the slowest kernels against their floor (``ncu/`` in the tarball).

Where it writes: with ``--out DIR`` or ``$OUT`` set (the device tool), everything goes to a
scratch folder laid out as ``<device>/...`` (bench files) and ``<device>/gpu-check/...`` (the
rest), packed into ``DIR/gpu-check.tar.gz`` with the key files also copied flat into ``DIR``:
unpack with ``tar xzf gpu-check.tar.gz -C bench/results``. Without either, straight into
``bench/results/<device>/``. ``--dry-run`` (any machine): walks the plan without the GPU
actions (GPU tests collected, bench commands listed, ``--dry-step-s`` seconds of sleep per bench
step for the kill test).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bundle import EXT_FOLDER, TRITON_CACHE, WHEEL_MODULES  # noqa: E402
from gpu_probe import TORCH_PROBE, first_line, kill_group, nvidia_smi, smi, which_nvcc  # noqa: E402
from sweep_cache import KEY_PROBE, unpack  # noqa: E402
from gpu_report import (  # noqa: E402
    NO_GPU, bench_table, collected_text, failures_text, graphs_table, junit_counts,
    merge_counts, merge_junit, progress_text, tests_text, text_table,
)

ROOT = Path(__file__).resolve().parent.parent
#: (step, seconds), in run order. The sum is the whole run's budget (at most 540 s: the device
#: tool's 600 s command limit less Python's start, the wheel install and the last pack).
PLAN = (("env", 15), ("sweep", 225), ("smoke", 20), ("build", 0), ("grouped_gemm", 60),
        ("moe_layer", 45), ("pytest", 90), ("linear_cross_entropy", 25), ("graphs", 15),
        ("cross_entropy", 10), ("bias_act", 10), ("permute", 10), ("quantize", 15),
        ("ncu", 0))  # fmt: skip
BENCH_STEPS = ("grouped_gemm", "linear_cross_entropy", "moe_layer", "cross_entropy", "bias_act",
               "permute", "quantize")  # fmt: skip
DRY_SWEEP_CAP_S = 3600  # --dry-sweep on CPU: the interpreter and the compiles take minutes
BUILD_CAP_S = 150  # the CUTLASS build when the carried module does not load (16 cores: ~100 s)
ARCH_OF_CAPABILITY = {"9.0": "9.0a", "10.0": "10.0a"}  # only these have CUTLASS kernels
#: At most 8 files come back: the tarball holds everything, these are also copied flat.
FLAT_FILES = ("summary.txt", "env.json", "results.json", "failures.txt", "pytest.log",
              "junit.xml", "sweep.jsonl")  # fmt: skip
CUTLASS_TESTS = "tests/test_cutlass_grouped_gemm.py"


class Checker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run
        self.start = time.monotonic()
        self.shares = dict(PLAN)
        self.deadline = self.start + sum(self.shares.values())
        self.steps: list[dict] = []
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.pop("TRITON_INTERPRET", None)
        self.bundle = (ROOT / args.bundle).resolve() if args.bundle else None
        self.record: dict = {}
        self.tests: dict = {"note": "not run"}
        self.device = "dry-run" if self.dry else "gpu"
        self.child: subprocess.Popen | None = None
        self.final_out = args.out
        if self.final_out is not None:
            self.root = Path(tempfile.mkdtemp(prefix="mtp-gpu-check-"))
        elif self.dry:
            self.root = ROOT / "bench" / "results" / "_scratch" / "gpu-check-dry-run"
        else:
            self.root = ROOT / "bench" / "results"

    # -- paths and time ---------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        """<root>/<device>/: where the bench writes."""
        return self.root / self.device

    @property
    def own(self) -> Path:
        """<root>/<device>/gpu-check/: this script's files."""
        path = self.folder / "gpu-check"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def step_deadline(self, name: str) -> float:
        """The end of ``name``'s share: the start plus the shares up to and including it."""
        total = 0
        for step, seconds in PLAN:
            total += seconds
            if step == name:
                break
        return self.start + total

    # -- running things ---------------------------------------------------------------------

    def run(self, cmd: list[str], log: Path, cap: float, env: dict | None = None,
            reserve: float = 5.0) -> tuple[str, int | None, float]:
        """Run ``cmd`` with output to ``log``, killed (whole process group) after
        ``min(cap, time left - reserve)`` s. Returns (status, returncode, seconds)."""
        budget = self.remaining() - reserve
        limit = min(cap, budget)
        if budget < 3 or limit <= 0:
            with open(log, "a") as f:
                f.write(f"$ {shlex.join(cmd)}\nnot run: time budget spent\n")
            return "skipped (budget)", None, 0.0
        t0 = time.monotonic()
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            self.child = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = self.child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                kill_group(self.child)
                f.write(f"\n[gpu-check] killed after {limit:.0f} s (time box)\n")
                return f"timeout ({limit:.0f} s)", None, time.monotonic() - t0
            finally:
                self.child = None
        return ("ok" if rc == 0 else f"failed (rc {rc})"), rc, time.monotonic() - t0

    def python(self, code: str, timeout: float = 60) -> str | None:
        """stdout of ``python -c code`` in the run's environment, None on failure."""
        try:
            out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=self.env,
                                 capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    def step(self, name: str, status: str, seconds: float, detail: str, log: Path | None = None):
        self.steps.append(dict(step=name, status=status, seconds=round(seconds, 1), detail=detail))
        print(f"[gpu-check] {name}: {status} in {seconds:.1f} s; {detail}", flush=True)
        if log is not None and not status.startswith(("ok", "not run", "dry-run")) and log.exists():
            tail = log.read_text(errors="replace").splitlines()[-12:]
            print("\n".join(f"    | {line}" for line in tail), flush=True)
        self.pack()

    @property
    def has_gpu(self) -> bool:
        return bool(self.record.get("cuda_available")) and not self.dry

    # -- env --------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Install the carried wheels whose module does not import here (no network there)."""
        wheels = sorted((self.bundle / "wheels").glob("*.whl")) if self.bundle else []
        names = {w: WHEEL_MODULES.get(w.name.split("-")[0], "_") for w in wheels}
        probe = "import importlib.util as u, json, sys; print(json.dumps([m for m in " \
                "sys.argv[1:] if u.find_spec(m.split('.')[0]) is None]))"
        out = subprocess.run([sys.executable, "-c", probe, *names.values()], capture_output=True,
                             text=True, env=self.env).stdout.strip()  # fmt: skip
        absent = set(json.loads(out or "[]"))
        missing = [w for w, module in names.items() if module in absent]
        if not missing:
            return
        site = Path(tempfile.gettempdir()) / "mtp-gpu-site"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--upgrade", "--target", str(site), *map(str, missing)]  # fmt: skip
        ok = subprocess.run(cmd, capture_output=True, text=True).returncode == 0
        if ok:
            self.env["PYTHONPATH"] = os.pathsep.join([self.env["PYTHONPATH"], str(site)])
        print(f"[gpu-check] installed {'' if ok else 'FAILED '}{[w.name for w in missing]}",
              flush=True)

    def step_env(self) -> None:
        t0 = time.monotonic()
        rec: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                     "dry_run": self.dry}  # fmt: skip
        manifest = self.bundle / "MANIFEST.json" if self.bundle else None
        if manifest and manifest.exists():
            data = json.loads(manifest.read_text())
            rec["bundle"] = {k: data.get(k) for k in ("commit", "cutlass_version", "headers",
                                                      "extension")}  # fmt: skip
            if data.get("commit"):
                self.env["MTP_REVISION"] = data["commit"]
        rec["carried_extension"] = self.place_extension()
        rec["triton_cache"] = self.place_triton_cache(
            json.loads(manifest.read_text()) if manifest and manifest.exists() else {})
        out = self.python(TORCH_PROBE, timeout=120)
        rec.update(json.loads(out) if out else {"torch": None, "error": "torch/triton failed"})
        self.record = rec
        if self.dry and rec.get("cuda_available"):
            print("[gpu-check] --dry-run on a GPU machine: GPU actions skipped all the same")
        self.device = rec.get("folder", "gpu") if self.has_gpu else self.device
        rec["nvidia_smi"] = nvidia_smi()
        clocks = smi(["-q", "-d", "CLOCK,PERFORMANCE,POWER"])
        if clocks:
            (self.own / "nvidia-smi.txt").write_text(clocks)
        rec["nvcc"] = first_line([which_nvcc(), "--version"], pick="release")
        self.write_env()
        detail = ", ".join(
            f"{k} {rec.get(k)}" for k in ("device", "torch", "triton", "cuda") if rec.get(k)
        )
        if rec["nvidia_smi"]:
            detail += (f", driver {rec['nvidia_smi'].get('driver_version')}, SM clock "
                       f"{rec['nvidia_smi'].get('clocks.sm')}")  # fmt: skip
        self.step("env", "ok" if rec.get("torch") else "failed", time.monotonic() - t0,
                  detail or "torch not importable")  # fmt: skip

    def place_extension(self) -> str | None:
        """Copy the carried ``_cuda_gemm*.so`` next to ``mtp/__init__.py`` (unless one is there):
        its file name, or None when the bundle has none."""
        carried = sorted((self.bundle / EXT_FOLDER).glob("_cuda_gemm*.so")) if self.bundle else []
        for so in carried:
            dest = ROOT / "mtp" / so.name
            if not dest.exists() and not self.dry:
                shutil.copy2(so, dest)
        return carried[0].name if carried else None

    def place_triton_cache(self, manifest: dict) -> dict | None:
        """Unpack the carried Triton cache (``make gpu-bundle``) and point ``TRITON_CACHE_DIR``
        at it; whether this triton's key is the one it was built with (else every lookup
        misses and the kernels compile here)."""
        archive = self.bundle / TRITON_CACHE if self.bundle else None
        if archive is None or not archive.exists():
            return None
        cache = Path(tempfile.gettempdir()) / "mtp-triton-cache"
        entries = unpack(archive, cache)
        self.env["TRITON_CACHE_DIR"] = str(cache)
        key, built = self.python(KEY_PROBE), (manifest.get("triton_cache") or {}).get("triton_key")
        return {"dir": str(cache), "entries": entries, "triton_key": key, "built_with": built,
                "keys_match": key == built}  # fmt: skip

    def write_env(self) -> None:
        (self.own / "env.json").write_text(json.dumps(self.record, indent=2) + "\n")

    # -- smoke and build --------------------------------------------------------------------

    def step_smoke(self) -> None:
        log, report = self.own / "smoke.log", self.own / "smoke.json"
        cmd = [sys.executable, "tools/gpu_smoke.py", "--json", str(report)]
        if self.dry or not self.has_gpu:
            cmd.append("--imports-only")
        status, _, seconds = self.run(cmd, log, self.step_deadline("smoke") - time.monotonic())
        data = json.loads(report.read_text()) if report.exists() else {}
        self.record["smoke"] = data
        self.cutlass_ok = data.get("cutlass") == "ok"
        self.write_env()
        detail = data.get("summary", "no smoke.json")
        self.step("smoke", status, seconds, detail, log)

    def step_build(self) -> None:
        log = self.own / "build.log"
        arch = ARCH_OF_CAPABILITY.get(self.record.get("capability", ""), None)
        if self.dry:
            arch = arch or "9.0a"
        if getattr(self, "cutlass_ok", False) and not self.dry:  # a dry run walks the plan
            self.step("build", "not needed", 0, "the carried CUTLASS module loads")
            return
        if arch is None:
            self.step("build", "skipped", 0, f"no CUTLASS kernels for capability "
                      f"{self.record.get('capability')}")  # fmt: skip
            return
        env = dict(self.env, MTP_CUDA_ARCH_LIST=arch, MAX_JOBS=str(os.cpu_count() or 1))
        if self.bundle:
            env["CUTLASS_DIR"] = str(self.bundle / "cutlass")
        if self.dry:
            cmd = [sys.executable, "csrc/build_ext.py", "--print-ninja"]
        else:
            cmd = [sys.executable, "csrc/build_ext.py", "--inplace", "-j", env["MAX_JOBS"]]
        if self.dry and not Path(which_nvcc()).exists():
            self.step("build", "dry-run: no nvcc", 0, f"{arch}: no nvcc on this machine", log)
            return
        status, rc, seconds = self.run(cmd, log, BUILD_CAP_S, env=env)
        if self.dry:
            status = "dry-run ok" if rc == 0 else status
        self.record["build"] = dict(status=status, seconds=round(seconds, 1), arch=arch)
        self.step("build", status, seconds, f"{arch}, CUTLASS_DIR={env.get('CUTLASS_DIR')}", log)

    # -- the tuning sweep -------------------------------------------------------------------

    def step_sweep(self) -> None:
        log, data = self.own / "sweep.log", self.own / "sweep.jsonl"
        cap = self.step_deadline("sweep") - time.monotonic()
        cmd = [sys.executable, "tools/gpu_sweep.py", "--jsonl", str(data),
               "--budget-s", f"{max(cap - 15, 1):.0f}", *self.args.sweep_args]  # fmt: skip
        if self.dry or not self.has_gpu:
            walk = self.args.dry_sweep is not None or "sweep" in (self.args.only or ())
            if not walk:  # the whole walk takes minutes: only when asked for
                return self.dry_bench("sweep", cmd + ["--dry-run"], log)
            cmd += ["--dry-run", *(self.args.dry_sweep or [])]
            cap = max(cap, DRY_SWEEP_CAP_S)
        status, rc, seconds = self.run(cmd, log, cap)
        records = [json.loads(line) for line in data.read_text().splitlines()
                   if line.strip()] if data.exists() else []  # fmt: skip
        timed = sum(r.get("stage") == "gpu" and r.get("status") == "ok" for r in records)
        checked = sum(r.get("stage") in ("interp", "aot") for r in records)
        detail = f"{timed} timed, {checked} dry-run checks, {len(records)} records"
        self.step("sweep", "dry-run ok" if self.dry and rc == 0 else status, seconds, detail, log)

    # -- graphs and the bench families ------------------------------------------------------

    def step_graphs(self) -> None:
        log, data = self.own / "graphs.log", self.own / "graphs.json"
        cmd = [sys.executable, "-m", "bench.bench_graphs", "--iters", "5", "--json", str(data)]
        if self.dry or not self.has_gpu:
            return self.dry_bench("graphs", cmd, log)
        status, _, seconds = self.run(cmd, log, self.step_deadline("graphs") - time.monotonic())
        rows = json.loads(data.read_text())["rows"] if data.exists() else []
        self.step("graphs", status, seconds, f"{len(rows)} rows", log)

    def step_bench(self, op: str) -> None:
        log = self.own / f"bench-{op}.log"
        cap = self.step_deadline(op) - time.monotonic()
        cmd = [sys.executable, "-m", "bench", op, "--quick", "--mode", "gpu", "--out",
               str(self.root), "--no-plots", "--ceilings",
               str(self.own / "ceilings.json"), "--budget-s", f"{max(cap - 15, 1):.0f}",
               *self.args.bench_args]  # fmt: skip
        if self.dry or not self.has_gpu:
            return self.dry_bench(op, cmd, log)
        status, _, seconds = self.run(cmd, log, cap)
        records = [r for r in self.bench_records() if r.get("family") == op]
        done = sum(r["status"] == "ok" for r in records)
        failed = sum(r["status"] == "failed" for r in records)
        self.step(op, status, seconds, f"{done} timed, {failed} failed of {len(records)} records",
                  log)  # fmt: skip

    def dry_bench(self, name: str, cmd: list[str], log: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{NO_GPU}: {shlex.join(cmd)}\n")
        if self.args.dry_step_s:  # stands in for the step's work (the kill test)
            time.sleep(self.args.dry_step_s)
        self.step(name, NO_GPU, 0, "command in the log")

    def step_ncu(self) -> None:
        log, folder = self.own / "ncu.log", self.own / "ncu"
        cap = self.step_deadline("ncu") - time.monotonic() - 5
        cmd = [sys.executable, "tools/gpu_ncu.py", "--out", str(folder), "--timeout",
               f"{max(min(cap / 3, 60), 1):.0f}"]  # fmt: skip
        if self.dry or not self.has_gpu:
            return self.dry_bench("ncu", cmd, log)
        status, _, seconds = self.run(cmd, log, cap)
        data = folder / "kernels.json"
        rows = json.loads(data.read_text()) if data.exists() else []
        read = sum(r.get("rc") == 0 for r in rows)
        self.step("ncu", status, seconds, f"{read} of {len(rows)} targets read "
                  f"({rows[0]['tool'] if rows else 'none'})", log)  # fmt: skip

    # -- pytest -----------------------------------------------------------------------------

    def step_pytest(self) -> None:
        log, failures = self.own / "pytest.log", self.own / "failures.txt"
        failures.touch()
        env = dict(self.env, MTP_FAILURES_FILE=str(failures))
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "tools")])
        if getattr(self, "cutlass_ok", False) or self.record.get("build", {}).get("status") == "ok":
            env["MTP_REQUIRE_CUDA_EXT"] = "1"
        base = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                "-p", "pytest_live_failures"]  # fmt: skip
        if self.dry or not self.has_gpu:
            env.setdefault("OMP_NUM_THREADS", "1")
            status, rc, seconds = self.run([*base, "--collect-only", "tests"], log, 120, env=env)
            self.tests = {"note": f"{NO_GPU} ({collected_text(log)} tests collected with -m gpu)"}
            self.step("pytest", "dry-run ok" if rc == 0 else status, seconds, self.tests["note"],
                      log)  # fmt: skip
            return
        workers = ["-n", str(min(4, os.cpu_count() or 1))] if self.has_module("xdist") else []
        timeout = ["--timeout", "90"] if self.has_module("pytest_timeout") else []
        end = self.step_deadline("pytest")
        parts = ((f"--ignore={CUTLASS_TESTS}", "tests"), (CUTLASS_TESTS,))  # Triton first
        statuses, t0, counts = [], time.monotonic(), []
        for i, part in enumerate(parts):
            junit = self.own / f"junit-{i}.xml"
            # the Triton tests may use all but 30 s of the share; CUTLASS gets the rest
            cap = (end - time.monotonic()) - (30 if i == 0 else 0)
            status, _, _ = self.run([*base, *workers, *timeout, f"--junitxml={junit}", *part],
                                    log, cap, env=env)  # fmt: skip
            statuses.append(status)
            counts.append(junit_counts(junit) if junit.exists()
                          else {"note": f"{progress_text(log)} before the {status}"})
        self.tests = merge_counts(counts)
        merge_junit([self.own / f"junit-{i}.xml" for i in range(len(parts))],
                     self.own / "junit.xml")  # fmt: skip
        status = next((s for s in statuses if s != "ok"), "ok")
        self.step("pytest", status, time.monotonic() - t0, tests_text(self.tests), log)

    def has_module(self, name: str) -> bool:
        return self.python(f"import {name}") is not None

    # -- summary and packing ----------------------------------------------------------------

    def bench_records(self) -> list[dict]:
        path = self.results_json()
        if path is None:
            return []
        try:
            return json.loads(path.read_text()).get("records", [])
        except ValueError:  # written atomically, but be safe
            return []

    def results_json(self) -> Path | None:
        if (self.folder / "results.json").exists():
            return self.folder / "results.json"
        found = sorted(self.root.glob("*/results.json")) if self.final_out is not None else []
        return found[0] if found else None

    def summary(self) -> str:
        rec = self.record
        lines = [f"== mtp gpu-check: {rec.get('device') or 'no GPU'}, {rec.get('date')}, commit "
                 f"{(rec.get('bundle') or {}).get('commit') or '?'}, "
                 f"torch {rec.get('torch')}, triton {rec.get('triton')} =="]  # fmt: skip
        rows = [[s["step"], s["status"], f"{s['seconds']:.0f}", s["detail"]] for s in self.steps]
        lines += text_table(["step", "status", "s", "detail"], rows)
        lines += ["", f"tests: {tests_text(self.tests)}"]
        lines += failures_text(self.own / "failures.txt")
        path = self.results_json()
        if not self.has_gpu:
            lines.append(f"bench: {NO_GPU}")
        elif path is None:
            lines.append("bench: no results.json")
        else:
            lines += bench_table(json.loads(path.read_text()))
        sweep = self.own / "sweep-summary.txt"
        if sweep.exists():
            lines += ["", *sweep.read_text().splitlines()]
        graphs = self.own / "graphs.json"
        if graphs.exists():
            lines += graphs_table(json.loads(graphs.read_text()))
        where = (Path(self.final_out) / "gpu-check.tar.gz") if self.final_out else self.folder
        lines.append(f"total {time.monotonic() - self.start:.0f} s; files: {where}")
        return "\n".join(lines)

    def pack(self) -> str:
        """summary.txt and steps.json, then (with --out) the tarball and the flat files: called
        after every step, so whatever ends this process leaves the finished steps in --out."""
        text = self.summary()
        (self.own / "summary.txt").write_text(text + "\n")
        (self.own / "steps.json").write_text(json.dumps(self.steps, indent=2) + "\n")
        if self.final_out is None:
            return text
        out = Path(self.final_out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "gpu-check.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for child in sorted(self.root.iterdir()):  # the scratch root: <device>/ only
                tar.add(child, arcname=child.name)
        tmp.replace(out / "gpu-check.tar.gz")
        results = self.results_json()
        for name in FLAT_FILES:
            for src in (self.own / name, results and results.parent / name):
                if src and src.exists():
                    shutil.copy2(src, out / name)
                    break
        return text

    def finish(self) -> int:
        smi_after = nvidia_smi()
        if smi_after and self.record:  # clocks again, after the load
            self.record["nvidia_smi_after"] = smi_after
            self.write_env()
        text = self.pack()
        if self.final_out is not None:
            text += "\n(unpack here with: tar xzf gpu-check.tar.gz -C bench/results)"
        print("\n" + text, flush=True)
        failed = [s for s in self.steps if s["status"].startswith(("failed", "timeout"))]
        return 1 if failed else 0

    def on_signal(self, signum, _frame) -> None:
        """SIGTERM/SIGINT: stop the running step, record it, pack, exit."""
        if self.child is not None:
            kill_group(self.child)
        self.steps.append(dict(step="(signal)", status=f"killed by signal {signum}",
                               seconds=round(time.monotonic() - self.start, 1), detail=""))
        self.pack()
        os._exit(128 + signum)


def plan_text() -> str:
    lines = [f"{step} {seconds}" for step, seconds in PLAN]
    return "\n".join(lines + [f"total {sum(s for _, s in PLAN)}"])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=".gpu", help="the folder make gpu-bundle filled")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="pack the results here (default: $OUT, else bench/results/<gpu>/)")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit")
    parser.add_argument("--dry-run", action="store_true", help="walk the steps without a GPU")
    parser.add_argument("--dry-step-s", type=float, default=0,
                        help="--dry-run: seconds each bench step sleeps (tests)")
    parser.add_argument("--only", nargs="+", default=None, choices=[s for s, _ in PLAN],
                        help="run only these steps (env always runs), e.g. a rerun of failures")
    parser.add_argument("--sweep-args", nargs="+", default=[],
                        help="extra tools/gpu_sweep.py arguments (e.g. --families gg_fwd)")
    parser.add_argument("--dry-sweep", nargs="*", default=None,
                        help="--dry-run: run the sweep's CPU walk (interpreter + sm_90a compile; "
                             "also with --only sweep) with these gpu_sweep.py arguments")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="extra mtp-bench arguments (last on the line)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(plan_text())
        return 0
    checker = Checker(args)
    if checker.root.exists() and args.dry_run and args.out is None:
        shutil.rmtree(checker.root)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, checker.on_signal)
    print(f"[gpu-check] {'DRY RUN, ' if args.dry_run else ''}plan {sum(checker.shares.values())}"
          f" s, bundle {checker.bundle}, writing under {checker.root}", flush=True)
    checker.prepare()
    checker.step_env()
    for name, _ in PLAN[1:]:
        if args.only is not None and name not in args.only:
            continue
        try:
            if name in BENCH_STEPS:
                checker.step_bench(name)
            else:
                getattr(checker, f"step_{name}")()
        except Exception as exc:  # noqa: BLE001 - one broken step never costs the rest
            checker.step(name, "failed (gpu-check error)", 0, f"{type(exc).__name__}: {exc}")
    return checker.finish()


if __name__ == "__main__":
    sys.exit(main())
