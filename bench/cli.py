"""``mtp-bench [OPS...] [--dtype bf16] [--backends ...] [--quick] [--out DIR]``.

With a CUDA GPU: times every planned case for each mtp backend, the plain PyTorch reference,
``torch.compile`` of it and the installed peers, checks each against the reference first, and
writes the figures with the roofline fractions. Without one: the smoke check through the
reference and the Triton interpreter, and the structural figures (see ``bench/README.md``).
Results go to ``DIR/<device folder>/`` (``results.json``, ``results.md``, ``*.png``).
Unknown ops or backends and an ``--out`` that cannot be written exit with code 2 and a one-line
error before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path

from .env import REPO, device_folder, environment, prepare_runtime

__all__ = ["main", "parse_args", "default_out"]

logger = logging.getLogger("mtp")


def default_out() -> Path:
    """``bench/results`` of the checkout this module lives in (an editable install or
    ``python -m bench``), else ``./mtp-bench-results``."""
    if (REPO / "setup.py").exists() and (REPO / "bench").is_dir():
        return REPO / "bench" / "results"
    return Path.cwd() / "mtp-bench-results"


def parse_args(argv=None) -> argparse.Namespace:
    from .runner import OP_NAMES

    parser = argparse.ArgumentParser(
        prog="mtp-bench",
        description="Microbenchmarks of the mtp kernels against PyTorch and the peers. On a GPU: "
        "times, GB/s or TFLOP/s, fraction of the device floor. Without a GPU: a correctness smoke "
        "pass and structural figures only (no timings).",
    )
    parser.add_argument("ops", nargs="*", metavar="OP",
                        help=f"op families or ops to run (default: all): {', '.join(OP_NAMES)}")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="activation dtype (default bf16)")
    parser.add_argument("--backends", nargs="+", metavar="NAME",
                        help="only these mtp backends (e.g. triton multistream); the reference, "
                        "torch.compile and the peers still run")
    parser.add_argument("--no-peers", action="store_true", help="skip the other projects' kernels")
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes (GPU) and one world size (CPU); what `make bench` runs")
    parser.add_argument("--out", type=Path, default=None,
                        help="results root; files go to OUT/<device>/ (default: bench/results of "
                        "the checkout)")
    parser.add_argument("--mode", choices=("auto", "gpu", "cpu"), default="auto",
                        help="auto: GPU timings when CUDA is available, else the CPU pass")
    parser.add_argument("--replace", action="store_true",
                        help="drop the other ops' records of an earlier run in the same folder "
                        "(default: keep them, so the ops can be run in several calls)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up (GPU)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time (GPU)")
    return parser.parse_args(argv)


def _usage_error(message: str) -> int:
    sys.stderr.write(f"mtp-bench: error: {message}\n")
    return 2


def _unwritable(folder: Path) -> str | None:
    """Why results cannot be written under ``folder`` (None when they can)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _bad_names(args, modules, runner, dtype) -> str | None:
    """A message for unknown op or backend names (None when all are known)."""
    unknown = sorted(set(args.ops) - set(runner.OP_NAMES))
    if unknown:
        return f"unknown op(s) {unknown}; choose from {list(runner.OP_NAMES)}"
    if not args.backends:
        return None
    known = {"reference"}
    for _, _, providers in runner.plan(modules, None, "smoke", dtype):
        known.update(p.name.split("+")[0] for p in providers if p.kind == "mtp")
    unknown = sorted(set(args.backends) - known)
    if unknown:
        return f"unknown backend(s) {unknown} for --backends; choose from {sorted(known)}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out_root = args.out or default_out()
    problem = _unwritable(out_root)
    if problem:
        return _usage_error(f"--out {out_root} is not a writable folder: {problem}")
    mode = prepare_runtime(args.mode)
    # Everything that imports triton or mtp.ops comes after prepare_runtime.
    from . import report, runner
    from .core import DTYPES
    from .peaks import match_peak

    started = time.perf_counter()
    dtype = DTYPES[args.dtype]
    modules = runner.load_modules()
    problem = _bad_names(args, modules, runner, dtype)
    if problem:
        return _usage_error(problem)
    env = environment(mode)
    size = ("quick" if args.quick else "full") if mode == "gpu" else "smoke"
    planned = runner.plan(modules, args.ops, size, dtype, args.backends, peers=not args.no_peers)
    peak = match_peak(env["device"], env.get("sm_count")) if mode == "gpu" else None
    folder = out_root / device_folder(env, peak.name if peak else None)
    folder.mkdir(parents=True, exist_ok=True)

    peak_dict = dataclasses.asdict(peak) if peak else None
    body, ceilings = _measure(args, mode, planned, size, peak_dict)
    this_run = body["records"]
    for rec in this_run:
        rec["run_date"] = env["date"]
    result = {
        "schema": report.SCHEMA,
        "command": "mtp-bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "environment": env,
        "gpu_timing": mode == "gpu",
        "statement": None if mode == "gpu" else report.NO_GPU_STATEMENT,
        "size": size,
        "dtype": args.dtype,
        "ops": sorted({case.op for _, case, _ in planned}),
        "providers": _providers_by_op(planned),
        "peak": peak_dict,
        "ceilings": ceilings,
        **body,
    }
    if mode != "gpu":
        formula_size = "quick" if args.quick else "full"
        result["formula_size"] = formula_size
        result["formulas"] = report.formula_table(
            runner.plan(modules, args.ops, formula_size, dtype, args.backends)
        )
    if not args.replace:
        result = report.merge_previous(folder / "results.json", result)
    if args.no_plots:
        plots, note = [], "plots skipped (--no-plots)"
    else:
        plots, note = report.write_plots(folder, result)
    result["plots"], result["plot_note"] = plots, note
    result["wall_s"] = round(time.perf_counter() - started, 1)
    report.write_json(folder / "results.json", result)
    report.write_markdown(folder / "results.md", result)
    print(report.stdout_table({**result, "records": this_run}))
    wrote = f" and {len(plots)} plot(s)" if plots else ""
    print(f"\nwrote {folder}/results.json, results.md{wrote}"
          + (f" ({note})" if note else "") + f" in {result['wall_s']} s")  # fmt: skip
    failed = [r for r in this_run if r["status"] == "failed"]
    for r in failed:
        where = f"{r['op']} {r['case']} {r['pass']} {r['provider']}"
        print(f"FAILED {where}: {r['note']}", file=sys.stderr)
    # An mtp backend or the reference failing is an error; a peer or torch.compile failing (its
    # API moved, no compiler on the machine) is reported, not fatal.
    return 1 if any(r["kind"] == "mtp" or r["provider"] == "reference" for r in failed) else 0


def _measure(args, mode: str, planned, size: str, peak: dict | None):
    """Run the planned cases: ``(body, ceilings)``, body = ``{"records", "structure"}``."""
    import torch

    from . import runner

    progress = runner.Progress(runner.total_steps(planned, cpu=mode == "cpu"),
                               enabled=not args.no_progress)  # fmt: skip
    try:
        if mode == "gpu":
            from .timing import GpuTimer, measure_ceilings

            torch.backends.cuda.matmul.allow_tf32 = False
            timer = GpuTimer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            ceilings = measure_ceilings(timer)
            return runner.run_gpu(planned, timer, peak, ceilings, progress), ceilings
        # Tiny tensors: one intra-op thread (more only spin and fight other processes for
        # the cores of a small CI machine).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(0)
            return runner.run_cpu(planned, size, progress), None
        finally:
            torch.set_num_threads(threads)
    finally:
        progress.close()


def _providers_by_op(planned) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for _, case, providers in planned:
        names = out.setdefault(case.op, [])
        names += [p.name for p in providers if p.name not in names]
    return out


if __name__ == "__main__":
    sys.exit(main())
