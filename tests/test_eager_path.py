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


# --- grouped_gemm / grouped_mlp --------------------------------------------------------------

from torch.overrides import TorchFunctionMode  # noqa: E402

from mtp.ops import grouped_gemm, grouped_mlp  # noqa: E402
from mtp.ops.grouped_gemm.config import override  # noqa: E402

GG_SIZES = [5, 0, 9, 3]  # ragged, an empty expert; 3 rows past the routed ones
GG_OPS = ("grouped_gemm_out", "grouped_gemm_wgrad", "grouped_gemm_dact")


class _CustomOps(TorchFunctionMode):
    """A no-op torch-function mode: eager() is off under it, so the ops take the custom ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _gg_inputs(dtype, trans_b=False, bias=False, act=None, probs=False):
    g = torch.Generator().manual_seed(3)
    E, K, N = len(GG_SIZES), 24, 16 if act is None else 32
    M = sum(GG_SIZES) + 3
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn((E, N, K) if trans_b else (E, K, N), generator=g).to(dtype)
    extra = {}
    if bias:
        extra["bias"] = torch.randn(E, N, generator=g).to(dtype)
    if probs:
        extra["probs"] = torch.rand(M, generator=g)
    return x, w, extra


def _gg_run(x, w, extra, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, *extra.values())]
    named = dict(zip(extra, leaves[2:]))
    out = grouped_gemm(leaves[0], leaves[1], torch.tensor(GG_SIZES), backend="triton",
                       **named, **kw)  # fmt: skip
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


GG_CASES = {
    "plain": dict(),
    "trans_b": dict(trans_b=True),
    "bias_gelu_probs": dict(bias=True, act="gelu", probs=True),
    "swiglu": dict(act="swiglu"),
}


@pytest.mark.parametrize("case", list(GG_CASES))
@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "pointer"), (torch.bfloat16, "tma")])
def test_grouped_gemm_eager_equals_custom_op(case, dtype, kernel):
    """Forward and every gradient bit-identical on both paths, pointer and TMA kernels (the
    eager path shares one routing buffer between the forward and the backward GEMMs)."""
    spec = GG_CASES[case]
    x, w, extra = _gg_inputs(dtype, **spec)
    kw = dict(trans_b=spec.get("trans_b", False), activation=spec.get("act"))
    with override(kernel=kernel):
        y_eager, g_eager = _gg_run(x, w, extra, **kw)
        with _CustomOps():
            y_op, g_op = _gg_run(x, w, extra, **kw)
        with torch.no_grad():
            y_nograd = grouped_gemm(x, w, torch.tensor(GG_SIZES), backend="triton",
                                    **extra, **kw)  # fmt: skip
    assert torch.equal(y_eager, y_op) and torch.equal(y_nograd, y_op)
    for a, b in zip(g_eager, g_op):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "pointer"), (torch.bfloat16, "tma")])
def test_grouped_mlp_eager_equals_custom_op(dtype, kernel):
    g = torch.Generator().manual_seed(5)
    E, H, F = len(GG_SIZES), 16, 16
    M = sum(GG_SIZES) + 3
    inputs = [torch.randn(M, H, generator=g), torch.randn(E, H, 2 * F, generator=g),
              torch.randn(E, F, H, generator=g), torch.rand(M, generator=g),
              torch.randn(E, 2 * F, generator=g), torch.randn(E, H, generator=g)]
    inputs = [t.to(dtype) for t in inputs]

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        x, w1, w2, p, b1, b2 = leaves
        out = grouped_mlp(x, w1, w2, torch.tensor(GG_SIZES), p, b1, b2, backend="triton")
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in leaves]

    with override(kernel=kernel):
        y_eager, g_eager = run()
        with _CustomOps():
            y_op, g_op = run()
    assert torch.equal(y_eager, y_op)
    for a, b in zip(g_eager, g_op):
        assert torch.equal(a, b)


def test_grouped_eager_path_calls_no_custom_op(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the eager path called a custom op")

    for name in GG_OPS:
        monkeypatch.setattr(torch.ops.mtp, name, refuse)
    x, w, extra = _gg_inputs(torch.float32, bias=True, act="swiglu", probs=True)
    _gg_run(x, w, extra, activation="swiglu")
    E, M = len(GG_SIZES), x.shape[0]
    leaves = [t.requires_grad_() for t in (torch.randn(M, 8), torch.randn(E, 8, 16),
                                           torch.randn(E, 8, 8))]  # fmt: skip
    grouped_mlp(*leaves, torch.tensor(GG_SIZES), torch.rand(M), backend="triton").sum().backward()
    with pytest.raises(AssertionError, match="custom op"), _CustomOps():
        _gg_run(x, w, extra, activation="swiglu")


def test_grouped_gemm_eager_checks_counts_on_every_call():
    """Checks run once per key, the counts' data check on every call (the routing's status
    word); counts changed in place between calls are seen."""
    x, w, _ = _gg_inputs(torch.float32)
    counts = torch.tensor(GG_SIZES)
    grouped_gemm(x, w, counts, backend="triton")
    counts[1] = 100  # sums past M
    with pytest.raises(RuntimeError, match="tokens_per_expert must be non-negative"):
        grouped_gemm(x, w, counts, backend="triton")
    counts[1] = -1
    with pytest.raises(RuntimeError, match="tokens_per_expert must be non-negative"):
        grouped_mlp(x, torch.randn(4, 24, 8), torch.randn(4, 4, 24), counts, backend="triton")
    with pytest.raises(ValueError, match="tokens_per_expert"):
        grouped_gemm(x, w, counts[:3], backend="triton")
