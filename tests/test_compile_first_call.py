"""``torch.compile(fullgraph=True)`` of an op as the first mtp call of a fresh process.

The settings are read while the op is traced there (backend choice, validation mode, poisoned
outputs): that read may take no lock and read no environment variable, or Dynamo stops with
"Unsupported context manager". Each case runs in its own ``python -c`` process, compiled first
(``aot_eager``: forward and backward traced), then checked against the eager call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: op -> code that defines ``f`` and its inputs ``args`` (floating ones get gradients)
CASES = {
    "vocab_parallel_cross_entropy": """
        f = lambda x, t: ops.vocab_parallel_cross_entropy(x, t, reduction="mean")
        args = (torch.randn(6, 16), torch.randint(0, 16, (6,)))
    """,
    "linear_cross_entropy": """
        f = lambda h, w, t: ops.linear_cross_entropy(h, w, t)
        args = (torch.randn(6, 8), torch.randn(16, 8), torch.randint(0, 16, (6,)))
    """,
    "linear_cross_entropy_chunks": """
        # the Triton kernels (interpreter) over two chunks; the recomputing backward
        f = lambda h, w, t: (ops.linear_cross_entropy(h, w, t, chunk_size=4, backend="triton")
                             + ops.linear_cross_entropy(h, w, t, reduction="none",
                                                        chunk_size=4).sum())
        args = (torch.randn(6, 8), torch.randn(16, 8), torch.randint(0, 16, (6,)))
    """,
    "bias_gelu": """
        f = lambda x, b: ops.bias_gelu(x, b)
        args = (torch.randn(4, 8), torch.randn(8))
    """,
    "bias_swiglu": """
        f = lambda x, b: ops.bias_swiglu(x, b)
        args = (torch.randn(4, 8), torch.randn(8))
    """,
    "permute_unpermute": """
        routing = torch.zeros(6, 4, dtype=torch.bool)
        routing[torch.arange(6), torch.arange(6) % 4] = True
        probs = routing.float() * 0.5
        def f(x):
            y, _, rid = ops.permute(x, routing, probs, 6)
            return ops.unpermute(y * 2, rid, x.shape, probs, routing)
        args = (torch.randn(6, 8),)
    """,
    "grouped_gemm": """
        f = lambda x, w: ops.grouped_gemm(x, w, torch.tensor([3, 0, 4]), trans_b=True)
        args = (torch.randn(7, 8), torch.randn(3, 5, 8))
    """,
    "grouped_mlp": """
        # the reference backend's backward calls torch.autograd.grad, which Dynamo refuses
        f = lambda x, w1, w2: ops.grouped_mlp(x, w1, w2, torch.tensor([3, 4]), backend="triton")
        args = (torch.randn(7, 8), torch.randn(2, 8, 12), torch.randn(2, 6, 8))
    """,
}

_HARNESS = """
import torch
from mtp import ops
{case}
def run(fn):
    xs = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*xs)
    out.float().square().sum().backward()
    return [out.detach()] + [x.grad for x in xs if x.is_floating_point()]
compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager"))  # the first mtp call
for got, want in zip(compiled, run(f)):
    torch.testing.assert_close(got, want)
print("compiled first: ok")
"""


@pytest.mark.parametrize("op", sorted(CASES))
def test_compile_fullgraph_as_the_first_call(op):
    code = _HARNESS.format(case=textwrap.dedent(CASES[op]))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "compiled first: ok" in proc.stdout, proc.stderr[-3000:]
