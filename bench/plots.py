"""The PNG plots of a run: per op and pass, the rate of each provider against the datasheet
roofline and the measured ceiling (GPU runs), or the MoE layer's launches by backend (CPU runs)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["write_plots"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(folder: Path, result: dict[str, Any]) -> tuple[list[str], str | None]:
    """PNG files written (names relative to ``folder``) and a note when none could be."""
    plt = _pyplot()
    if plt is None:
        return [], "matplotlib is not installed: no plots (pip install 'mtp[bench]')"
    if result["gpu_timing"]:
        return _gpu_plots(plt, folder, result), None
    return _cpu_plots(plt, folder, result), None


def _gpu_plots(plt, folder: Path, result) -> list[str]:
    peak, ceil = result.get("peak"), result.get("ceilings")
    names = []
    for (op, pass_), records in group_records(result["records"], ("op", "pass")).items():
        timed = [r for r in records if r.get("timing") and r.get("status") == "ok"]
        if not timed:
            continue
        compute = any(r["flops"] for r in timed)
        cases = list(dict.fromkeys(r["case"] for r in timed))
        providers = list(dict.fromkeys(r["provider"] for r in timed))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) + 3), 4.5))
        width = 0.8 / len(providers)
        for i, prov in enumerate(providers):
            ys = []
            for c in cases:
                r = next((r for r in timed if r["case"] == c and r["provider"] == prov), None)
                ys.append((r["timing"]["tflops"] if compute else r["timing"]["gbps"]) if r else 0)
            xs = [j + i * width - 0.4 + width / 2 for j in range(len(cases))]
            ax.bar(xs, ys, width, label=prov)
        _roofline(ax, timed, cases, compute, peak, ceil)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c.replace(" ", "\n", 2) for c in cases], fontsize=7)
        ax.set_ylabel("TFLOP/s" if compute else "GB/s")
        ax.set_title(f"{op} {pass_} ({result['environment']['device']}, {result['dtype']})")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        name = f"{op}_{pass_.replace('+', '_')}.png"
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def _roofline(ax, timed, cases, compute, peak, ceil) -> None:
    """The roofline per case (``min(rate, intensity * bandwidth)``, or the bandwidth) as a line."""
    lines = ((peak, "-", "datasheet roofline"), (ceil, "--", "measured ceiling"))
    for limits, style, label in lines:
        if not limits:
            continue
        bw = limits.get("hbm_bytes_per_s") or limits.get("copy_bytes_per_s")
        rate = limits.get("bf16_flops_per_s") or limits.get("bf16_matmul_flops_per_s")
        ys = []
        for c in cases:
            r = next(r for r in timed if r["case"] == c)
            if compute and r["flops"]:
                roof = min(rate, r["flops"] / r["bytes"] * bw) if r["bytes"] else rate
                ys.append(roof / 1e12)
            else:
                ys.append(bw / 1e9)
        ax.plot(range(len(cases)), ys, style, color="black", linewidth=1.2, label=label)


def group_records(records, keys) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _cpu_plots(plt, folder: Path, result) -> list[str]:
    moe = result["structure"].get("moe_layer_forward")
    if not moe:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    styles = ["-", "--", ":", "-.", (0, (5, 1))]
    for i, ((backend,), rows) in enumerate(group_records(moe, ("backend",)).items()):
        rows = sorted(rows, key=lambda r: r["E"])
        ax.plot([r["E"] for r in rows], [r["device_ops"] for r in rows], marker="o",
                linestyle=styles[i % len(styles)], label=backend)  # fmt: skip
    experts = sorted({r["E"] for r in moe})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(experts)
    ax.set_xticklabels([str(e) for e in experts])
    ax.set_xlabel("experts E")
    ax.set_ylabel("device ops per forward (≈ kernel launches)")
    ax.set_title("MoE layer forward (EP=1): launches by grouped GEMM backend (counted on CPU)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = "moe_layer_launches.png"
    fig.savefig(folder / name, dpi=110)
    plt.close(fig)
    return [name]
