"""Outputs of a run: ``results.json`` (every figure and the environment), ``results.md`` (the
tables) and PNG plots, in ``<out>/<device folder>/``; plus the short table printed on stdout."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .peaks import PEAKS
from .plots import group_records, write_plots

__all__ = [
    "SCHEMA",
    "merge_previous",
    "NO_GPU_STATEMENT",
    "formula_table",
    "write_json",
    "write_markdown",
    "write_plots",
    "stdout_table",
]

SCHEMA = "mtp-bench/1"
NO_GPU_STATEMENT = (
    "No GPU timing was taken: this run had no CUDA device. The figures are structural (bytes and "
    "FLOPs by formula, collectives, ops, kernel launches and host syncs per call, counted on the "
    "host) plus a correctness smoke check through the reference and the Triton interpreter; no "
    "time, GB/s or TFLOP/s is given."
)
_BOUND_DEVICES = ("H100 SXM", "B200")


# --------------------------------------------------------------------------------------------
# Formulas at the GPU shapes (CPU runs)
# --------------------------------------------------------------------------------------------


def formula_table(planned) -> list[dict[str, Any]]:
    """Bytes, FLOPs, intensity and the bound on reference devices for each planned case."""
    peaks = {p.name: p for _, p in PEAKS}
    rows = []
    for _, case, _ in planned:
        intensity = case.flops / case.bytes if case.flops and case.bytes else None
        bound = {}
        for name in _BOUND_DEVICES:
            ridge = peaks[name].ridge()
            bound[name] = "compute" if intensity is not None and intensity > ridge else "memory"
        rows.append({"op": case.op, "case": case.label, "pass": case.pass_,
                     "bytes": case.bytes, "flops": case.flops,
                     "flop_per_byte": intensity, "bound": bound})  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------


def _clean(value):
    """JSON-safe: NaN/inf become strings ("inf"), tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def merge_previous(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` plus the records of other ops from an earlier run in the same folder (same
    device, mode, size and dtype), so a GPU session can run the ops in several calls.

    Records carry their run's date; the structure sections of this run replace earlier ones,
    except the bytes-by-address rows (``traffic``), which are kept per op like the records.
    """
    if not path.exists():
        return result
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return result
    return merge_records(old, result)


def merge_records(old: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``result`` plus ``old``'s records of other ops (see :func:`merge_previous`)."""
    same = all(old.get(k) == result.get(k) for k in ("schema", "gpu_timing", "size", "dtype")) and (
        old.get("environment", {}).get("device") == result["environment"]["device"]
    )
    if not same:
        return result
    ops = set(result["ops"])
    kept = [r for r in old.get("records", []) if r["op"] not in ops]
    if not kept:
        return result
    merged = dict(result)
    merged["records"] = kept + result["records"]
    merged["ops"] = sorted(ops | {r["op"] for r in kept})
    merged["providers"] = {**old.get("providers", {}), **result["providers"]}
    merged["structure"] = {**old.get("structure", {}), **result["structure"]}
    if "traffic" in old.get("structure", {}):  # per op: the other ops' rows are kept
        merged["structure"]["traffic"] = [
            r for r in old["structure"]["traffic"] if r["op"] not in ops
        ] + result["structure"].get("traffic", [])
    if "formulas" in result:
        kept_formulas = [f for f in old.get("formulas", []) if f["op"] not in ops]
        merged["formulas"] = kept_formulas + result["formulas"]
    merged["merged_from"] = sorted({r.get("run_date") or "?" for r in kept})
    return merged


def write_json(path: Path, result: dict[str, Any]) -> Path:
    path.write_text(json.dumps(_clean(result), indent=1, sort_keys=False) + "\n")
    return path


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _fmt_int(n) -> str:
    return "" if n is None else f"{n:,}"


def _fmt_bytes(n) -> str:
    if n is None:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _fmt(x, digits=3) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    return f"{x:.{digits}g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines + [""]


def _by_op(records) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["op"]].append(r)
    return groups


def _header(result) -> list[str]:
    env = result["environment"]
    title = "GPU timings" if result["gpu_timing"] else "CPU (structural, no GPU timing)"
    lines = [f"# mtp-bench: {env['device']} — {title}", ""]
    lines += [
        f"- date: {env['date']}, size: `{result['size']}`, dtype: {result['dtype']}",
        f"- mtp revision: `{env.get('mtp_revision')}`; torch {env['torch']}, triton "
        f"{env['triton']}, Python {env['python']}",
        f"- machine: {env['platform']}, {env['cpu_count']} CPU cores"
        + (f"; driver {env.get('driver')}, CUDA {env.get('cuda')}" if result["gpu_timing"] else ""),
        f"- command: `{result['command']}`",
        "",
    ]
    if not result["gpu_timing"]:
        lines += [f"**{NO_GPU_STATEMENT}**", ""]
    else:
        peak, ceil = result.get("peak"), result.get("ceilings")
        if peak:
            bw, rate = peak["hbm_bytes_per_s"] / 1e12, peak["bf16_flops_per_s"] / 1e12
            fp8 = peak.get("fp8_flops_per_s")
            fp8 = f", {fp8 / 1e12:.0f} dense FP8 TFLOP/s (the FP8 providers' floor)" if fp8 else ""
            lines.append(
                f"- datasheet floor: {peak['name']}, {bw:.2f} TB/s HBM, {rate:.0f} dense bf16 "
                f"TFLOP/s{fp8} ({peak['source']})"
            )
        else:
            lines.append("- datasheet floor: device not in the peak table (no floor fractions)")
        if ceil:
            bw, rate = ceil["copy_bytes_per_s"] / 1e12, ceil["bf16_matmul_flops_per_s"] / 1e12
            lines.append(f"- measured ceilings: copy {bw:.2f} TB/s, bf16 matmul {rate:.0f} TFLOP/s")
        lines.append("")
    return lines


def _cpu_record_rows(records) -> list[list[str]]:
    rows = []
    for r in records:
        c, chk = r.get("counts", {}), r.get("check")
        err = _fmt(chk["rel_err"], 2) if chk else ""
        counts = [_fmt_int(c.get(k)) for k in ("device_ops", "triton_launches", "aten_ops",
                                                "host_syncs")]  # fmt: skip
        ratio = (r.get("traffic") or {}).get("bytes_over_floor")
        rows.append([r["case"], r["pass"], r["provider"], r["status"], err, *counts,
                     "" if ratio is None else f"{ratio:.3f}", r["note"]])
    return rows


def _skipped_lines(records) -> list[str]:
    """One line naming the providers not run here, with the reason."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for r in records:
        if r["status"] == "skipped" and r["provider"] not in by_reason[r["note"]]:
            by_reason[r["note"]].append(r["provider"])
    return [f"Not run here: {', '.join(names)}: {why}." for why, names in by_reason.items()] + (
        [""] if by_reason else []
    )


def _speedup_text(r) -> str:
    ratios = r.get("speedup_vs") or {}
    return ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())


def _gpu_record_rows(records) -> list[list[str]]:
    rows = []
    for r in records:
        t = r.get("timing")
        if not t:
            rows.append([r["case"], r["pass"], r["provider"], r["status"], "", "", "", "", "", "",
                         "", "", r["note"]])  # fmt: skip
            continue
        med = f"{t['median_ms'] * 1e3:.1f} ({t['p20_ms'] * 1e3:.1f}–{t['p80_ms'] * 1e3:.1f})"
        chk = r.get("check")
        note = r["note"] or (f"err {_fmt(chk['rel_err'], 2)}" if chk else "")
        rows.append([
            r["case"], r["pass"], r["provider"], r["status"], med, _fmt(t.get("gbps"), 4),
            _fmt(t.get("tflops"), 4), _percent(t, "floor_fraction"),
            _percent(t, "ceiling_fraction"),
            _fmt(t.get("host_us"), 4), _fmt_int(t.get("kernels")),
            "" if t.get("peak_mem_bytes") is None else f"{t['peak_mem_bytes'] / 2**20:.0f}",
            _speedup_text(r) + ("; " + note if note else ""),
        ])  # fmt: skip
    return rows


def _percent(figures: dict, key: str) -> str:
    return "" if figures.get(key) is None else f"{100 * figures[key]:.0f}%"


def _traffic_lines(traffic) -> list[str]:
    lines = ["## Bytes / floor, launches and host syncs per call (CPU, counted by address)", "",
             "Unique bytes each program reads and writes under the Triton interpreter (a re-read "
             "by another program or launch counts again) plus the bytes of the aten ops of the "
             "call, over the op's floor formula (`mtp.testing.traffic.count_traffic`; outputs "
             "not poisoned, one warm-up call first). Device ops = Triton launches + aten ops "
             "that run device work (`_assert_async` included).", ""]  # fmt: skip
    rows = [[r["op"], r["case"], r["pass"], r["dtype"], r["provider"],
             _fmt_bytes(r.get("floor_bytes")), _fmt_bytes(r.get("bytes_program")),
             "" if r.get("bytes_over_floor") is None else f"{r['bytes_over_floor']:.3f}",
             _fmt_int(r.get("device_ops")), _fmt_int(r.get("triton_launches")),
             _fmt_int(r.get("aten_ops")), _fmt_int(r.get("host_syncs")), r.get("error", "")]
            for r in traffic]  # fmt: skip
    return lines + _table(["op", "case", "pass", "dtype", "provider", "floor", "bytes moved",
                           "bytes / floor", "device ops", "Triton launches", "aten ops",
                           "host syncs", "error"], rows)  # fmt: skip


def _structure_lines(structure) -> list[str]:
    lines = []
    if structure.get("traffic"):
        lines += _traffic_lines(structure["traffic"])
    ce = structure.get("cross_entropy_collectives")
    if ce:
        lines += ["## Vocab-parallel cross-entropy: collectives per rank (gloo process groups)", ""]
        rows = [[r["world_size"], r["backend"], r["pass"], r["rows"],
                 ", ".join(f"{c['name']} ({c['bytes_per_rank']} B)" for c in r["calls"]) or "none",
                 r["bytes_per_rank"], r["formula_bytes_per_rank"], _fmt(r["rel_err"], 2)]
                for r in ce]  # fmt: skip
        formula = "formula (112 + 12·(rows+2) fwd, 0 bwd)"
        lines += _table(["world", "backend", "pass", "rows", "collectives", "bytes/rank",
                         formula, "loss rel. error"], rows)  # fmt: skip
    lce = structure.get("linear_cross_entropy_loss_bytes")
    if lce:
        lines += ["## Fused linear cross-entropy: bytes of the loss maths beyond the GEMMs", ""]
        rows = [[r.get("reduction", "mean"), r["dtype"], r["backend"],
                 r["fwd_loss_bytes_over_logits"], r["bwd_loss_bytes_over_logits"],
                 r["fwd_cast_bytes_over_logits"], r["bwd_cast_bytes_over_logits"],
                 r["fwd_triton_launches"], r["bwd_triton_launches"],
                 r["fwd_host_syncs"] + r["bwd_host_syncs"]] for r in lce]  # fmt: skip
        lines += _table(["reduction", "dtype", "backend", "fwd / N·V·s", "bwd / N·V·s",
                         "fwd casts", "bwd casts", "fwd launches", "bwd launches",
                         "host syncs"], rows)  # fmt: skip
        lines += [f"N={lce[0]['N']}, H={lce[0]['H']}, V={lce[0]['V']}, chunk={lce[0]['chunk']}; "
                  "casts: `_to_copy` bytes (CPU; on CUDA the Triton path's GEMMs write fp32).", ""]
    moe = structure.get("moe_layer_forward")
    if moe:
        lines += ["## MoE layer, one forward (EP=1, dropless): what it issues by backend and E", ""]
        rows = [[r["E"], r["topk"], r["backend"], r["device_ops"],
                 _fmt_int(r.get("fwd_bwd_device_ops")), r["triton_launches"], r["aten_ops"],
                 r["host_syncs"], _fmt_int(None if r.get("saved_bytes_per_token") is None
                                           else round(r["saved_bytes_per_token"])), r["graph_safe"]]
                for r in moe]  # fmt: skip
        lines += _table(["E", "top-k", "backend", "device ops", "fwd+bwd device ops",
                         "Triton launches", "aten ops", "host syncs", "saved B/token",
                         "graph-safe (assert_graph_safe)"], rows)  # fmt: skip
        lines += [f"T={moe[0]['T']} tokens, H={moe[0]['H']}, F={moe[0]['F']}; Triton kernels "
                  "recorded, not executed. The single-launch backends issue the same work for any "
                  "E; the loop backends one GEMM per expert that received tokens (at most "
                  "T·top-k) and one host sync per grouped GEMM call (the split sizes).", ""]
    lines += _moe_peer_lines(structure.get("moe_layer_peers"))
    for key, value in structure.items():
        if key.endswith("_error"):
            lines += [f"- {key}: {value}", ""]
    return lines


def _moe_peer_lines(rows) -> list[str]:
    if not rows:
        return []
    lines = ["## MoE layer against the peers (CPU counts, same weights and shape)", ""]
    table = [[r["E"], r["topk"], r["provider"], r.get("impl", ""), _fmt_int(r.get("device_ops")),
              _fmt_int(r.get("fwd_bwd_device_ops")), _fmt_int(r.get("host_syncs")),
              r.get("sync_events", ""),
              _fmt_int(None if r.get("saved_bytes_per_token") is None
                       else round(r["saved_bytes_per_token"])), r.get("error", "")]
             for r in rows]  # fmt: skip
    lines += _table(["E", "top-k", "provider", "implementation", "device ops fwd",
                     "device ops fwd+bwd", "host syncs fwd", "sync events (fwd+bwd)",
                     "saved B/token", "error"], table)  # fmt: skip
    first = next(r for r in rows if "T" in r)
    return lines + [f"T={first['T']} tokens, H={first['H']}, F={first['F']}, {first['dtype']}; "
                    "mtp's Triton kernels recorded, not executed. Host syncs counted on CPU "
                    "include host reads of tensors a GPU run keeps on the host (Megatron's "
                    "split sizes after its one device-to-host wait). Timings: GPU runs only.",
                    ""]  # fmt: skip


def write_markdown(path: Path, result: dict[str, Any]) -> Path:
    lines = _header(result)
    groups = _by_op(result["records"])
    if result["gpu_timing"]:
        header = ["case", "pass", "provider", "status", "median µs (p20–p80)", "GB/s", "TFLOP/s",
                  "% floor", "% ceiling", "host µs/call", "kernels", "peak MiB",
                  "speedup vs (their time / this time)"]  # fmt: skip
        for op, records in groups.items():
            lines += [f"## {op}", ""] + _table(header, _gpu_record_rows(records))
    else:
        lines += ["## Smoke check and what one call issues (tiny sizes, CPU)", "",
                  "Relative error: ‖out − ref‖ / ‖ref‖ against float64 (forward outputs and, for "
                  "fwd+bwd, the gradients). Device ops = aten ops that run device work + Triton "
                  "launches (≈ kernel launches on a GPU). At these tiny sizes fixed costs (row "
                  "maps, per-row metadata, partial sums) weigh on bytes / floor; the ≤ 1.10 goal "
                  "is for the mid-size shapes of the traffic section.", ""]  # fmt: skip
        header = ["case", "pass", "provider", "status", "rel. error", "device ops",
                  "Triton launches", "aten ops", "host syncs", "bytes / floor", "note"]  # fmt: skip
        for op, records in groups.items():
            ran = [r for r in records if r["status"] != "skipped"]
            lines += [f"### {op}", ""] + _table(header, _cpu_record_rows(ran))
            lines += _skipped_lines(records)
        lines += _structure_lines(result["structure"])
        formulas = result.get("formulas") or []
        if formulas:
            lines += [f"## Bytes and FLOPs per call at the `{result['formula_size']}` GPU shapes "
                      "(formulas, no measurement)", ""]  # fmt: skip
            rows = [[f["op"], f["case"], f["pass"], _fmt_bytes(f["bytes"]), _fmt(f["flops"], 4),
                     _fmt(f["flop_per_byte"], 3), *f["bound"].values()]
                    for f in formulas]  # fmt: skip
            lines += _table(["op", "case", "pass", "bytes", "FLOPs", "FLOP/byte",
                             *[f"bound on {d}" for d in _BOUND_DEVICES]], rows)  # fmt: skip
    plots = result.get("plots") or []
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------------------------
# stdout
# --------------------------------------------------------------------------------------------


def _peer_summary(r) -> str:
    head = f"  E={r['E']:<4} top{r['topk']} {r['provider']:14}"
    if r.get("error"):
        return f"{head} failed: {r['error']}"
    return (f"{head} {r['device_ops']:>5} / {r['fwd_bwd_device_ops']:<5} "
            f"{r['host_syncs']:>3} {round(r['saved_bytes_per_token']):>7}")


def stdout_table(result: dict[str, Any], limit: int = 60) -> str:
    """A short plain-text table: the CPU check and counts, or the GPU medians."""
    lines = []
    if not result["gpu_timing"]:
        lines.append(NO_GPU_STATEMENT)
        lines.append("Smoke check (worst relative error over the tiny cases) and what one call "
                     "issues (range over the cases):")
        lines.append(f"  {'op':13} {'pass':8} {'provider':12} {'checked':>8} {'max err':>8} "
                     f"{'device ops':>10} {'Triton':>7} {'syncs':>6}")  # fmt: skip
        groups = group_records(result["records"], ("op", "pass", "provider"))
        for (op, pass_, prov), rows in groups.items():
            ran = [r for r in rows if r["status"] != "skipped"]
            if not ran:
                continue
            checked = [r for r in ran if r.get("check")]
            ok = sum(1 for r in checked if r["check"]["ok"] and r["status"] == "ok")
            errs = [r["check"]["rel_err"] for r in checked]
            failed = [r for r in ran if r["status"] == "failed" and not r.get("check")]
            lines.append(
                f"  {op:13} {pass_:8} {prov:12} {f'{ok}/{len(checked)}':>8} "
                f"{(_fmt(max(errs), 2) if errs else ''):>8} {_span(ran, 'device_ops'):>10} "
                f"{_span(ran, 'triton_launches'):>7} {_span(ran, 'host_syncs'):>6}"
                + (f"  FAILED: {failed[0]['note']}" if failed else "")
            )
        moe = result["structure"].get("moe_layer_forward") or []
        if moe:
            lines.append("MoE layer forward: device ops / host syncs by E")
            for (backend,), rows in group_records(moe, ("backend",)).items():
                cells = ", ".join(f"E={r['E']}: {r['device_ops']}/{r['host_syncs']}" for r in rows)
                lines.append(f"  {backend:12} {cells}")
        peers = result["structure"].get("moe_layer_peers") or []
        if peers:
            lines.append("MoE layer vs peers: device ops fwd / fwd+bwd, host syncs, saved B/token")
            for r in peers:
                lines.append(_peer_summary(r))
        for r in result["structure"].get("cross_entropy_collectives") or []:
            lines.append(
                f"vocab-parallel CE world={r['world_size']} {r['backend']:9} {r['pass']:3}: "
                f"{len(r['calls'])} collective(s), {r['bytes_per_rank']} B/rank "
                f"(formula {r['formula_bytes_per_rank']})"
            )
    else:
        lines.append(f"{'op':13} {'pass':8} {'provider':18} {'median µs':>10} {'GB/s':>8} "
                     f"{'TFLOP/s':>8} {'%floor':>6}")  # fmt: skip
        for r in result["records"][:limit]:
            t = r.get("timing")
            if not t:
                lines.append(f"{r['op']:13} {r['pass']:8} {r['provider']:18} {r['status']}")
                continue
            floor = t.get("floor_fraction")
            lines.append(
                f"{r['op']:13} {r['pass']:8} {r['provider']:18} {t['median_ms'] * 1e3:10.1f} "
                f"{_fmt(t.get('gbps'), 4):>8} {_fmt(t.get('tflops'), 4):>8} "
                f"{'' if floor is None else f'{100 * floor:.0f}%':>6}"
            )
        if len(result["records"]) > limit:
            lines.append(f"... {len(result['records']) - limit} more rows in results.md")
    return "\n".join(lines)


def _span(records, key) -> str:
    values = sorted({r["counts"][key] for r in records if r.get("counts")})
    if not values:
        return ""
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def main(argv=None) -> int:
    """``python -m bench.report DIR``: the plots and ``results.md`` of ``DIR/results.json``
    (a lent GPU's run writes no plots; they are drawn here from the JSON)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a folder holding results.json")
    args = parser.parse_args(argv)
    result = json.loads((args.folder / "results.json").read_text())
    plots, note = write_plots(args.folder, result)
    result["plots"], result["plot_note"] = plots, note
    write_json(args.folder / "results.json", result)
    write_markdown(args.folder / "results.md", result)
    print(f"wrote {len(plots)} plot(s) and results.md in {args.folder}"
          + (f" ({note})" if note else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
