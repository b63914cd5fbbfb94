"""The eager path (public function -> autograd.Function -> launchers) against the custom-op path
(``torch.ops.mtp.*``, what torch.compile and tracers see): bit-identical outputs and gradients
under the interpreter, and the custom op taken whenever a mode or subclass is active."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mtp.ops import _eager, bias_gelu, bias_swiglu


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


BIAS_ACT = [
    ("gelu", lambda x, b: bias_gelu(x, b, backend="triton"),
     lambda x, b: torch.ops.mtp.bias_gelu(x, b, "none", "triton")),
    ("gelu_tanh", lambda x, b: bias_gelu(x, b, "tanh", backend="triton"),
     lambda x, b: torch.ops.mtp.bias_gelu(x, b, "tanh", "triton")),
    ("swiglu", lambda x, b: bias_swiglu(x, b, backend="triton"),
     lambda x, b: torch.ops.mtp.bias_swiglu(x, b, "triton")),
]


@pytest.mark.parametrize("name,eager_fn,op_fn", BIAS_ACT, ids=[c[0] for c in BIAS_ACT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_act_eager_equals_custom_op(name, eager_fn, op_fn, dtype):
    x = torch.randn(37, 64).to(dtype)
    b = torch.randn(64).to(dtype)
    y_eager, g_eager = _grads(eager_fn, x, b)
    y_op, g_op = _grads(op_fn, x, b)
    assert torch.equal(y_eager, y_op)
    for a, c in zip(g_eager, g_op):
        assert torch.equal(a, c)
    with torch.no_grad():
        assert torch.equal(eager_fn(x, b), y_op)


def test_eager_is_off_under_modes_and_subclasses():
    x = torch.randn(4, 8)
    assert _eager.eager(x, None)
    with torch.device("cpu"):
        assert not _eager.eager(x)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not _eager.eager(fake)
        y = bias_gelu(fake, None, backend="reference")
        assert y.shape == (4, 8)
    assert not _eager.eager(torch.nn.Parameter(x).as_subclass(_Sub))


class _Sub(torch.Tensor):
    pass


def test_checked_keys_forget_past_their_limit():
    keys = _eager.CheckedKeys(limit=3)
    for i in range(3):
        keys.add(i)
    assert 2 in keys
    keys.add(3)
    assert 3 in keys and 0 not in keys
