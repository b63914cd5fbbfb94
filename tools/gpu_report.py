"""The summaries ``tools/gpu_check.py`` prints and writes, from pytest's and mtp-bench's files.

Pure functions (no torch, no GPU), tested on CPU in ``tests/test_gpu_kit.py``.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["NO_GPU", "bench_table", "collected_text", "failures_text", "graphs_table",
           "junit_counts", "merge_counts", "merge_junit", "progress_text", "tests_text",
           "text_table"]  # fmt: skip

NO_GPU = "not run: no GPU"


def junit_counts(path: Path) -> dict:
    """passed/failed/errors/skipped and the first failing test id from a JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = dict(tests=0, failed=0, errors=0, skipped=0, first_failure=None)
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            kinds = {child.tag for child in case}
            if "failure" in kinds or "error" in kinds:
                counts["failed" if "failure" in kinds else "errors"] += 1
                counts["first_failure"] = counts["first_failure"] or (
                    f"{case.get('classname')}::{case.get('name')}"
                )
            elif "skipped" in kinds:
                counts["skipped"] += 1
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def tests_text(counts: dict) -> str:
    if "note" in counts:
        return counts["note"]
    text = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped")  # fmt: skip
    if counts.get("first_failure"):
        text += f" (first: {counts['first_failure']})"
    return text


def progress_text(log: Path) -> str:
    """What pytest -q's progress lines ('..F.s  [ 40%]') show so far."""
    marks = "".join(
        line.split()[0]
        for line in log.read_text(errors="replace").splitlines()
        if re.fullmatch(r"[.FEsxX]+\s+\[\s*\d+%\]", line.strip())
    )
    counts = {k: marks.count(c) for k, c in (("passed", "."), ("failed", "F"), ("errors", "E"),
                                             ("skipped", "s"))}  # fmt: skip
    return ", ".join(f"{v} {k}" for k, v in counts.items()) + " (from the log)"


def bench_table(result: dict) -> list[str]:
    """Per (op, pass): best mtp backend (most wins), geomean of its median ms over the cases,
    and for every other provider the geomean of (its median / best mtp median): > 1 = mtp faster.
    """
    if not result.get("gpu_timing"):
        return [f"bench: {NO_GPU}"]
    cases: dict[tuple, list[dict]] = {}
    for r in result.get("records", []):
        cases.setdefault((r["op"], r["pass"], r["case"]), []).append(r)
    groups: dict[tuple, dict] = {}
    failed = []
    for (op, pas, _), recs in cases.items():
        failed += [f"{op}/{r['provider']}" for r in recs if r.get("status") == "failed"]
        timed = [r for r in recs if r.get("status") == "ok" and r.get("timing")]
        mtp = [r for r in timed if r.get("kind") == "mtp"]
        if not mtp:
            continue
        best = min(mtp, key=lambda r: r["timing"]["median_ms"])
        g = groups.setdefault((op, pas), dict(wins={}, ms=[], ratios={}))
        g["wins"][best["provider"]] = g["wins"].get(best["provider"], 0) + 1
        g["ms"].append(best["timing"]["median_ms"])
        for r in timed:
            if r.get("kind") != "mtp":
                g["ratios"].setdefault(r["provider"], []).append(
                    r["timing"]["median_ms"] / best["timing"]["median_ms"]
                )
    rows = []
    for (op, pas), g in sorted(groups.items()):
        ranked = sorted(g["wins"].items(), key=lambda kv: (-kv[1], kv[0]))
        wins = ", ".join(f"{k} {v}" for k, v in ranked)
        vs = ", ".join(f"{p} {_geomean(v):.2f}x" for p, v in sorted(g["ratios"].items()))
        rows.append([op, pas, str(len(g["ms"])), wins, f"{_geomean(g['ms']):.4g}", vs])
    lines = ["bench (best mtp backend per case; ms = geomean of its medians; vs = other "
             "provider's time / mtp's, geomean, > 1 = mtp faster):"]  # fmt: skip
    lines += text_table(["op", "pass", "cases", "best mtp (wins)", "ms", "vs"], rows) if rows else [
        "  no timed mtp case"
    ]
    if failed:
        lines.append(f"failed records: {', '.join(sorted(set(failed)))}")
    return lines


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    widths[-1] = 0  # the last column is free text
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header)] + [fmt(r) for r in rows]


def collected_text(log: Path) -> str:
    """'118 of 555' from pytest's --collect-only -q closing line ('118/555 tests collected')."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        m = re.search(r"(\d+)(?:/(\d+))? tests? collected", line)
        if m:
            return m.group(1) + (f" of {m.group(2)}" if m.group(2) else "")
    return "?"


def failures_text(path: Path, limit: int = 15) -> list[str]:
    """The failing test ids ``pytest_live_failures`` wrote (at most ``limit`` lines)."""
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    if not lines:
        return []
    out = [f"failing tests ({len(lines)}):"] + [f"  {ln}" for ln in lines[:limit]]
    if len(lines) > limit:
        out.append(f"  ... {len(lines) - limit} more in failures.txt")
    return out


def graphs_table(data: dict) -> list[str]:
    """Eager vs CUDA-graphed steps (``bench.bench_graphs --json``): host and device ms per
    step, launches, and the graphed step's host-time gain."""
    rows, eager = [], {}
    for r in data.get("rows", []):
        key = (r["model"], r["tokens"])
        if r["mode"] == "eager":
            eager[key] = r
        base = eager.get(key)
        gain = (f"{base['host_ms'] / r['host_ms']:.1f}x host" if base and r["mode"] != "eager"
                and r["host_ms"] else "")
        rows.append([r["model"], str(r["tokens"]), r["mode"], _num(r["host_ms"]),
                     _num(r["device_ms"]), _num(r["launches"], 0), gain])  # fmt: skip
    if not rows:
        return []
    return ["graphs (one pipeline step, eager vs CUDA-graphed):"] + text_table(
        ["model", "tokens", "mode", "host ms", "device ms", "launches", "gain"], rows)


def _num(value, digits: int = 3) -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "?"
    return "nan" if math.isnan(value) else f"{value:.{digits}f}"


def merge_counts(parts: list[dict]) -> dict:
    """One count of several pytest runs' counts (a part that did not run gives a note)."""
    notes = [p["note"] for p in parts if "note" in p]
    full = [p for p in parts if "note" not in p]
    if not full:
        return {"note": "; ".join(notes)}
    total = {k: sum(p[k] for p in full) for k in ("tests", "passed", "failed", "errors", "skipped")}
    total["first_failure"] = next((p["first_failure"] for p in full if p["first_failure"]), None)
    if notes:
        total["first_failure"] = (total["first_failure"] or "") + f" [{'; '.join(notes)}]"
    return total


def merge_junit(parts: list[Path], dest: Path) -> None:
    """One JUnit file of the parts' test suites (the flat file that comes back)."""
    root = ET.Element("testsuites")
    for part in parts:
        if part.exists():
            tree = ET.parse(part).getroot()
            root.extend([tree] if tree.tag == "testsuite" else list(tree))
    ET.ElementTree(root).write(dest, encoding="utf-8", xml_declaration=True)
