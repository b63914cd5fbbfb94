"""Which TMA grouped GEMM configs compute the right result on this GPU, and how fast?

A TMA kernel that leaves rows of its tiles unwritten shows as NaN in a poisoned output at real
sizes even where the pointer kernels and the interpreter are right. This script runs the forward
and the weight-gradient TMA kernels with the table's configs and variants (warp specialisation
off, 8 warps, no flattening, smaller tiles) against an fp32 reference on NaN-poisoned outputs,
and times the correct ones. One line per variant; ``--json`` keeps them. Then a small MoE layer
forward+backward per TMA setting in a child process with a time limit, so that a kernel that
hangs costs one setting, not the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MOE_CHILD = """
import os, time, torch
from mtp.moe import MoELayer
torch.manual_seed(0)
layer = MoELayer(1024, 512, 64, 8, activation="swiglu", backend="triton",
                 params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
t0 = time.time()
y = layer(x)
y.float().pow(2).sum().backward()
torch.cuda.synchronize()
ok = bool(torch.isfinite(y).all() and torch.isfinite(x.grad).all())
print("moe_layer TMA=%s finite=%s %.1f s" % (os.environ.get("MTP_TRITON_TMA"), ok, time.time() - t0))
"""


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    d = (a - b).norm().item()
    return float("inf") if d != d else d / max(b.norm().item(), 1e-30)


def measure(row: dict, launch, out, ref) -> dict:
    """Poison ``out``, run ``launch(out)``, count unwritten (NaN) elements and the error against
    ``ref``, and time it when it is right; prints and returns ``row``."""
    import torch
    from triton.testing import do_bench

    try:
        out.fill_(float("nan"))
        launch(out)
        torch.cuda.synchronize()
        row["nan"] = int(torch.isnan(out).sum())
        row["rel_err"] = rel(out, ref)
        if row["rel_err"] < 2e-2:
            row["ms"] = do_bench(lambda: launch(out), warmup=5, rep=20)
    except Exception as exc:  # noqa: BLE001 - one broken variant must not stop the rest
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    return row


def main() -> int:
    import torch

    from mtp.kernels.grouped_gemm_details import launch as L
    from mtp.ops.grouped_gemm.config import device_arch, make_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    dev = torch.device("cuda")
    arch, sms = device_arch(dev)
    torch.manual_seed(0)
    shapes = {  # name: (counts, K, N)
        "mixed": ([0, 700, 3, 0, 1290, 64, 1, 0], 264, 200),
        "qwen3": ([256] * 128, 2048, 768),
    }
    fwd_variants = {
        "table": lambda c: c,
        "no_ws": lambda c: dataclasses.replace(c, warp_specialize=False),
        "ws_8warps": lambda c: dataclasses.replace(c, num_warps=8),
        "ws_bm64": lambda c: dataclasses.replace(c, block_m=64),
    }
    for name, (sizes, Kd, N) in shapes.items():
        M = sum(sizes) + 37
        E = len(sizes)
        x = torch.randn(M, Kd, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, Kd, N, device=dev) / Kd**0.5).to(torch.bfloat16)
        counts = torch.tensor(sizes, device=dev)
        ref = torch.zeros(M, N, device=dev)
        start = 0
        for e, m in enumerate(sizes):
            ref[start:start + m] = x[start:start + m].float() @ w[e].float()
            start += m
        base = make_config(arch, torch.bfloat16, M, N, Kd, E, tma_ok=True, sms=sms)
        out = torch.empty((M, N), device=dev, dtype=torch.bfloat16)
        for vname, make in fwd_variants.items():
            cfg = make(base)
            row = dict(kernel="fwd", shape=name, variant=vname, config=dataclasses.asdict(cfg))
            rows.append(measure(row, lambda o, c=cfg: L.forward(x, w, counts, o, c), out, ref))
        ptr = make_config(arch, torch.bfloat16, M, N, Kd, E, sms=sms)  # for comparison
        row = dict(kernel="fwd", shape=name, variant="pointer", config=dataclasses.asdict(ptr))
        rows.append(measure(row, lambda o: L.forward(x, w, counts, o, ptr), out, ref))
        # weight gradient: dw[e] = x_e^T @ dy_e
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        dref = torch.zeros(E, Kd, N, device=dev)
        start = 0
        for e, m in enumerate(sizes):
            dref[e] = x[start:start + m].float().T @ dy[start:start + m].float()
            start += m
        wbase = make_config(arch, torch.bfloat16, M, N, Kd, E, gemm="wgrad", tma_ok=True,
                            sms=sms)
        wvariants = {
            "table": wbase,
            "no_ws": dataclasses.replace(wbase, warp_specialize=False),
            "ws_8warps": dataclasses.replace(wbase, num_warps=8),
        }
        dw = torch.empty((E, Kd, N), device=dev, dtype=torch.bfloat16)
        for vname, cfg in wvariants.items():
            row = dict(kernel="wgrad", shape=name, variant=vname, config=dataclasses.asdict(cfg))
            rows.append(measure(row, lambda o, c=cfg: L.wgrad(x, dy, counts, o, c), dw, dref))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    for tma in ("0", "1"):
        env = dict(os.environ, MTP_TRITON_TMA=tma, PYTHONPATH=str(ROOT))
        t0 = time.time()
        try:
            out = subprocess.run([sys.executable, "-c", MOE_CHILD], env=env, timeout=30,
                                 capture_output=True, text=True, cwd=ROOT)
            line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]
        except subprocess.TimeoutExpired:
            line = f"moe_layer TMA={tma}: no result in 30 s (hang?)"
        rows.append(dict(kernel="moe_layer", variant=f"TMA={tma}", result=line,
                         seconds=round(time.time() - t0, 1)))
        print(line, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
