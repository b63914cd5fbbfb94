"""The tuning sweep of the GPU kit (``tools/gpu_check.py --only sweep``, or alone): candidate
configs of every kernel family at the bench shapes, each checked against the reference and timed,
one JSONL record per candidate written (and flushed) as it ends, so a kill keeps them.

On a GPU: (1) the candidates are compiled in parallel first (``--workers`` spawned processes
filling Triton's cache from ``meta`` tensors, :mod:`sweep_compile`), within a share of the
budget; (2) then, family by family (each with a share of the rest), the peers of each shape
(``F.grouped_mm``, CUTLASS, the unfused epilogue) and the candidates, today's default first,
round-robin over the shapes, are run once on random data into NaN-poisoned outputs, checked
(``||out - ref|| / ||ref||`` against ``F.grouped_mm`` / the fp32 reference, bf16 limit) and
timed with ``triton.testing.do_bench`` (median, 20th / 80th percentiles). The last lines printed
are the table of best candidate against the default and the peers per shape; ``tools/
sweep_pick.py`` turns the file into the committed config entries.

``--dry-run`` (CPU): every candidate through the Triton interpreter on a tiny shape (float64
reference; a subprocess with ``TRITON_INTERPRET=1``) and through the sm_90a compile (registers,
spills, shared memory); ``--write-drops`` records the candidates that fail either in
``tools/sweep_dropped.json``, which the GPU run skips.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
for _p in (str(ROOT), str(TOOLS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import sweep_space as space  # noqa: E402

DROPS = TOOLS / "sweep_dropped.json"
#: family -> share of the timing phase (a family that ends early leaves its time to the next)
SHARES = {"gg_fwd": 0.22, "gg_wgrad": 0.15, "gg_dgrad": 0.15, "gg_act": 0.09, "gg_dact": 0.09,
          "gg_fp8_fwd": 0.06, "gg_fp8_wgrad": 0.04, "ce": 0.07, "bias_act": 0.07,
          "permute": 0.06}  # fmt: skip
COMPILE_SHARE = 0.4  # of the budget, at most, for the parallel pre-compile
WARMUP_MS, REP_MS = 10, 40


class Sink:
    """The JSONL file: one record per line, flushed and synced as written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a")

    def __call__(self, **rec) -> dict:
        rec.setdefault("time", round(time.time(), 3))
        self.file.write(json.dumps(rec, default=str) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        return rec


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            continue
    return out


def triton_identity() -> dict:
    """What decides whether a Triton cache built elsewhere is hit: the version and the hash of
    ``triton_key()`` (the sources of Triton's compiler and ``libtriton.so``)."""
    import triton
    from triton.runtime.cache import triton_key

    return {"triton": triton.__version__, "python": sys.version.split()[0],
            "triton_key": hashlib.sha256(triton_key().encode()).hexdigest()[:16]}  # fmt: skip


def dropped(arch: int) -> set[tuple[str, str]]:
    if not DROPS.exists():
        return set()
    data = json.loads(DROPS.read_text()).get(f"sm_{arch}0", {})
    return {(fam, key) for fam, keys in data.items() for key in keys}


def plan(families, arch: int, sms: int, limit: int | None, cases: int | None,
         drop: set | None = None, tiny: bool = False) -> list[dict]:  # fmt: skip
    """Every (family, shape or case, candidate) in run order: per family, the candidates
    round-robin over its shapes (today's default first at each). ``tiny``: the interpreter's
    shapes instead of the bench's (the CPU run of the timing loop)."""
    out, drop = [], drop or set()
    for fam in families:
        per_shape = []
        if fam.startswith("gg_"):
            shapes = [space.tiny_shape(fam)] if tiny else space.gemm_cases(fam)[:cases]
            for s in shapes:
                cands = space.gemm_candidates(fam, s, arch, sms)[:limit]
                per_shape.append([dict(family=fam, shape=s.as_dict(), cand=c) for c in cands])
        else:
            from sweep_run import memory_cases

            for i, _ in enumerate(memory_cases(fam, "smoke" if tiny else "quick")[:cases]):
                cands = space.memory_candidates(fam)[:limit]
                per_shape.append([dict(family=fam, case=i, cand=c) for c in cands])
        for group in itertools.zip_longest(*per_shape):
            out += [t for t in group if t is not None
                    and (fam, space.cand_key(t["cand"])) not in drop]  # fmt: skip
    for i, task in enumerate(out):
        task["id"] = i
        task["key"] = space.cand_key(task["cand"])
    return out


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def _time(fn, device: str = "cuda") -> list[float]:
    if device != "cuda":  # the CPU run of the loop: a host clock, three calls
        times = sorted(_host_ms(fn) for _ in range(3))
        return [times[1], times[0], times[2]]
    import triton.testing

    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, quantiles=[0.5, 0.2, 0.8])


def _host_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_gpu(args, sink: Sink) -> list[dict]:
    import torch

    from sweep_compile import precompile

    start = time.monotonic()
    deadline = start + args.budget_s
    cap = torch.cuda.get_device_capability()
    props = torch.cuda.get_device_properties(0)
    arch, sms = cap[0], props.multi_processor_count
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    before = len(list(cache.glob("*/*.cubin")))  # kernels (a carried cache's among them)
    sink(stage="env", device=props.name, arch=arch, sms=sms, torch=torch.__version__,
         commit=os.environ.get("MTP_REVISION"), cache_dir=str(cache), cache_kernels=before,
         **triton_identity())  # fmt: skip
    tasks = plan(args.families, arch, sms, args.limit, args.cases, dropped(arch))
    # the memory-bound families' compile runs on CPU tensors with fewer rows (sweep_compile.
    # AOT_ROWS: the same constexprs and integer classes, so mostly the same cache keys)
    compile_tasks = [dict(t, cc=arch * 10, launcher=True) for t in tasks]
    t0 = time.monotonic()
    done = precompile(compile_tasks, args.workers, start + COMPILE_SHARE * args.budget_s,
                      lambda r: sink(stage="compile", **r))  # fmt: skip
    after = len(list(cache.glob("*/*.cubin")))
    sink(stage="compiled", tasks=len(compile_tasks), finished=len(done),
         seconds=round(time.monotonic() - t0, 1), cache_kernels=after,
         compiled_here=after - before, task_seconds=round(sum(r["seconds"] for r in done), 1))
    return time_all(tasks, deadline, sink, arch)


def time_all(tasks: list[dict], deadline: float, sink: Sink, arch: int,
             device: str = "cuda") -> list[dict]:  # fmt: skip
    import torch

    from sweep_fp8 import gemm_run
    from sweep_run import MemoryRun, memory_cases

    records, now = [], time.monotonic()
    spans, total = {}, sum(SHARES[f] for f in dict.fromkeys(t["family"] for t in tasks))
    for fam in dict.fromkeys(t["family"] for t in tasks):
        spans[fam] = SHARES[fam] / total
    t_start, used = now, 0.0
    lost = None
    for fam, fam_tasks in itertools.groupby(tasks, key=lambda t: t["family"]):
        used += spans[fam]
        fam_end = min(deadline, t_start + used * (deadline - t_start))
        runs: dict = {}
        for task in fam_tasks:
            base = dict(stage="gpu", family=fam, key=task["key"], cand=task["cand"],
                        baseline=bool(task["cand"].get("baseline")), arch=arch,
                        shape=task.get("shape", task.get("case")))  # fmt: skip
            if lost or time.monotonic() > fam_end:
                records.append(sink(**base, status="skipped",
                                    note=lost or "family share spent"))  # fmt: skip
                continue
            where = json.dumps(task.get("shape", task.get("case")))
            try:
                if where not in runs:
                    if "shape" in task:
                        runs[where] = gemm_run(fam, space.Shape(**task["shape"]), device, arch)
                    else:
                        size = "quick" if device == "cuda" else "smoke"
                        runs[where] = MemoryRun(fam, memory_cases(fam, size)[task["case"]],
                                                torch.device(device))  # fmt: skip
                    records += time_peers(runs[where], base, sink)
                run = runs[where]
                base["shape"] = task.get("shape") or run.case.label
                records.append(sink(**base, **measure(run, task["cand"], device)))
            except Exception as exc:  # noqa: BLE001
                text = _error(exc)
                if "CUDA" in text or "illegal" in text:
                    lost = f"not run: the CUDA context was lost ({text})"
                records.append(sink(**base, status="error", error=text))
        runs.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


def _figures(run, times: list[float]) -> dict:
    ms = times[0]
    out = {"ms": round(ms, 5), "ms_p20_p80": [round(t, 5) for t in times[1:]]}
    if hasattr(run, "flops"):
        out["tflops"] = round(run.flops / ms / 1e9, 1)
    else:
        out["gbps"] = round(run.bytes / ms / 1e6, 1)
    return out


def measure(run, cand: dict, device: str = "cuda") -> dict:
    import torch

    t0 = time.monotonic()
    outs = run.checked(cand)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.monotonic() - t0
    check = run.check(outs)
    del outs
    fn = run.fn(cand) if hasattr(run, "fn") else (lambda: run.run(cand))
    return dict(status="ok" if check["ok"] else "failed", check=check,
                first_call_s=round(first, 3), **_figures(run, _time(fn, device)))  # fmt: skip


def time_peers(run, base: dict, sink: Sink) -> list[dict]:
    out = []
    peers = run.peers() if hasattr(run, "peers") else {}
    for name, fn in peers.items():
        rec = dict(base, provider=name, key=name, cand={}, baseline=False,
                   shape=getattr(run, "s", None) and run.s.as_dict())  # fmt: skip
        try:
            fn()
            out.append(sink(**rec, status="ok", **_figures(run, _time(fn))))
        except Exception as exc:  # noqa: BLE001
            out.append(sink(**rec, status="error", error=_error(exc)))
    return out


# --------------------------------------------------------------------------------------------
# Dry run (CPU): the interpreter on tiny shapes, then the sm_90a compile
# --------------------------------------------------------------------------------------------


def run_interp(args, sink: Sink) -> None:
    """Under TRITON_INTERPRET=1: each distinct tile shape once per family, float64 reference."""
    import torch

    from sweep_fp8 import gemm_run
    from sweep_run import MemoryRun, memory_cases

    seen = set()
    for task in plan(args.families, 9, 132, args.limit, args.cases):
        fam, cand = task["family"], task["cand"]
        interp_key = (fam, cand.get("kernel"), cand.get("block_m"), cand.get("block_n"),
                      cand.get("block_k"), cand.get("split"), cand.get("persistent"))
        if fam.startswith("gg_") and interp_key in seen:
            continue
        seen.add(interp_key)
        t0 = time.monotonic()
        try:
            if fam.startswith("gg_"):
                run = gemm_run(fam, space.tiny_shape(fam), "cpu")
            else:
                run = MemoryRun(fam, memory_cases(fam, "smoke")[task["case"] % 2],
                                torch.device("cpu"))  # fmt: skip
            check = run.check(run.checked(cand))
            sink(stage="interp", family=fam, key=task["key"], ok=check["ok"], check=check,
                 seconds=round(time.monotonic() - t0, 2))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            sink(stage="interp", family=fam, key=task["key"], ok=False, error=_error(exc))


def run_dry(args, sink: Sink) -> dict:
    from sweep_compile import precompile

    sink(stage="env", device="dry-run (CPU)", **triton_identity())
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(TOOLS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    cmd = [sys.executable, str(Path(__file__)), "--interp", "--jsonl", str(sink.path),
           "--families", *args.families]
    cmd += [f"--limit={args.limit}"] if args.limit else []
    cmd += [f"--cases={args.cases}"] if args.cases else []
    sink.file.flush()
    subprocess.run(cmd, env=env, check=False)
    tasks, seen = [], set()
    for cc in args.cc:
        for task in plan(args.families, cc // 10, 132 if cc == 90 else 148, args.limit,
                         args.cases):  # fmt: skip
            if (cc, task["family"], task["key"]) not in seen:  # one build per config: the
                seen.add((cc, task["family"], task["key"]))  # shapes' sizes are multiples of 16
                tasks.append(dict(task, cc=cc, report=True, id=len(tasks)))
    by_id = {t["id"]: t for t in tasks}
    precompile(tasks, args.workers, None, lambda r: sink(
        stage="aot", family=by_id[r["id"]]["family"], key=by_id[r["id"]]["key"], **r))
    return summarize_dry(read_jsonl(sink.path), args)


def summarize_dry(records: list[dict], args) -> dict:
    """Per target, the candidates that failed the interpreter's check or the compile (spills,
    shared memory, an error): printed, and with ``--write-drops`` written to :data:`DROPS`."""
    bad: dict[str, dict[str, set]] = {f"sm_{cc}": {} for cc in args.cc}
    counts: dict[tuple, int] = {}
    for r in records:
        if r.get("stage") not in ("interp", "aot") or r.get("ok"):
            if r.get("stage") == "aot":
                counts[(r["cc"], r["family"])] = counts.get((r["cc"], r["family"]), 0) + 1
            continue
        for cc in [r["cc"]] if r.get("stage") == "aot" else args.cc:
            bad[f"sm_{cc}"].setdefault(r["family"], set()).add(r["key"])
            if r.get("stage") == "aot":
                counts[(cc, r["family"])] = counts.get((cc, r["family"]), 0) + 1
    lines = ["target  family      compiled  dropped"]
    for (cc, fam), n in sorted(counts.items()):
        lines.append(f"sm_{cc}a {fam:<11} {n:>8}  {len(bad[f'sm_{cc}'].get(fam, ())):>7}")
    print("\n".join(lines), flush=True)
    drops = {sm: {fam: sorted(keys) for fam, keys in fams.items()} for sm, fams in bad.items()}
    if args.write_drops:
        DROPS.write_text(json.dumps(drops, indent=1, sort_keys=True) + "\n")
    return drops


# --------------------------------------------------------------------------------------------


def summary_lines(records: list[dict]) -> list[str]:
    """Per (family, shape): the default, the best checked candidate and the best peer, ms."""
    rows: dict = {}
    for r in records:
        if r.get("stage") != "gpu" or r.get("status") != "ok":
            continue
        key = (r["family"], json.dumps(r.get("shape"), sort_keys=True))
        row = rows.setdefault(key, {})
        if r.get("provider"):
            row["peer"] = min(row.get("peer", (1e9, "")), (r["ms"], r["provider"]))
        elif r.get("baseline"):
            row["base"] = (r["ms"], r["key"])
        row["best"] = min(row.get("best", (1e9, "")), (r["ms"], r["key"])) \
            if not r.get("provider") else row.get("best", (1e9, ""))  # fmt: skip
    lines = ["sweep: family | shape | default ms | best ms (config) | gain | best peer ms | ratio"]
    for (fam, shape), row in rows.items():
        base, best, peer = row.get("base"), row.get("best"), row.get("peer")
        if best is None or best[0] >= 1e9:
            continue
        gain = f"{base[0] / best[0]:.2f}x" if base else "-"
        ratio = f"{peer[0] / best[0]:.2f}x {peer[1]}" if peer else "-"
        where = json.loads(shape)
        model = where.get("model", "") if isinstance(where, dict) else where
        lines.append(f"{fam} | {model} | {base[0] if base else '-'} | {best[0]} ({best[1]}) | "
                     f"{gain} | {peer[0] if peer else '-'} | {ratio}")  # fmt: skip
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", type=Path, default=Path("sweep.jsonl"))
    parser.add_argument("--families", nargs="+", default=list(space.FAMILIES),
                        choices=space.FAMILIES)  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--limit", type=int, default=None, help="candidates per shape")
    parser.add_argument("--cases", type=int, default=None, help="shapes per family")
    parser.add_argument("--dry-run", action="store_true", help="CPU: interpreter + sm_90a compile")
    parser.add_argument("--cc", type=int, nargs="+", default=[90], choices=(90, 100),
                        help="--dry-run: the targets compiled (90: sm_90a, 100: sm_100a)")
    parser.add_argument("--write-drops", action="store_true", help=f"--dry-run: write {DROPS.name}")
    parser.add_argument("--interp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-loop", action="store_true",
                        help="the timing loop on CPU (interpreter, tiny shapes): a test of the "
                             "GPU run's records, not a measurement")  # fmt: skip
    parser.add_argument("--count", action="store_true", help="print the candidate counts, exit")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.count:
        tasks = plan(args.families, 9, 132, args.limit, args.cases, dropped(9))
        for fam in args.families:
            print(fam, sum(t["family"] == fam for t in tasks))
        print("total", len(tasks))
        return 0
    sink = Sink(args.jsonl)
    if args.interp:
        run_interp(args, sink)
        return 0
    if args.cpu_loop:
        sink(stage="env", device="cpu-loop (interpreter)", **triton_identity())
        tasks = plan(args.families, 9, 4, args.limit, args.cases, tiny=True)
        records = time_all(tasks, time.monotonic() + args.budget_s, sink, 9, "cpu")
        print("\n".join(summary_lines(records)), flush=True)
        return 0
    if args.dry_run:
        run_dry(args, sink)
        return 0
    records = run_gpu(args, sink)
    text = "\n".join(summary_lines(records))
    (args.jsonl.parent / "sweep-summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
