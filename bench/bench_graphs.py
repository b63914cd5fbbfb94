"""Eager vs CUDA-graphed training steps at small token counts (the launch-bound case).

    python -m bench.bench_graphs                 # on a GPU: dense block and MoE block
    python -m bench.bench_graphs --device cpu    # smoke run with stand-in graphs (no timings
                                                 # worth reading: the stand-in re-runs Python)

For each model (two dense residual MLP blocks; two MoE blocks captured ``moe_router`` / ``full``)
and token count, one step is the forward and backward of ``--microbatches`` microbatches in the
1F1B order of pipeline rank 0 (``--pp`` stages). Reported per step: host time (launch time, no
synchronisation inside the step), device time (CUDA events), and kernel launches seen by the
CUDA runtime (``cudaLaunchKernel``-like and ``cudaGraphLaunch`` calls, from torch.profiler).
Not registered in ``mtp-bench``'s families (it measures whole steps, not one op).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

from mtp.graphs import PartialMoEBlock, capture_blocks, make_graphed_callables
from mtp.pipeline import get_pipeline_order, order_to_steps


class Dense(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.a, self.b = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(self.norm(x))))


def build(kind, h, device):
    if kind == "dense":
        return [Dense(h).to(device) for _ in range(2)]
    from mtp.moe import MoELayer

    scope, cf = {"moe_router": ("moe_router", None), "moe_full": ("full", None)}[kind]
    return [PartialMoEBlock(Dense(h), MoELayer(h, 2 * h, num_experts=8, topk=2,
                                               capacity_factor=cf), scope).to(device)
            for _ in range(2)]


def make_step(layers, order, inputs, grads, graphed):
    steps = order_to_steps(order)

    def step():
        pending = {}
        for b in layers:
            if hasattr(b, "graphed") and b.graphed is not None:
                b.graphed.reset()
        for s in steps:
            if s.forward:
                y = inputs[s.microbatch]
                for i, layer in enumerate(layers):
                    y = graphed[i][s.microbatch](y) if graphed else layer(y)
                pending[s.microbatch] = y
            else:
                pending.pop(s.microbatch).backward(grads[s.microbatch])

    return step


def measure(step, device, iters):
    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    host = []
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    dev_ms = float("nan")
    if device.type == "cuda":
        end.record()
        sync()
        dev_ms = start.elapsed_time(end) / iters
    launches = float("nan")
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        launches = sum(1 for e in prof.events()
                       if "LaunchKernel" in e.name or "GraphLaunch" in e.name)
    return 1e3 * sorted(host)[len(host) // 2], dev_ms, launches


def run(kind, tokens, args, device):
    torch.manual_seed(0)
    h = args.hidden
    order = get_pipeline_order(args.pp, 0, args.microbatches)
    inputs = [torch.randn(tokens, h, device=device, requires_grad=True)
              for _ in range(args.microbatches)]
    grads = [torch.randn(tokens, h, device=device) for _ in range(args.microbatches)]
    eager_layers = build(kind, h, device)
    graph_layers = copy.deepcopy(eager_layers)
    sample = torch.zeros(tokens, h, device=device, requires_grad=True)
    if kind == "dense":
        graphs, _, _ = make_graphed_callables(graph_layers, [(sample,)] * 2, order=order)
        graphed_step = make_step(graph_layers, order, inputs, grads, graphs)
    else:
        capture_blocks(graph_layers, sample, order=order)
        graphed_step = make_step(graph_layers, order, inputs, grads, None)
    rows = []
    for name, step in (("eager", make_step(eager_layers, order, inputs, grads, None)),
                       ("graphed", graphed_step)):
        host, dev, launches = measure(step, device, args.iters)
        rows.append((kind, tokens, name, host, dev, launches))
    return rows


ROW_KEYS = ("model", "tokens", "mode", "host_ms", "device_ms", "launches")


def write_rows(path: Path, rows: list[tuple], device: str) -> None:
    """``{"device", "rows": [{model, tokens, mode, host_ms, device_ms, launches}]}``, written
    atomically (a run killed at its time limit keeps the rows it finished)."""
    data = {"device": device, "rows": [dict(zip(ROW_KEYS, r)) for r in rows]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--models", nargs="+", default=["dense", "moe_router", "moe_full"])
    p.add_argument("--json", type=Path, default=None,
                   help="also write the rows here (rewritten after each model and size)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    done: list[tuple] = []
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})"
          f", pp={args.pp} rank 0 order, {args.microbatches} microbatches per step")
    print(f"{'model':<11}{'tokens':>7}  {'mode':<8}{'host ms':>9}{'device ms':>11}"
          f"{'launches':>10}")
    for kind in args.models:
        for tokens in args.tokens:
            for row in run(kind, tokens, args, device):
                print(f"{row[0]:<11}{row[1]:>7}  {row[2]:<8}{row[3]:>9.3f}{row[4]:>11.3f}"
                      f"{row[5]:>10}", flush=True)
                done.append(row)
            if args.json is not None:
                write_rows(args.json, done, name)


if __name__ == "__main__":
    main()
