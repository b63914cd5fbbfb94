"""Run the cases of the selected bench modules: the CPU smoke/structural pass or the GPU pass.

Both produce *records*, one per (case, provider), plain dicts ready for JSON:

``op, family, case, group, params, dtype, pass, provider, kind, status ("ok" | "skipped" |
"failed"), note, bytes, flops`` and

- CPU: ``check`` (``rel_err`` against the float64 reference, ``limit``, ``ok``), ``counts``
  (:meth:`mtp.bench.counting.OpCount.summary`: aten ops, device ops, Triton launches, host
  syncs of one call) and, for mtp backends, ``traffic``
  (:meth:`mtp.testing.traffic.Traffic.summary`: bytes counted by address under the
  interpreter and ``bytes_over_floor``);
- GPU: ``check`` (against mtp's reference, fp32 math) and ``timing`` (median/p20/p80 ms, GB/s,
  TFLOP/s, fractions of the datasheet floor and of the measured ceilings, host µs per call,
  launches, peak memory) and ``speedup_vs`` (other provider's median / this median, for every
  provider timed on the same case in the same run).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import time
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from mtp import settings

from .core import FLOAT64, Case, Provider, Skip, check_limit, dtype_name, rel_err
from .progress import Progress

__all__ = [
    "MODULES",
    "OP_NAMES",
    "load_modules",
    "plan",
    "run_cpu",
    "run_gpu",
    "floor_seconds",
    "Progress",
    "total_steps",
    "traffic_runs",
]

#: Bench modules in report order.
MODULES = ("bench_bias_act", "bench_cross_entropy", "bench_linear_cross_entropy",
           "bench_permute", "bench_quantize", "bench_grouped_gemm", "bench_moe_layer")  # fmt: skip
#: Names accepted on the command line: families and single ops.
OP_NAMES = ("bias_act", "bias_gelu", "bias_swiglu", "cross_entropy", "linear_cross_entropy",
            "permute", "unpermute", "quantize", "quantize_fp8", "grouped_gemm",
            "moe_layer")  # fmt: skip

BUDGET_SPENT = "not run: the time budget (--budget-s) was spent"
GPU_EXPECTED = "reference"  # the GPU check compares with mtp's reference (fp32 math)


def load_modules() -> list[ModuleType]:
    """Import the bench modules (after :func:`mtp.bench.env.prepare_runtime`)."""
    package = __name__.rsplit(".", 1)[0]
    return [importlib.import_module(f"{package}.{name}") for name in MODULES]


def plan(
    modules: Iterable[ModuleType],
    ops: Iterable[str] | None,
    size: str,
    dtype: torch.dtype,
    backends: Iterable[str] | None = None,
    peers: bool = True,
) -> list[tuple[ModuleType, Case, list[Provider]]]:
    """The (module, case, providers) to run: ``ops`` names families or ops (None: all);
    ``backends`` keeps only those mtp backends (baselines and peers stay unless ``peers`` is
    False; the reference always stays: it is what the others are compared with)."""
    wanted = set(ops or OP_NAMES)
    unknown = wanted - set(OP_NAMES)
    if unknown:
        raise ValueError(f"unknown op(s) {sorted(unknown)}; choose from {list(OP_NAMES)}")
    keep = set(backends) if backends else None
    out = []
    for module in modules:
        for case in module.cases(size, dtype):
            if module.FAMILY not in wanted and case.op not in wanted:
                continue
            provs = [
                p for p in module.providers(case.op)
                if (p.kind != "mtp" or keep is None or p.name.split("+")[0] in keep)
                and (peers or p.kind != "peer")
            ]  # fmt: skip
            out.append((module, case, provs))
    return out


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def poisoned(on: bool = True):
    """Op outputs start as NaN (``mtp.utils.empty``) inside: unwritten elements fail the check."""
    return settings.override(poison_outputs=on)


def _detach(out) -> list[torch.Tensor]:
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in out]


def _record(module: ModuleType, case: Case, provider: Provider) -> dict[str, Any]:
    return {
        "op": case.op,
        "family": module.FAMILY,
        "case": case.label,
        "group": case.group,
        "params": dict(case.params),
        "dtype": dtype_name(case.dtype),
        "pass": case.pass_,
        "provider": provider.name,
        "kind": provider.kind,
        "status": "ok",
        "note": provider.note,
        "bytes": case.bytes,
        "flops": case.flops,
    }


def _check(out, expected, case: Case, against: str, run=None,
           provider: Provider | None = None) -> dict[str, Any]:  # fmt: skip
    if run is not None and run.for_check is not None:
        out = run.for_check(out)
    err = rel_err(_detach(out), expected)
    given = None if provider is None else provider.tolerance
    limit = check_limit(case.dtype) if given is None else given
    return {"rel_err": err, "limit": limit, "ok": err <= limit, "against": against}


def _error_note(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


# --------------------------------------------------------------------------------------------
# CPU: smoke check + structural counts
# --------------------------------------------------------------------------------------------


def _no_kernels(case: Case):
    from .counting import triton_launch_hook

    if case.execute:
        return contextlib.nullcontext()
    return triton_launch_hook(lambda *a: None, execute=False)


def _each_provider(module, case, providers, device, progress, body,
                   after=None) -> list[dict[str, Any]]:
    """One record per provider: skipped with the reason when it cannot run on ``device``, else
    filled by ``body(rec, provider)``; an exception marks only that record failed.
    ``after(records)`` is called as each provider ends (the GPU run saves them)."""
    records = []
    for provider in providers:
        rec = _record(module, case, provider)
        records.append(rec)
        if progress is not None:
            progress.begin(f"{case.op} {case.label} {case.pass_} {provider.name}")
        reason = provider.unavailable(device)
        if reason:
            rec.update(status="skipped", note=reason)
        else:
            try:
                body(rec, provider)
            except Skip as exc:  # this provider cannot run this case: not a failure
                rec.update(status="skipped", note=str(exc))
            except Exception as exc:  # one broken provider must not stop the run
                rec.update(status="failed", note=_error_note(exc))
            _free(device)
        if progress is not None:
            progress.step(f"{case.op} {provider.name}")
        if after is not None:
            after(records)
    return records


def run_cpu_case(module: ModuleType, case: Case, providers: list[Provider], progress=None):
    """Records of one case on CPU: check each provider against float64, count one call."""
    from .counting import count_ops

    device = torch.device("cpu")
    setup = module.SETUP[case.op]
    expected = None
    if case.check:
        with poisoned():
            expected = _detach(setup(case, FLOAT64, device).fn())

    def check_and_count(rec, provider):
        run = setup(case, provider.name, device)
        with poisoned(), _no_kernels(case):
            out = run.fn()  # the checked call, also the warm-up of the counted one
        if expected is not None:
            rec["check"] = _check(out, expected, case, FLOAT64, run, provider)
            if not rec["check"]["ok"]:
                rec.update(status="failed", note="differs from the float64 reference")
        del out
        # Counting needs no kernel results (nothing on the host reads them): the Triton
        # kernels are recorded, not run again.
        with poisoned(False), count_ops(execute_kernels=False) as counted:
            run.fn()
        rec["counts"] = counted.summary()
        if not case.execute:
            rec["note"] = "structure only: Triton launches recorded, kernels not executed"
        elif provider.kind == "mtp" and case.bytes:
            rec["traffic"] = measure_traffic(run, case.bytes)

    return _each_provider(module, case, providers, device, progress, check_and_count)


def measure_traffic(run, floor: int) -> dict[str, Any]:
    """Bytes (counted by address under the interpreter), launches and syncs of one call of
    ``run`` (kernels executed), against ``floor`` bytes
    (:func:`mtp.testing.traffic.count_traffic`), after a warm-up call whose kernels are
    recorded, not executed (its one-time allocations, reduction counters..., are not per call;
    nothing on the host reads a kernel's results)."""
    from mtp.testing.traffic import count_traffic

    from .counting import triton_launch_hook

    with poisoned(False):
        with triton_launch_hook(lambda *a: None, execute=False):
            run.fn()
        with count_traffic() as traffic:
            run.fn()
    return traffic.summary(floor=floor)


def traffic_runs(planned) -> list[tuple[ModuleType, Case, Provider]]:
    """The ``(module, case, provider)`` of the bytes / floor figures: the mid-size shapes of each
    module's ``traffic_cases(dtype)`` (when it has one) for the planned ops, by their planned
    mtp providers that run on CPU."""
    out = []
    seen = set()
    device = torch.device("cpu")
    for module, case, _ in planned:
        if not hasattr(module, "traffic_cases") or (module.FAMILY, case.dtype) in seen:
            continue
        seen.add((module.FAMILY, case.dtype))
        for big in module.traffic_cases(case.dtype):
            names = {p.name for m, c, provs in planned if m is module and c.op == big.op
                     for p in provs if p.kind == "mtp"}  # fmt: skip
            out += [(module, big, provider) for provider in module.providers(big.op)
                    if provider.name in names and not provider.unavailable(device)]  # fmt: skip
    return out


def traffic_structure(planned, progress: Progress | None = None) -> list[dict[str, Any]]:
    """bytes / floor of each of :func:`traffic_runs`."""
    out = []
    device = torch.device("cpu")
    for module, big, provider in traffic_runs(planned):
        label = f"{big.op} {big.label} {big.pass_} {provider.name}"
        if progress is not None:
            progress.begin(f"{label}: bytes by address")
        row = {"op": big.op, "case": big.label, "pass": big.pass_,
               "dtype": dtype_name(big.dtype), "provider": provider.name}  # fmt: skip
        try:
            run = module.SETUP[big.op](big, provider.name, device)
            row.update(measure_traffic(run, big.bytes))
        except Exception as exc:  # one broken provider must not stop the run
            row["error"] = _error_note(exc)
        out.append(row)
        if progress is not None:
            progress.step(f"{big.op} {provider.name} traffic")
    return out


def run_cpu(planned, size: str, progress: Progress | None = None) -> dict[str, Any]:
    """The CPU pass: smoke records, bytes / floor at mid-size shapes (:func:`traffic_runs`)
    and each module's ``structure(size)`` figures."""
    records = []
    for module, case, providers in planned:
        records += run_cpu_case(module, case, providers, progress)
    structure: dict[str, Any] = {}
    traffic = traffic_structure(planned, progress)
    if traffic:
        structure["traffic"] = traffic
    families = {module.FAMILY: module for module, _, _ in planned}
    for module in families.values():
        if hasattr(module, "structure"):
            if progress is not None:
                progress.begin(f"{module.FAMILY} structure")
            try:
                structure.update(module.structure(size))
            except Exception as exc:
                structure[f"{module.FAMILY}_error"] = _error_note(exc)
            if progress is not None:
                progress.step(f"{module.FAMILY} structure")
    for module in families.values():  # what a module set up for its peers (process groups)
        getattr(module, "release", lambda: None)()
    return {"records": records, "structure": structure}


def structure_steps(planned) -> int:
    return len({m.FAMILY for m, _, _ in planned if hasattr(m, "structure")})


# --------------------------------------------------------------------------------------------
# GPU: check + timing
# --------------------------------------------------------------------------------------------


def floor_seconds(nbytes: int | None, flops: int | None, bytes_per_s: float, flops_per_s: float):
    """``max(bytes / bandwidth, flops / rate)``: the time no implementation can beat."""
    terms = []
    if nbytes:
        terms.append(nbytes / bytes_per_s)
    if flops:
        terms.append(flops / flops_per_s)
    return max(terms) if terms else None


def _figures(rec, timing, peak, ceilings, rate: str = "bf16") -> dict[str, Any]:
    """Rates and floor fractions of one timing; ``rate="fp8"``: the floor at the datasheet
    FP8 rate (no measured FP8 ceiling: no ceiling fraction)."""
    seconds = timing["median_ms"] * 1e-3
    fig = dict(timing)
    fig["gbps"] = rec["bytes"] / seconds / 1e9 if rec["bytes"] else None
    fig["tflops"] = rec["flops"] / seconds / 1e12 if rec["flops"] else None
    if peak is not None:
        flops_per_s = peak.get(f"{rate}_flops_per_s") or peak["bf16_flops_per_s"]
        floor = floor_seconds(rec["bytes"], rec["flops"], peak["hbm_bytes_per_s"], flops_per_s)
        fig["floor_us"] = floor * 1e6 if floor else None
        fig["floor_fraction"] = floor / seconds if floor else None
        fig["peak_rate"] = rate
    if ceilings and rate == "bf16":
        floor = floor_seconds(rec["bytes"], rec["flops"], ceilings["copy_bytes_per_s"],
                              ceilings["bf16_matmul_flops_per_s"])  # fmt: skip
        fig["ceiling_fraction"] = floor / seconds if floor else None
    return fig


def run_gpu_case(module, case, providers, timer, peak=None, ceilings=None, progress=None,
                 untimed=(), deadline: float | None = None, after=None):
    """Records of one case on the GPU: check each provider, then time it (``timer`` is a
    :class:`mtp.bench.timing.GpuTimer` or anything with its ``measure(run)``). Providers named
    in ``untimed`` are not run (the reference still computes the expected result), nor any
    provider once ``deadline`` (``time.monotonic()``) has passed; ``after(records)`` is called
    as each provider ends."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    setup = module.SETUP[case.op]
    expected, expected_error = None, ""
    try:
        with poisoned():
            expected = _detach(setup(case, GPU_EXPECTED, device).fn())
    except Exception as exc:  # no reference: time anyway, unchecked
        expected_error = _error_note(exc)

    def check_and_time(rec, provider):
        if provider.name in untimed:
            raise Skip("not timed in this run (--untimed); the reference is still the check")
        if deadline is not None and time.monotonic() > deadline:
            raise Skip(BUDGET_SPENT)
        _time_one(rec, setup, case, provider, device, expected, timer, peak, ceilings)
        if expected is None:
            rec["note"] = f"unchecked: the reference failed ({expected_error})"

    records = _each_provider(module, case, providers, device, progress, check_and_time, after)
    expected = None  # free the reference outputs before the next case
    _free(device)
    _speedups(records)
    return records


def _time_one(rec, setup, case, provider, device, expected, timer, peak, ceilings) -> None:
    """Check one provider against ``expected``, then time it. A failed check marks the record
    failed (it never reaches a summary) but is still timed, for the record."""
    run = setup(case, provider.name, device)
    with poisoned():
        out = run.fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if expected is not None:
        rec["check"] = _check(out, expected, case, GPU_EXPECTED, run, provider)
        if not rec["check"]["ok"]:
            rec.update(status="failed",
                       note="check failed: result differs from the reference (timed anyway)")
    del out
    rec["timing"] = _figures(rec, timer.measure(run), peak, ceilings, provider.rate)
    del run


def _free(device: torch.device) -> None:
    """Return the last provider's memory before the next one is set up (GPU runs)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _speedups(records: list[dict]) -> None:
    timed = [r for r in records if r["status"] == "ok" and "timing" in r]
    for r in timed:
        r["speedup_vs"] = {
            o["provider"]: o["timing"]["median_ms"] / r["timing"]["median_ms"]
            for o in timed
            if o is not r
        }


def run_gpu(planned, timer, peak=None, ceilings=None, progress=None, on_records=None,
            deadline: float | None = None, untimed=()) -> dict[str, Any]:
    """Every planned case on the GPU. ``on_records(records)`` is called as each case ends and
    ``on_records(records, final=False)`` as each of its providers ends (the CLI rewrites
    ``results.json``, so a killed run keeps every finished provider); past ``deadline``
    (``time.monotonic()``) the remaining providers are recorded as skipped."""
    records = []
    partial = None if on_records is None else (lambda recs: on_records(recs, final=False))
    for module, case, providers in planned:
        if deadline is not None and time.monotonic() > deadline:
            recs = [dict(_record(module, case, p), status="skipped", note=BUDGET_SPENT)
                    for p in providers]  # fmt: skip
        else:
            recs = run_gpu_case(module, case, providers, timer, peak, ceilings, progress,
                                untimed, deadline, partial)  # fmt: skip
        records += recs
        if on_records is not None:
            on_records(recs)
    return {"records": records, "structure": {}}


def total_steps(planned, cpu: bool) -> int:
    """Counted steps of a run: every provider of every case, and on CPU every
    :func:`traffic_runs` entry and every family's structure."""
    extra = len(traffic_runs(planned)) + structure_steps(planned) if cpu else 0
    return sum(len(p) for _, _, p in planned) + extra

