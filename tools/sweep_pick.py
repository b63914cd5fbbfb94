"""Sweep results -> committed configs: read the JSONL of ``tools/gpu_sweep.py`` (records whose
check passed only) and print, or with ``--write`` write, the entries of

- ``mtp/ops/grouped_gemm/config.py``'s ``TUNED``: per (arch, dtype or ``fp8-<recipe>`` for the
  FP8 families, gemm, epilogue, shape class)
  the fastest candidate, when it beats today's rule (the run's baseline) by more than
  ``--margin``; families that share a key (the activation's forward and backward use the same
  tiles) are ranked by the sum of their times, over candidates measured in each;
- ``TUNED_BACKENDS``: per forward shape class the backend whose forward + data gradient + weight
  gradient is fastest (the best Triton candidate of each, ``F.grouped_mm`` as ``torch``,
  ``cutlass``), when it is not Triton;
- the memory-bound families' launch constants (``mtp/kernels/<module>.py``): the candidate with
  the best geometric mean of its speed-ups over the baseline across the family's cases, each
  constant's line rewritten with the sweep file cited.

Every entry cites the sweep file and the bundle commit of its run.
Usage: ``python tools/sweep_pick.py SWEEP.jsonl [--write] [--margin 0.03]``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path[:0] = [p for p in (str(ROOT), str(TOOLS)) if p not in sys.path]

import sweep_space as space  # noqa: E402
from gpu_sweep import read_jsonl  # noqa: E402

CONFIG = ROOT / "mtp" / "ops" / "grouped_gemm" / "config.py"
PEER_BACKEND = {"F.grouped_mm": "torch", "cutlass": "cutlass"}


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("stage") == "gpu" and r.get("status") == "ok"]


def gemm_entries(records: list[dict], source: str, margin: float) -> dict:
    env = next((r for r in records if r.get("stage") == "env"), {})
    by_key: dict = {}  # table key -> {family: {cand key: (ms, cand)}}, and baselines
    for r in _ok(records):
        if r["family"] not in space.GEMM_KIND or r.get("provider"):
            continue
        s = r["shape"]
        gemm, epilogue = space.GEMM_KIND[r["family"]]
        from mtp.ops.grouped_gemm.config import shape_class

        key = (r["arch"], space.table_dtype(r["family"], r["arch"]), gemm, epilogue,
               shape_class(s["M"], s["N"], s["K"], s["E"]))  # fmt: skip
        fam = by_key.setdefault(key, {}).setdefault(r["family"], {})
        fam[r["key"]] = min(fam.get(r["key"], (math.inf, None)), (r["ms"], r["cand"]))
        if r.get("baseline"):
            fam["(baseline)"] = (r["ms"], r["cand"])
    out = {}
    for key, fams in by_key.items():
        common = set.intersection(*(set(f) for f in fams.values())) - {"(baseline)"}
        if not common or not all("(baseline)" in f for f in fams.values()):
            continue
        total = {k: sum(f[k][0] for f in fams.values()) for k in common}
        best = min(common, key=total.get)
        base = sum(f["(baseline)"][0] for f in fams.values())
        if total[best] < base * (1 - margin):
            cand = next(iter(fams.values()))[best][1]
            fields = {k: v for k, v in cand.items() if k not in ("baseline", "programs")}
            out[key] = {"config": fields, "source": source, "commit": env.get("commit"),
                        "device": env.get("device"), "ms": round(total[best], 5),
                        "default_ms": round(base, 5)}  # fmt: skip
    return out


def backend_entries(records: list[dict], source: str, margin: float) -> dict:
    from mtp.ops.grouped_gemm.config import shape_class

    env = next((r for r in records if r.get("stage") == "env"), {})
    best: dict = {}  # (arch, model) -> {backend: {family: ms}}
    for r in _ok(records):
        if r["family"] not in ("gg_fwd", "gg_dgrad", "gg_wgrad") or not r.get("shape"):
            continue
        backend = PEER_BACKEND.get(r.get("provider"), "triton" if not r.get("provider") else None)
        if backend is None:
            continue
        times = best.setdefault((r["arch"], r["shape"]["model"]), {}).setdefault(backend, {})
        times[r["family"]] = min(times.get(r["family"], math.inf), r["ms"])
    out = {}
    for (arch, model), backends in best.items():
        sums = {b: sum(t.values()) for b, t in backends.items() if len(t) == 3}
        if "triton" not in sums:
            continue
        winner = min(sums, key=sums.get)
        if winner != "triton" and sums[winner] < sums["triton"] * (1 - margin):
            s = space.gemm_shape("gg_fwd", model)
            key = (arch, "bfloat16", shape_class(s.M, s.N, s.K, s.E))
            out[key] = {"backend": winner, "source": source, "commit": env.get("commit"),
                        "device": env.get("device"),
                        "ms": {b: round(v, 5) for b, v in sums.items()}}  # fmt: skip
    return out


def memory_choices(records: list[dict], margin: float) -> dict:
    """family -> the constants with the best geometric-mean speed-up over the baseline (over
    the cases where every candidate's check passed), when above ``1 + margin``."""
    out = {}
    for fam in space.MEMORY_FAMILIES:
        rows = [r for r in _ok(records) if r["family"] == fam and not r.get("provider")]
        base = {r["shape"]: r["ms"] for r in rows if r.get("baseline")}
        scores: dict = {}
        for r in rows:
            if r["shape"] in base:
                scores.setdefault(r["key"], (r["cand"], []))[1].append(base[r["shape"]] / r["ms"])
        full = {k: v for k, v in scores.items() if len(v[1]) == len(base)}
        if not full:
            continue
        key = max(full, key=lambda k: sum(map(math.log, full[k][1])))
        gain = math.exp(sum(map(math.log, full[key][1])) / len(base))
        if gain > 1 + margin:
            out[fam] = {k: v for k, v in full[key][0].items() if k != "baseline"} | {
                "gain": round(gain, 3)}
    return out


def _table_text(name: str, annotation: str, entries: dict) -> str:
    if not entries:
        return f"{name}: {annotation} = {{}}"
    body = "".join(f"    {k!r}: {json.dumps(v, sort_keys=True)},\n" for k, v in sorted(
        entries.items(), key=str)).replace(": true", ": True").replace(": false", ": False")
    return f"{name}: {annotation} = {{\n{body}}}".replace(": null", ": None")


def write_tables(gemm: dict, backends: dict, path: Path = CONFIG) -> None:
    text = path.read_text()
    for name, entries in (("TUNED", gemm), ("TUNED_BACKENDS", backends)):
        pattern = re.compile(rf"^{name}: (dict\[[^\n]*\]) = \{{(\}}|\n.*?^\}})", re.M | re.S)
        match = pattern.search(text)
        if match is None:
            raise SystemExit(f"sweep_pick: no {name} table in {path}")
        text = text[:match.start()] + _table_text(name, match.group(1), entries) + \
            text[match.end():]  # fmt: skip
    path.write_text(text)


def write_constants(choices: dict, source: str) -> None:
    for fam, values in choices.items():
        for module in space.PATCHES[fam][0]:  # each constant in the module that defines it
            path = ROOT / "kernels" / (module.rsplit(".", 1)[1] + ".py")
            text = path.read_text()
            for name, value in values.items():
                if name != "gain":
                    text = re.sub(rf"^{name} = [^\n]*$",
                                  f"{name} = {value}  # measured: {source}", text, count=1,
                                  flags=re.M)  # fmt: skip
            path.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", type=Path, nargs="+")
    parser.add_argument("--margin", type=float, default=0.03, help="least gain over the default")
    parser.add_argument("--write", action="store_true", help="write config.py and the constants")
    args = parser.parse_args(argv)
    records = [r for path in args.jsonl for r in read_jsonl(path)]
    source = ", ".join(str(p.relative_to(ROOT) if p.resolve().is_relative_to(ROOT) else p)
                       for p in args.jsonl)  # fmt: skip
    gemm = gemm_entries(records, source, args.margin)
    backends = backend_entries(records, source, args.margin)
    memory = memory_choices(records, args.margin)
    print(_table_text("TUNED", "dict", gemm))
    print(_table_text("TUNED_BACKENDS", "dict", backends))
    print("memory-bound constants:", json.dumps(memory, indent=1))
    if args.write:
        write_tables(gemm, backends)
        write_constants(memory, source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
