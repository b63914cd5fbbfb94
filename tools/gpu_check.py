"""``make gpu-check``: validate and benchmark mtp on a lent GPU in one command (< 9 minutes).

Runs on the GPU machine with its own ``python3`` (torch, triton, nvcc, ninja, pybind11, pytest;
no network), the checkout on ``PYTHONPATH`` (no install), and the folder ``make gpu-bundle``
made (``.gpu/``: CUTLASS headers, fallback wheels) carried along. Steps, each in its own process
group with a time box; a failed or timed-out step never stops the next one:

1. ``env``: GPU name, driver, clocks and limits as nvidia-smi reads them, torch/triton/CUDA/nvcc
   versions, CPU count, the bundle's commit -> ``env.json``;
2. ``build``: the CUTLASS extension (``csrc/build_ext.py --inplace``) for this GPU's architecture
   only (sm_90a on H100/H200, sm_100a on B200), ``CUTLASS_DIR`` = the carried headers,
   ``MAX_JOBS`` = cores, timed -> ``build.log``;
3. ``pytest``: ``pytest -m gpu -x`` (``MTP_REQUIRE_CUDA_EXT=1`` when the build succeeded) ->
   ``junit.xml``, ``pytest.log``;
4. ``bench``: ``python -m bench OP --quick`` per op family (each call keeps the earlier ones'
   records), so a slow family costs only itself -> ``results.json``, ``results.md``, PNGs;
5. ``summary``: a short table printed last (steps, tests passed/failed, and per op the best mtp
   backend's time and every other provider's time over it) -> ``summary.txt``.

Where it writes: with ``--out DIR`` or ``$OUT`` set (the device tool), everything goes to a
scratch folder laid out as ``<device>/...`` (bench files) and ``<device>/gpu-check/...`` (the
rest), packed into ``DIR/gpu-check.tar.gz``, and the key files are also copied flat into DIR
(the device tool returns at most 8 files): unpack with
``tar xzf gpu-check.tar.gz -C bench/results`` and commit. Without either, straight into
``bench/results/<device>/``.

``--dry-run`` (any machine, no GPU needed): walks every step without the GPU-only actions (the
build plan is made against the bundle's headers, the gpu tests are collected, the bench commands
are listed) and writes the table with "not run: no GPU", into ``bench/results/_scratch/`` unless
``--out`` is given.
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
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bundle import WHEEL_MODULES  # noqa: E402
from gpu_report import (  # noqa: E402
    NO_GPU, bench_table, collected_text, junit_counts, progress_text, tests_text, text_table,
)

ROOT = Path(__file__).resolve().parent.parent
# linear_cross_entropy last: its GEMM-sized cases (and a torch.compile) must not starve the rest
BENCH_OPS = ("bias_act", "cross_entropy", "permute", "grouped_gemm", "moe_layer",
             "linear_cross_entropy")
# capability -> MTP_CUDA_ARCH_LIST entry (only these have CUTLASS kernels)
ARCH_OF_CAPABILITY = {"9.0": "9.0a", "10.0": "10.0a"}
SMI_FIELDS = ("name", "driver_version", "pci.bus_id", "memory.total", "power.limit",
              "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "clocks.applications.graphics", "temperature.gpu", "persistence_mode",
              "compute_mode")  # fmt: skip
# Versions, the GPU and the bench's folder name for it, in a child process (a broken torch or
# CUDA must not take this script down).
TORCH_PROBE = textwrap.dedent("""\
    import json, torch, triton
    d = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
             cuda_available=torch.cuda.is_available())
    if d["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        d.update(device=p.name, capability=f"{p.major}.{p.minor}",
                 sm_count=p.multi_processor_count, memory_bytes=p.total_memory)
        try:
            from bench.env import device_folder
            from bench.peaks import match_peak

            peak = match_peak(p.name, p.multi_processor_count)
            d["folder"] = device_folder(dict(mode="gpu", device=p.name),
                                        peak.name if peak else None)
        except Exception as exc:
            d["folder_error"] = repr(exc)
    print(json.dumps(d))
    """)
FLAT_FILES = ("summary.txt", "env.json", "junit.xml", "pytest.log", "results.json", "results.md")


class Checker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.steps: list[dict] = []
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.pop("TRITON_INTERPRET", None)
        self.bundle = (ROOT / args.bundle).resolve() if args.bundle else None
        self.record: dict = {}
        self.device = "dry-run" if self.dry else "gpu"
        self.final_out = args.out
        if self.final_out is not None:
            self.root = Path(tempfile.mkdtemp(prefix="mtp-gpu-check-"))
        elif self.dry:
            self.root = ROOT / "bench" / "results" / "_scratch" / "gpu-check-dry-run"
        else:
            self.root = ROOT / "bench" / "results"

    # -- paths -----------------------------------------------------------------------------

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

    # -- running things --------------------------------------------------------------------

    def run(self, cmd: list[str], log: Path, cap: float, env: dict | None = None,
            reserve: float = 15.0) -> tuple[str, int | None, float]:
        """Run ``cmd`` with output to ``log``, killed (whole process group) after
        ``min(cap, time left - reserve)`` s. Returns (status, returncode, seconds)."""
        limit = min(cap, self.remaining() - reserve)
        if self.remaining() - reserve < 5:
            with open(log, "a") as f:
                f.write(f"$ {shlex.join(cmd)}\nnot run: time budget spent\n")
            return "skipped (budget)", None, 0.0
        t0 = time.monotonic()
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                f.write(f"\n[gpu-check] killed after {limit:.0f} s (time box)\n")
                return f"timeout ({limit:.0f} s)", None, time.monotonic() - t0
        seconds = time.monotonic() - t0
        return ("ok" if rc == 0 else f"failed (rc {rc})"), rc, seconds

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

    # -- step 0: fallback wheels -----------------------------------------------------------

    def prepare(self) -> None:
        wheels = sorted((self.bundle / "wheels").glob("*.whl")) if self.bundle else []
        missing = [w for w in wheels
                   if self.python(f"import {WHEEL_MODULES.get(w.name.split('-')[0], '_')}") is None]
        if not missing:
            return
        site = Path(tempfile.gettempdir()) / "mtp-gpu-site"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--upgrade", "--target", str(site), *map(str, missing)]  # fmt: skip
        ok = subprocess.run(cmd, capture_output=True, text=True).returncode == 0
        if ok:
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        print(f"[gpu-check] installed {'' if ok else 'FAILED '}{[w.name for w in missing]}",
              flush=True)

    # -- step 1: environment ---------------------------------------------------------------

    def step_env(self) -> None:
        t0 = time.monotonic()
        rec: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                     "dry_run": self.dry}  # fmt: skip
        manifest = self.bundle / "MANIFEST.json" if self.bundle else None
        if manifest and manifest.exists():
            data = json.loads(manifest.read_text())
            rec["bundle"] = {k: data.get(k) for k in ("commit", "cutlass_version", "headers")}
        out = self.python(TORCH_PROBE, timeout=120)
        rec.update(json.loads(out) if out else {"torch": None, "error": "torch/triton failed"})
        self.record = rec
        gpu = rec.get("cuda_available")
        if self.dry and gpu:
            print("[gpu-check] --dry-run on a GPU machine: GPU actions skipped all the same")
        self.device = rec.get("folder", "gpu") if gpu and not self.dry else self.device
        rec["nvidia_smi"] = _nvidia_smi()
        clocks = _smi(["-q", "-d", "CLOCK,PERFORMANCE,POWER"])
        if clocks:
            (self.own / "nvidia-smi.txt").write_text(clocks)
        rec["nvcc"] = _first_line([_which_nvcc(), "--version"], pick="release")
        (self.own / "env.json").write_text(json.dumps(rec, indent=2) + "\n")
        detail = ", ".join(
            f"{k} {rec.get(k)}" for k in ("device", "torch", "triton", "cuda") if rec.get(k)
        )
        smi = rec["nvidia_smi"]
        if smi:
            detail += f", driver {smi.get('driver_version')}, SM clock {smi.get('clocks.sm')}"
        self.step("env", "ok" if rec.get("torch") else "failed", time.monotonic() - t0,
                  detail or "torch not importable")  # fmt: skip

    @property
    def has_gpu(self) -> bool:
        return bool(self.record.get("cuda_available")) and not self.dry

    # -- step 2: the CUTLASS extension -----------------------------------------------------

    def step_build(self) -> None:
        log = self.own / "build.log"
        log.write_text("")
        arch = ARCH_OF_CAPABILITY.get(self.record.get("capability", ""), None)
        if self.dry:
            arch = arch or "9.0a"
        if arch is None:
            self.step("build", "skipped", 0, f"no CUTLASS kernels for capability "
                      f"{self.record.get('capability')}", log)  # fmt: skip
            return
        env = dict(self.env, MTP_CUDA_ARCH_LIST=arch, MAX_JOBS=str(os.cpu_count() or 1))
        if self.bundle:
            env["CUTLASS_DIR"] = str(self.bundle / "cutlass")
        cmd = [sys.executable, "csrc/build_ext.py", "--inplace", "-j", env["MAX_JOBS"]]
        if self.dry and not Path(_which_nvcc()).exists():
            self.build_ok = False
            self.step("build", "dry-run: no nvcc", 0, f"{arch}: no nvcc on this machine", log)
            return
        if self.dry:
            cmd = [sys.executable, "csrc/build_ext.py", "--print-ninja"]
        status, rc, seconds = self.run(cmd, log, self.args.build_cap_s, env=env)
        self.build_ok = rc == 0 and not self.dry
        where = f"CUTLASS_DIR={env.get('CUTLASS_DIR', '(package)')}"
        if self.dry:
            status = "dry-run ok" if rc == 0 else status
            detail = f"build plan for {arch} against {where} (nvcc not run)"
        else:
            detail = f"{arch}, MAX_JOBS={env['MAX_JOBS']}, {where}"
        self.record["build"] = dict(status=status, seconds=round(seconds, 1), arch=arch)
        self.step("build", status, seconds, detail, log)

    # -- step 3: gpu tests -----------------------------------------------------------------

    def step_pytest(self) -> None:
        log, junit = self.own / "pytest.log", self.own / "junit.xml"
        log.write_text("")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "tests"]  # fmt: skip
        env = dict(self.env)
        if getattr(self, "build_ok", False):
            env["MTP_REQUIRE_CUDA_EXT"] = "1"
        if self.dry or not self.has_gpu:
            cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                   "--collect-only", "tests"]  # fmt: skip
            env.setdefault("OMP_NUM_THREADS", "1")
        status, rc, seconds = self.run(cmd, log, self.args.pytest_cap_s, env=env)
        if self.dry or not self.has_gpu:
            collected = collected_text(log)
            self.tests = {"note": f"{NO_GPU} ({collected} tests collected with -m gpu)"}
            ok = rc == 0
            self.step("pytest", "dry-run ok" if ok else status, seconds, self.tests["note"], log)
            return
        if junit.exists():
            self.tests = junit_counts(junit)
        else:  # killed by its time box: pytest writes the JUnit file only at the end
            self.tests = {"note": f"{progress_text(log)} before the {status}"}
        self.step("pytest", status, seconds, tests_text(self.tests), log)

    # -- step 4: benchmarks ----------------------------------------------------------------

    def step_bench(self) -> None:
        log = self.own / "bench.log"
        log.write_text("")
        ops = self.args.bench_ops
        if self.dry or not self.has_gpu:
            for op in ops:
                cmd = [sys.executable, "-m", "bench", op, "--quick", "--mode", "gpu",
                       "--out", str(self.root), "--no-progress"]  # fmt: skip
                with open(log, "a") as f:
                    f.write(f"{NO_GPU}: {shlex.join(cmd)}\n")
            with open(log, "a") as f:
                f.write(f"{NO_GPU}: {shlex.join(self.graphs_cmd())}\n")
            self.step("bench", NO_GPU, 0, f"would run {len(ops)} op families: {', '.join(ops)}"
                      " and eager vs graphed steps")  # fmt: skip
            return
        t0, results = time.monotonic(), []
        for i, op in enumerate(ops):
            # Share what is left between this family and the ones after it (at least half).
            left = len(ops) - i
            cap = max(self.remaining() / max(1, left) * 2, 30) if left > 1 else self.remaining()
            cmd = [sys.executable, "-m", "bench", op, "--quick", "--mode", "gpu",
                   "--out", str(self.root), "--no-progress", *self.args.bench_args]  # fmt: skip
            status, _, seconds = self.run(cmd, log, cap)
            results.append(f"{op} {status}")
            print(f"[gpu-check]   bench {op}: {status} in {seconds:.0f} s", flush=True)
        # Eager vs CUDA-graphed steps (bench/bench_graphs.py: host time, launches), its own log.
        status, _, seconds = self.run(self.graphs_cmd(), self.own / "graphs.log", 90)
        results.append(f"graphs {status}")
        print(f"[gpu-check]   bench graphs: {status} in {seconds:.0f} s", flush=True)
        n_ok = sum(r.endswith(" ok") for r in results)
        status = "ok" if n_ok == len(results) else f"failed ({n_ok}/{len(results)} ok)"
        self.step("bench", status, time.monotonic() - t0, "; ".join(results), log)

    @staticmethod
    def graphs_cmd() -> list[str]:
        return [sys.executable, "-m", "bench.bench_graphs", "--iters", "5"]

    # -- step 5: summary -------------------------------------------------------------------

    def summary(self) -> str:
        rec = self.record
        lines = [f"== mtp gpu-check: {rec.get('device') or 'no GPU'}, {rec.get('date')}, commit "
                 f"{(rec.get('bundle') or {}).get('commit') or '?'}, "
                 f"torch {rec.get('torch')}, triton {rec.get('triton')} =="]  # fmt: skip
        rows = [[s["step"], s["status"], f"{s['seconds']:.0f}", s["detail"]] for s in self.steps]
        lines += text_table(["step", "status", "s", "detail"], rows)
        lines.append("")
        lines.append(f"tests: {tests_text(getattr(self, 'tests', {'note': 'not run'}))}")
        results = self.results_json()
        if not self.has_gpu:
            lines.append(f"bench: {NO_GPU}")
        elif results is None:
            lines.append("bench: no results.json")
        else:
            lines += bench_table(json.loads(results.read_text()))
        where = (Path(self.final_out) / "gpu-check.tar.gz") if self.final_out else self.folder
        lines.append(f"total {time.monotonic() - self.start:.0f} s; files: {where}")
        return "\n".join(lines)

    def results_json(self) -> Path | None:
        """The bench's results.json: in <device>/, or (scratch root) in whatever folder the
        bench named when the env step could not name it."""
        if (self.folder / "results.json").exists():
            return self.folder / "results.json"
        found = sorted(self.root.glob("*/results.json")) if self.final_out is not None else []
        return found[0] if found else None

    def finish(self) -> int:
        smi = _nvidia_smi()
        if smi and self.record:  # clocks again, after the load
            self.record["nvidia_smi_after"] = smi
            (self.own / "env.json").write_text(json.dumps(self.record, indent=2) + "\n")
        text = self.summary()
        (self.own / "summary.txt").write_text(text + "\n")
        (self.own / "steps.json").write_text(json.dumps(self.steps, indent=2) + "\n")
        if self.final_out is not None:
            out = Path(self.final_out)
            out.mkdir(parents=True, exist_ok=True)
            with tarfile.open(out / "gpu-check.tar.gz", "w:gz") as tar:
                for child in sorted(self.root.iterdir()):  # the scratch root: <device>/ only
                    tar.add(child, arcname=child.name)
            results = self.results_json()
            for name in FLAT_FILES:
                for src in (self.own / name, self.folder / name, results and results.parent / name):
                    if src and src.exists():
                        shutil.copy2(src, out / name)
                        break
            shutil.rmtree(self.root, ignore_errors=True)
            text += f"\n(unpack here with: tar xzf gpu-check.tar.gz -C bench/results)"
        print("\n" + text, flush=True)
        failed = [s for s in self.steps if s["status"].startswith(("failed", "timeout"))]
        return 1 if failed else 0


# ----------------------------------------------------------------------------------------------
# Process and nvidia-smi helpers
# ----------------------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _which_nvcc() -> str:
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def _first_line(cmd: list[str], pick: str = "") -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if pick in ln]
    return lines[0] if out.returncode == 0 and lines else None


def _smi(args: list[str]) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def _nvidia_smi() -> dict | None:
    """GPU 0's nvidia-smi fields (clocks as read now, MHz); None without nvidia-smi. A field
    this driver does not know is asked alone, so one bad name costs only itself."""
    fmt = "--format=csv,noheader"
    text = _smi([f"--query-gpu={','.join(SMI_FIELDS)}", fmt])
    if text is not None:
        return dict(zip(SMI_FIELDS, (v.strip() for v in text.splitlines()[0].split(","))))
    if _smi(["-L"]) is None:
        return None
    fields = {}
    for field in SMI_FIELDS:
        one = _smi([f"--query-gpu={field}", fmt])
        fields[field] = one.splitlines()[0].strip() if one else None
    return fields


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=".gpu", help="the folder make gpu-bundle filled")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="pack the results here (default: $OUT, else bench/results/<gpu>/)")
    parser.add_argument("--dry-run", action="store_true", help="walk the steps without a GPU")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get(
        "MTP_GPU_CHECK_BUDGET_S", 510)), help="whole run (default 510 s)")  # fmt: skip
    parser.add_argument("--build-cap-s", type=float, default=240)
    parser.add_argument("--pytest-cap-s", type=float, default=150)
    parser.add_argument("--bench-ops", nargs="+", default=list(BENCH_OPS), metavar="OP")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="extra mtp-bench arguments (last on the line)")
    parser.add_argument("--skip", nargs="+", default=[], choices=("build", "pytest", "bench"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    checker = Checker(args)
    if checker.root.exists() and args.dry_run and args.out is None:
        shutil.rmtree(checker.root)
    print(f"[gpu-check] {'DRY RUN, ' if args.dry_run else ''}budget {args.budget_s:.0f} s, "
          f"bundle {checker.bundle}, writing under {checker.root}", flush=True)
    if checker.bundle is None or not (checker.bundle / "cutlass").is_dir():
        print(f"[gpu-check] WARNING: no bundle at {checker.bundle}: the CUTLASS build will fail "
              "(run `make gpu-bundle` on the CPU side and carry .gpu)", flush=True)
    checker.prepare()
    checker.step_env()
    for name in ("build", "pytest", "bench"):
        if name in args.skip:
            checker.step(name, "skipped (--skip)", 0, "")
            if name == "pytest":
                checker.tests = {"note": "not run (--skip pytest)"}
            continue
        try:
            getattr(checker, f"step_{name}")()
        except Exception as exc:  # noqa: BLE001 - one broken step never costs the rest
            checker.step(name, "failed (gpu-check error)", 0, f"{type(exc).__name__}: {exc}")
    return checker.finish()


if __name__ == "__main__":
    sys.exit(main())
