"""``mtp-bench [OPS...] [--dtype bf16] [--backends ...] [--quick] [--out DIR]``.

With a CUDA GPU: times every planned case for each mtp backend, the plain PyTorch reference,
``torch.compile`` of it and the installed peers, checks each against the reference first, and
writes the figures with the roofline fractions. Without one: the smoke check through the
reference and the Triton interpreter, and the structural figures (see ``bench/README.md``).
Results go to ``DIR/<device folder>/`` (``results.json``, ``results.md``, ``*.png``); without
``--out``, ``DIR`` is the checkout's ignored ``bench/results/local`` (:func:`default_out`): the
committed results are refreshed only with ``--out bench/results`` (``make bench-refresh``).
Progress goes to stderr, a line at least every ``--heartbeat-s`` seconds.
Unknown ops or backends and an ``--out`` that cannot be written exit with code 2 and a one-line
error before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path

from .env import REPO, device_folder, environment, prepare_runtime
from .progress import HEARTBEAT_S, Progress

__all__ = ["main", "parse_args", "default_out"]

logger = logging.getLogger("mtp")

#: Providers the quick GPU run does not time: the per-expert loop, the plain-PyTorch reference
#: (still computed once per case as the check) and the fused linear CE's chunk-size variants
#: (time them with ``--untimed reference``).
QUICK_UNTIMED = ("sequential", "reference", "triton-chunk/4", "triton-chunk/16")


def default_out() -> Path:
    """``bench/results/local`` of the checkout this module lives in (an editable install or
    ``python -m bench``; ignored by git, so a run leaves the committed results as they are),
    else ``./mtp-bench-results``."""
    if (REPO / "setup.py").exists() and (REPO / "bench").is_dir():
        return REPO / "bench" / "results" / "local"
    return Path.cwd() / "mtp-bench-results"


def parse_args(argv=None) -> argparse.Namespace:
    from .runner import OP_NAMES

    parser = argparse.ArgumentParser(
        prog="mtp-bench",
        description="Microbenchmarks of the mtp kernels against PyTorch and the peers. On a GPU: "
        "times, GB/s or TFLOP/s, fraction of the device floor. Without a GPU: a correctness smoke "
        "pass and structural figures only (no timings).",
    )
    parser.add_argument("--host", action="store_true",
                        help="the host benchmark instead: each op's host µs per eager call under "
                        "the null-GPU stand-in, beside a bare autograd.Function (bench/host.py; "
                        "its options: mtp-bench --host -h)")
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
                        help="results root; files go to OUT/<device>/ (default: bench/results/"
                        "local of the checkout, ignored by git; `--out bench/results` refreshes "
                        "the committed results)")
    parser.add_argument("--mode", choices=("auto", "gpu", "cpu"), default="auto",
                        help="auto: GPU timings when CUDA is available, else the CPU pass")
    parser.add_argument("--replace", action="store_true",
                        help="drop the other ops' records of an earlier run in the same folder "
                        "(default: keep them, so the ops can be run in several calls)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S,
                        help="a progress line (a bar refresh on a terminal) whenever this many "
                        f"seconds pass without one (default {HEARTBEAT_S:g}; 0: none)")
    parser.add_argument("--warmup-ms", type=int, default=None,
                        help="do_bench warm-up (GPU; default 25, 10 with --quick)")
    parser.add_argument("--rep-ms", type=int, default=None,
                        help="do_bench measuring time (GPU; default 100, 40 with --quick)")
    parser.add_argument("--untimed", nargs="*", default=None, metavar="NAME",
                        help="providers not timed (GPU; default with --quick: "
                        f"{' '.join(QUICK_UNTIMED)}; the reference stays the check)")
    parser.add_argument("--ceilings", type=Path, default=None,
                        help="a JSON file of this GPU's measured ceilings: read when it exists, "
                        "else measured and written (one measurement for several runs)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new cases after this many seconds (GPU); the rest "
                        "are recorded as skipped")
    args = parser.parse_args(argv)
    quick_gpu = args.quick
    if args.warmup_ms is None:
        args.warmup_ms = 10 if quick_gpu else 25
    if args.rep_ms is None:
        args.rep_ms = 40 if quick_gpu else 100
    if args.untimed is None:
        args.untimed = list(QUICK_UNTIMED) if quick_gpu else []
    return args


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
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if "--host" in argv_list:  # the host benchmark: its own options (python -m bench.host -h)
        from .host import main as host_main

        argv_list.remove("--host")
        return host_main(argv_list)
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
    result = _header(args, argv, env, mode, size, planned, peak)
    saver = _Saver(folder / "results.json", result, env["date"], merge=not args.replace)
    # the last step writes the results
    progress = Progress(runner.total_steps(planned, cpu=mode == "cpu") + 1,
                        enabled=not args.no_progress, heartbeat_s=args.heartbeat_s)  # fmt: skip
    try:
        body, result["ceilings"] = _measure(args, mode, planned, size, result["peak"], saver,
                                            progress)  # fmt: skip
        progress.begin("writing results.json, results.md" + ("" if args.no_plots else ", plots"))
        this_run = body["records"]
        result.update(structure=body["structure"], complete=True)
        if mode != "gpu":
            result["formula_size"] = "quick" if args.quick else "full"
            result["formulas"] = report.formula_table(
                runner.plan(modules, args.ops, result["formula_size"], dtype, args.backends)
            )
        result = _write(args, folder, saver.merged(this_run), started)
        progress.step("results written")
    finally:
        progress.close()
    return _report(folder, result, this_run)


def _header(args, argv, env: dict, mode: str, size: str, planned, peak) -> dict:
    """The ``results.json`` fields known before the run (``complete: false``)."""
    from . import report

    return {
        "schema": report.SCHEMA,
        "command": "mtp-bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "environment": env,
        "gpu_timing": mode == "gpu",
        "statement": None if mode == "gpu" else report.NO_GPU_STATEMENT,
        "size": size,
        "dtype": args.dtype,
        "ops": sorted({case.op for _, case, _ in planned}),
        "providers": _providers_by_op(planned),
        "peak": dataclasses.asdict(peak) if peak else None,
        "ceilings": None,
        "records": [],
        "structure": {},
        "complete": False,
    }


def _write(args, folder: Path, result: dict, started: float) -> dict:
    """``results.json``, ``results.md`` and the plots of the finished run."""
    from . import report

    if args.no_plots:
        plots, note = [], "plots skipped (--no-plots; `python -m bench.report DIR` draws them)"
    else:
        plots, note = report.write_plots(folder, result)
    result["plots"], result["plot_note"] = plots, note
    result["wall_s"] = round(time.perf_counter() - started, 1)
    report.write_json(folder / "results.json", result)
    report.write_markdown(folder / "results.md", result)
    return result


def _report(folder: Path, result: dict, this_run: list[dict]) -> int:
    """The table on stdout, the failures on stderr; the exit code."""
    from . import report

    print(report.stdout_table({**result, "records": this_run}))
    plots, note = result["plots"], result["plot_note"]
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


class _Saver:
    """Writes ``results.json`` after every case (``complete: false`` until the run ends), so a
    run killed at its time limit keeps every finished case; other ops' records of an earlier
    run in the folder are kept (:func:`mtp.bench.report.merge_previous`) unless ``merge`` is
    False."""

    def __init__(self, path: Path, result: dict, run_date: str, merge: bool) -> None:
        from . import report

        self.path, self.result, self.run_date, self.merge = path, result, run_date, merge
        self.previous = None
        if merge and path.exists():
            try:
                self.previous = json.loads(path.read_text())
            except ValueError:  # a broken earlier file: start afresh
                self.previous = None
        self.report = report
        self.records: list[dict] = []

    def merged(self, records: list[dict]) -> dict:
        for rec in records:
            rec["run_date"] = self.run_date
        result = {**self.result, "records": records}
        if self.previous is None:
            return result
        return self.report.merge_records(self.previous, result)

    def __call__(self, records: list[dict], final: bool = True) -> None:
        """Write the finished cases plus ``records``; ``final=False``: ``records`` are the
        providers of a case still running (written, not kept: the case's final call has
        them all)."""
        if final:
            self.records += records
        tmp = self.path.with_suffix(".json.tmp")
        self.report.write_json(tmp, self.merged(self.records + ([] if final else records)))
        tmp.replace(self.path)  # atomic: a kill mid-write leaves the previous version


def _measure(args, mode: str, planned, size: str, peak: dict | None, saver, progress):
    """Run the planned cases: ``(body, ceilings)``, body = ``{"records", "structure"}``."""
    import torch

    from . import runner

    if mode == "gpu":
        from .timing import GpuTimer, measure_ceilings

        deadline = (time.monotonic() + args.budget_s) if args.budget_s else None
        torch.backends.cuda.matmul.allow_tf32 = False
        timer = GpuTimer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                         host_calls=5 if args.quick else 20,
                         count_launches=not args.quick)  # fmt: skip

        def measure():
            progress.note("measuring this GPU's copy bandwidth and matmul rate")
            return measure_ceilings(timer)

        ceilings = _ceilings(args.ceilings, measure)
        if saver is not None:
            saver.result["ceilings"] = ceilings
        body = runner.run_gpu(planned, timer, peak, ceilings, progress, on_records=saver,
                              deadline=deadline, untimed=tuple(args.untimed))  # fmt: skip
        return body, ceilings
    # Tiny tensors: one intra-op thread (more only spin and fight other processes for
    # the cores of a small CI machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        return runner.run_cpu(planned, size, progress), None
    finally:
        torch.set_num_threads(threads)


def _ceilings(path: Path | None, measure) -> dict:
    """The measured ceilings, shared through ``path`` between runs on the same GPU."""
    if path is not None and path.exists():
        return json.loads(path.read_text())
    ceilings = measure()
    if path is not None:
        path.write_text(json.dumps(ceilings, indent=1) + "\n")
    return ceilings


def _providers_by_op(planned) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for _, case, providers in planned:
        names = out.setdefault(case.op, [])
        names += [p.name for p in providers if p.name not in names]
    return out


if __name__ == "__main__":
    sys.exit(main())
