"""The host benchmark: what an eager call costs the CPU, measured without a GPU.

Runs every op under the null-GPU stand-in (:mod:`mtp.testing.null_gpu`: kernels compiled for
sm_90a, Triton's launch path real, the C launcher a counting stub) on small CPU tensors, one call
per op and pass, interleaved with the floors measured in the same loop:

- ``bare``: a bare ``torch.autograd.Function`` of the same pass (forward: one ``new_empty``;
  backward: returns its gradient): what any autograd op costs at least;
- ``aten``: the plain-PyTorch equivalent, where one exists (aten ops run on the CPU for real,
  so the shapes are small).

Figures are thread-CPU microseconds per call, medians. ``fwd+bwd (1 thread)`` is the same pass
with ``torch.autograd.set_multithreading_enabled(False)``: on a GPU the default hands every
backward to autograd's device thread (hundreds of microseconds on the H200 host, torch's cost,
not the op's); on the stand-in (CPU tensors) both run on the calling thread. Besides the times:
kernel launches and Python function calls per call (``sys.setprofile``; deterministic for
pinned versions), the figures the host-budget tests assert.

    mtp-bench --host                     # every case (also: python -m bench.host)
    mtp-bench --host bias_gelu moe       # cases whose name starts with these
    mtp-bench --host --json out.json

Needs a process without ``TRITON_INTERPRET``; :func:`main` re-runs itself in one if needed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["CASES", "count_calls", "main", "measure"]


def _torch():
    import torch

    return torch


class _Bare:
    """The floor: a bare autograd.Function (built lazily: torch is imported in the worker)."""

    fn = None

    @classmethod
    def get(cls):
        if cls.fn is None:
            torch = _torch()

            class Bare(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.new_empty(x.shape)

                @staticmethod
                def backward(ctx, g):
                    return g

            cls.fn = Bare
        return cls.fn


def _passes(call: Callable, inputs: tuple, grad_of: Callable | None = None) -> dict:
    """``{"fwd": f, "fwd+bwd": g}`` for ``call(*inputs)`` (its first output is differentiated
    with a fixed upstream gradient of its shape)."""
    torch = _torch()
    out = call(*inputs)
    first = out[0] if isinstance(out, tuple) else out
    upstream = torch.ones_like(first) if grad_of is None else grad_of(first)

    def fwd():
        return call(*inputs)

    def fwd_bwd():
        o = call(*inputs)
        (o[0] if isinstance(o, tuple) else o).backward(upstream)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


# --------------------------------------------------------------------------------------------
# Cases: each returns {"mtp": passes, "aten": passes or None, "bare": passes}
# --------------------------------------------------------------------------------------------


def _bare_passes(x) -> dict:
    return _passes(_Bare.get().apply, (x,))


def _case_bias_act(gated: bool):
    def build():
        torch = _torch()
        import torch.nn.functional as F

        from mtp.ops import bias_gelu, bias_swiglu

        width = 512 if gated else 256
        x = torch.randn(64, width, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(width, dtype=torch.bfloat16, requires_grad=True)
        if gated:
            def aten(x, b):
                a, g = torch.chunk(x + b, 2, dim=-1)
                return F.silu(a) * g
            mtp = bias_swiglu
        else:
            def aten(x, b):
                return F.gelu(x + b)
            mtp = bias_gelu
        return {"mtp": _passes(mtp, (x, b)), "aten": _passes(aten, (x, b)), "bare": _bare_passes(x)}

    return build


def _case_cross_entropy():
    torch = _torch()
    import torch.nn.functional as F

    from mtp.ops import vocab_parallel_cross_entropy

    logits = torch.randn(64, 1024, requires_grad=True)
    target = torch.randint(0, 1024, (64,))
    return {
        "mtp": _passes(vocab_parallel_cross_entropy, (logits, target)),
        "aten": _passes(lambda x, t: F.cross_entropy(x, t, reduction="none"), (logits, target)),
        "bare": _bare_passes(logits),
    }


def _routing(tokens: int, experts: int, topk: int):
    torch = _torch()
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, experts, generator=gen)
    idx = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.where(routing_map, scores, torch.zeros(()))
    return routing_map, probs


def _case_permute():
    torch = _torch()
    from mtp.ops import permute
    from mtp.ops.moe_permute.reference import permute_reference

    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    routing_map, probs = _routing(64, 8, 2)
    return {
        "mtp": _passes(lambda x: permute(x, routing_map, probs, 128)[0], (x,)),
        "aten": _passes(lambda x: permute_reference(x, routing_map, probs, 128)[0], (x,)),
        "bare": _bare_passes(x),
    }


def _case_unpermute(token_map: bool):
    def build():
        torch = _torch()
        from mtp.ops import permute, unpermute
        from mtp.ops.moe_permute.reference import unpermute_reference

        routing_map, probs = _routing(64, 8, 2)
        with torch.no_grad():
            out = permute(torch.zeros(64, 256, dtype=torch.bfloat16), routing_map, None, 128,
                          return_token_map=True)
        rid, tm = out[2], (out[3] if token_map else None)
        y = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
        return {
            "mtp": _passes(lambda y: unpermute(y, rid, (64, 256), probs, routing_map,
                                               token_map=tm), (y,)),
            "aten": _passes(lambda y: unpermute_reference(y, rid, (64, 256), probs, routing_map),
                            (y,)),
            "bare": _bare_passes(y),
        }

    return build


def _counts(tokens: int, experts: int):
    torch = _torch()
    counts = torch.full((experts,), tokens // experts, dtype=torch.int64)
    counts[0] += tokens - int(counts.sum())
    return counts


def _case_grouped_gemm():
    # Small operands: the aten column computes on the CPU for real, and so does autograd's
    # accumulation of the gradients into x.grad and w.grad (the host path does not depend on
    # the sizes).
    torch = _torch()
    from mtp.ops import grouped_gemm

    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 32, 32, dtype=torch.bfloat16, requires_grad=True)
    counts = _counts(64, 8)
    offs = counts.cumsum(0).to(torch.int32)
    mm = getattr(torch.nn.functional, "grouped_mm", None)
    aten = None
    if mm is not None:
        try:
            mm(x.detach(), w.detach(), offs=offs)
            aten = _passes(lambda x, w: mm(x, w, offs=offs), (x, w))
        except (RuntimeError, TypeError, NotImplementedError):
            aten = None
    return {
        "mtp": _passes(lambda x, w: grouped_gemm(x, w, counts), (x, w)),
        "aten": aten,
        "bare": _bare_passes(x),
    }


def _case_grouped_gemm_fp8():
    torch = _torch()
    from mtp.ops import grouped_gemm

    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)  # small: see grouped_gemm
    w = torch.randn(8, 256, 128, dtype=torch.bfloat16, requires_grad=True)
    counts = _counts(64, 8)
    return {
        "mtp": _passes(lambda x, w: grouped_gemm(x, w, counts, fp8_recipe="blockwise"), (x, w)),
        "aten": None,
        "bare": _bare_passes(x),
    }


def _case_quantize():
    torch = _torch()
    from mtp.ops import quantize

    x = torch.randn(64, 512, dtype=torch.bfloat16)
    return {"mtp": {"fwd": lambda: quantize(x)},
            "aten": {"fwd": lambda: quantize(x, backend="reference")},
            "bare": _bare_passes(x)}  # fmt: skip


def _case_grouped_mlp():
    torch = _torch()
    from mtp.ops import grouped_mlp

    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)  # small: see grouped_gemm
    w1 = torch.randn(8, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(8, 32, 32, dtype=torch.bfloat16, requires_grad=True)
    counts = _counts(64, 8)
    probs = torch.rand(64, dtype=torch.float32)
    return {
        "mtp": _passes(lambda x, a, b: grouped_mlp(x, a, b, counts, probs), (x, w1, w2)),
        "aten": None,
        "bare": _bare_passes(x),
    }


def _case_moe_layer():
    torch = _torch()
    from mtp.moe import MoELayer

    torch.manual_seed(0)
    # Small widths: the router's and the backward's aten GEMMs run on the CPU for real.
    layer = MoELayer(32, 64, 8, 2, activation="swiglu", backend="triton",
                     params_dtype=torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)

    def call(x):
        out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    return {"mtp": _passes(call, (x,)), "aten": None, "bare": _bare_passes(x)}


def _case_linear_cross_entropy():
    torch = _torch()
    import torch.nn.functional as F

    from mtp.ops import linear_cross_entropy

    h = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 32, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 256, (16,))
    return {
        "mtp": _passes(lambda h, w: linear_cross_entropy(h, w, t), (h, w)),
        "aten": _passes(lambda h, w: F.cross_entropy((h @ w.t()).float(), t), (h, w)),
        "bare": _bare_passes(h),
    }


CASES: dict[str, Callable[[], dict]] = {
    "bias_gelu": _case_bias_act(False),
    "bias_swiglu": _case_bias_act(True),
    "cross_entropy": _case_cross_entropy,
    "permute": _case_permute,
    "unpermute": _case_unpermute(token_map=True),
    "unpermute_no_map": _case_unpermute(token_map=False),
    "grouped_gemm": _case_grouped_gemm,
    "grouped_gemm_fp8": _case_grouped_gemm_fp8,
    "quantize": _case_quantize,
    "grouped_mlp": _case_grouped_mlp,
    "moe_layer": _case_moe_layer,
    "linear_cross_entropy": _case_linear_cross_entropy,
}


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def count_calls(fn: Callable[[], object]) -> int:
    """Python function calls (``call`` and ``c_call`` profile events) made by one ``fn()``."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" or event == "c_call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls - 1  # the setprofile(None) call itself


def measure(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median thread-CPU microseconds of each of ``fns``, called in turn ``repeat`` times."""
    clock = time.thread_time_ns
    samples: dict[str, list[int]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(5):
            fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {name: statistics.median(s) / 1e3 for name, s in samples.items()}


def run_case(name: str, repeat: int) -> list[dict]:
    """The rows of one case: a row per pass with µs, floors, ratios, launches and calls."""
    from mtp.testing import null_gpu

    torch = _torch()
    case = CASES[name]()
    rows = []
    for pas in ("fwd", "fwd+bwd"):
        if pas not in case["mtp"]:  # an op without a gradient
            continue
        fns = {"mtp": case["mtp"][pas], "bare": case["bare"][pas]}
        if case["aten"] is not None:
            fns["aten"] = case["aten"][pas]
        before = null_gpu.launches()
        fns["mtp"]()
        launches = null_gpu.launches() - before
        calls = count_calls(fns["mtp"])
        times = measure(fns, repeat)
        row = {"case": name, "pass": pas, "mtp_us": times["mtp"], "bare_us": times["bare"],
               "aten_us": times.get("aten"), "ratio_bare": times["mtp"] / times["bare"],
               "launches": launches, "python_calls": calls}
        if pas == "fwd+bwd":
            torch.autograd.set_multithreading_enabled(False)
            try:
                row["mtp_1thread_us"] = measure({"mtp": fns["mtp"]}, repeat)["mtp"]
            finally:
                torch.autograd.set_multithreading_enabled(True)
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    head = (f"{'call':22s} {'pass':8s} {'mtp us':>8s} {'bare us':>8s} {'ratio':>6s} "
            f"{'aten us':>8s} {'1-thread':>9s} {'launches':>8s} {'py calls':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        aten = "-" if r["aten_us"] is None else f"{r['aten_us']:.1f}"
        one = f"{r['mtp_1thread_us']:.1f}" if "mtp_1thread_us" in r else ""
        lines.append(
            f"{r['case']:22s} {r['pass']:8s} {r['mtp_us']:8.1f} {r['bare_us']:8.1f} "
            f"{r['ratio_bare']:6.2f} {aten:>8s} {one:>9s} {r['launches']:8d} {r['python_calls']:8d}"
        )
    return "\n".join(lines)


def _worker(names: list[str], repeat: int, out: str | None) -> int:
    import torch

    from mtp.testing import null_gpu

    torch.set_num_threads(1)
    null_gpu.install()
    rows = []
    for name in names:
        print(f"[host] {name} ...", flush=True)
        rows.extend(run_case(name, repeat))
    print(_table(rows), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows, "versions": _versions()}, f, indent=1)
    return 0


def _versions() -> dict:
    import torch
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtp-bench --host", description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help="case name prefixes (default: all)")
    parser.add_argument("--repeat", type=int, default=300, help="calls per measurement")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    names = [n for n in CASES if not args.cases or any(n.startswith(p) for p in args.cases)]
    if not names:
        parser.error(f"no case matches {args.cases}; cases: {', '.join(CASES)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        module = __spec__.name if __spec__ else "bench.host"  # bench.host or mtp.bench.host
        cmd = [sys.executable, "-m", module, *names, "--repeat", str(args.repeat)]
        if args.json:
            cmd += ["--json", args.json]
        return subprocess.call(cmd, env=env)
    return _worker(names, args.repeat, args.json)


if __name__ == "__main__":
    sys.exit(main())
