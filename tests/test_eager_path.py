"""The eager path (public function -> autograd.Function -> launchers, no custom op) against the
custom-op path (``torch.ops.mtp.*``: what torch.compile and tracers see): bit-identical outputs
and gradients under the interpreter, and the custom op taken whenever a mode or subclass is
active. The custom-op path is forced by switching :func:`mtp.ops._eager.eager` off in every
module that uses it."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mtp.ops import _eager, bias_gelu, bias_swiglu, vocab_parallel_cross_entropy


@contextlib.contextmanager
def custom_op_path():
    """Every op through its custom op (as when tracing), for the block."""
    original = _eager.eager
    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("mtp.") and m is not _eager
               and getattr(m, "eager", None) is original]
    for m in patched:
        m.eager = lambda *tensors: False
    try:
        yield
    finally:
        for m in patched:
            m.eager = original


def _run(fn, inputs, grad_of=(0,)):
    """Outputs and the gradients of the inputs at ``grad_of`` (a fixed upstream gradient)."""
    leaves = [t.detach().clone().requires_grad_(i in grad_of) for i, t in enumerate(inputs)]
    out = fn(*leaves)
    first = out[0] if isinstance(out, tuple) else out
    g = torch.randn(first.shape, generator=torch.Generator().manual_seed(1)).to(first.dtype)
    first.backward(g)
    return first.detach(), [leaves[i].grad for i in grad_of]


def assert_paths_equal(fn, inputs, grad_of=(0,)):
    """``fn`` on the eager path and on the custom-op path: bitwise the same, forward (with and
    without grad) and every gradient."""
    y_eager, g_eager = _run(fn, inputs, grad_of)
    with custom_op_path():
        y_op, g_op = _run(fn, inputs, grad_of)
        with torch.no_grad():
            y_op_nograd = fn(*inputs)
    with torch.no_grad():
        y_nograd = fn(*inputs)
    assert torch.equal(y_eager, y_op)
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    assert torch.equal(first(y_nograd), first(y_op_nograd))
    for a, c in zip(g_eager, g_op):
        assert torch.equal(a, c)


BIAS_ACT = {
    "gelu": lambda x, b: bias_gelu(x, b, backend="triton"),
    "gelu_tanh": lambda x, b: bias_gelu(x, b, "tanh", backend="triton"),
    "swiglu": lambda x, b: bias_swiglu(x, b, backend="triton"),
}


@pytest.mark.parametrize("name", BIAS_ACT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_act_eager_equals_custom_op(name, dtype):
    x = torch.randn(37, 64).to(dtype)
    b = torch.randn(64).to(dtype)
    assert_paths_equal(BIAS_ACT[name], (x, b), grad_of=(0, 1))


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_eager_equals_custom_op(reduction, inplace):
    logits = torch.randn(29, 300).to(torch.bfloat16)
    target = torch.randint(0, 300, (29,))
    target[3] = -100
    fn = lambda x, t: vocab_parallel_cross_entropy(  # noqa: E731
        x * 1 if inplace else x, t, reduction=reduction, label_smoothing=0.1,
        inplace_backward=inplace, backend="triton")
    assert_paths_equal(fn, (logits, target))


def test_cross_entropy_second_backward_is_refused_on_both_paths():
    """The backward scales the saved gradient in place; a second backward through the same
    graph must fail autograd's version check on the eager path as on the custom op's."""
    for ctx in (contextlib.nullcontext, custom_op_path):
        with ctx():
            x = torch.randn(4, 16, requires_grad=True)
            loss = vocab_parallel_cross_entropy(x, torch.randint(0, 16, (4,)),
                                                reduction="sum", backend="triton")
            loss.backward(torch.tensor(2.0), retain_graph=True)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward(torch.tensor(2.0))


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
    assert not _eager.eager(x.as_subclass(_Sub))


class _Sub(torch.Tensor):
    pass


def test_checked_keys_forget_past_their_limit():
    keys = _eager.CheckedKeys(limit=3)
    for i in range(3):
        keys.add(i)
    assert 2 in keys
    keys.add(3)
    assert 3 in keys and 0 not in keys
