"""What limits the slowest kernels against their floor: one Nsight Compute reading each.

Each target is a bench case (``op:pass:group``, the quick shapes of ``python -m bench``) run on
the ``triton`` provider. A child process builds the case, calls it twice (compilation,
allocator) and then once between ``cudaProfilerStart``/``Stop``, so ``ncu
--profile-from-start off`` reads only that call's kernels. Without ``ncu`` (or with
``--no-ncu``) the child times the same call's kernels with ``torch.profiler`` instead.

    python3 tools/gpu_ncu.py --out $OUT [--targets permute:fwd+bwd:Mixtral-like ...]

Writes ``ncu-<op>.csv`` (the details page: one row per kernel, section and metric),
``kernels.json`` (per target: kernel names, durations and the headline metrics) and a log.
``--with-profiler`` adds the torch.profiler table next to each ncu reading.
``--clock-control none`` leaves the clocks alone (the lending notes ask for it).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The memory-bound cases furthest from their floor in bench/results/ (bench/README.md has the
#: figures), slowest first.
DEFAULT_TARGETS = (
    "permute:fwd+bwd:Mixtral-like",
    "unpermute:fwd:Mixtral-like",
    "cross_entropy:fwd+bwd:",
    "bias_gelu:fwd+bwd:",
)
FAMILY_OF = {"permute": "bench_permute", "unpermute": "bench_permute",
             "cross_entropy": "bench_cross_entropy", "bias_gelu": "bench_bias_act",
             "bias_swiglu": "bench_bias_act"}  # fmt: skip
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats")
#: metric name (as ncu's details page writes it) -> short key in kernels.json
HEADLINE = {
    "Duration": "duration",
    "DRAM Throughput": "dram_pct",
    "Memory Throughput": "mem_pct",
    "Compute (SM) Throughput": "sm_pct",
    "Achieved Occupancy": "occupancy_pct",
    "Theoretical Occupancy": "theoretical_occupancy_pct",
    "Registers Per Thread": "registers",
    "Block Size": "block",
    "Grid Size": "grid",
    "Waves Per SM": "waves",
    "Dynamic Shared Memory Per Block": "dyn_smem",
}


def parse_target(text: str) -> tuple[str, str, str]:
    op, pass_, group = (text.split(":") + ["", ""])[:3]
    if op not in FAMILY_OF or pass_ not in ("fwd", "fwd+bwd"):
        raise ValueError(f"target must be op:pass[:group] with op in {sorted(FAMILY_OF)} and "
                         f"pass fwd or fwd+bwd, got {text!r}")
    return op, pass_, group


def _case(op: str, pass_: str, group: str, size: str = "quick"):
    import importlib

    import torch

    mod = importlib.import_module(f"bench.{FAMILY_OF[op]}")
    for case in mod.cases(size, torch.bfloat16):
        if case.op == op and case.pass_ == pass_ and (not group or case.group == group):
            return mod, case
    raise ValueError(f"no {size} bf16 case for {op}:{pass_}:{group}")


def child(target: str, profile: bool, size: str) -> None:
    """Build the target, warm it up, run it once inside the profiler range (on CPU, for the
    tests: the interpreter and the CPU profiler)."""
    import torch

    sys.path.insert(0, str(ROOT))
    op, pass_, group = parse_target(target)
    mod, case = _case(op, pass_, group, size)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    run = mod.SETUP[op](case, "triton", device)
    for _ in range(2):
        run.fn()
    if cuda:
        torch.cuda.synchronize()
    if profile and cuda:
        torch.cuda.cudart().cudaProfilerStart()
        run.fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    from torch.profiler import ProfilerActivity, profile as tprofile, record_function

    with tprofile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        with record_function(target):  # on CPU the range names the call (no kernel rows)
            run.fn()
        if cuda:
            torch.cuda.synchronize()
    rows = [
        {"kernel": e.key, "calls": e.count,
         "duration_us": round(e.device_time_total if cuda else e.self_cpu_time_total, 2)}
        for e in prof.key_averages() if (e.device_time_total if cuda else e.self_cpu_time_total) > 0
    ]  # fmt: skip
    print("KERNELS " + json.dumps({"target": target, "case": case.label, "bytes": case.bytes,
                                   "kernels": rows}))


def summarise(text: str) -> list[dict]:
    """ncu's ``--csv --page details`` text -> one dict per kernel launch with the headline
    metrics (value and unit)."""
    start = text.find('"ID"')
    if start < 0:
        return []
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        k = launches.setdefault(row["ID"], {"kernel": row.get("Kernel Name", "")})
        key = HEADLINE.get(row.get("Metric Name", ""))
        if key and key not in k:
            k[key] = f'{row.get("Metric Value", "")} {row.get("Metric Unit", "")}'.strip()
    return list(launches.values())


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_target(target: str, out: Path, use_ncu: bool, timeout: float, size: str) -> dict:
    op = parse_target(target)[0]
    me = [sys.executable, str(Path(__file__).resolve()), "--child", target, "--size", size]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    if use_ncu:
        cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv",
               "--page", "details", *(a for s in SECTIONS for a in ("--section", s)), *me]
    else:
        cmd = [*me, "--no-ncu"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)  # fmt: skip
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = "timeout", _text(exc.stdout), f"killed after {timeout:.0f} s"
    row = {"target": target, "rc": rc, "seconds": round(time.time() - t0, 1),
           "tool": "ncu" if use_ncu else "torch.profiler"}  # fmt: skip
    tag = op + "-" + parse_target(target)[1].replace("+", "")
    (out / f"ncu-{tag}.csv" if use_ncu else out / f"prof-{tag}.txt").write_text(stdout)
    if stderr.strip():
        row["stderr_tail"] = stderr[-1500:]
    if use_ncu:
        row["kernels"] = summarise(stdout)
    else:
        for line in stdout.splitlines():
            if line.startswith("KERNELS "):
                row.update(json.loads(line[len("KERNELS "):]))
    print(json.dumps(row)[:2000], flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("ncu-out"))
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    parser.add_argument("--no-ncu", action="store_true", help="torch.profiler only")
    parser.add_argument("--with-profiler", action="store_true",
                        help="with ncu: also a torch.profiler table of the same call")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per target")
    parser.add_argument("--size", default="quick", help="the bench's case size (smoke: tests)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, profile=not args.no_ncu, size=args.size)
        return 0
    for t in args.targets:
        parse_target(t)
    args.out.mkdir(parents=True, exist_ok=True)
    use_ncu = not args.no_ncu and shutil.which("ncu") is not None
    rows = []
    for target in args.targets:
        rows.append(run_target(target, args.out, use_ncu, args.timeout, args.size))
        if use_ncu and args.with_profiler:  # kernel times without ncu's replays
            rows.append(run_target(target, args.out, False, args.timeout, args.size))
        (args.out / "kernels.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
