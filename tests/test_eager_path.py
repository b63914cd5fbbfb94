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

from mtp.ops import (
    _eager,
    bias_gelu,
    bias_swiglu,
    linear_cross_entropy,
    permute,
    unpermute,
    vocab_parallel_cross_entropy,
)


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


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_eager_equals_custom_op(reduction, dtype):
    """Several chunks (the last one short), bias, smoothing, z-loss and an ignored row: the
    gradients computed in the forward (reduced loss) and by the recomputing backward."""
    hidden = torch.randn(13, 16).to(dtype)
    weight = (torch.randn(40, 16) / 4).to(dtype)
    bias = torch.randn(40).to(dtype)
    target = torch.randint(0, 40, (13,))
    target[3] = -100
    fn = lambda h, w, b: linear_cross_entropy(  # noqa: E731
        h, w, target, bias=b, label_smoothing=0.1, z_loss_weight=1e-3, reduction=reduction,
        chunk_size=5, backend="triton")
    assert_paths_equal(fn, (hidden, weight, bias), grad_of=(0, 1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_second_backward_is_refused_on_both_paths(dtype):
    """A reduced loss's backward scales the gradients its forward saved (in place in fp32): a
    second backward through the same graph fails autograd's version check, in every dtype."""
    for ctx in (contextlib.nullcontext, custom_op_path):
        with ctx():
            h = torch.randn(4, 16).to(dtype).requires_grad_()
            w = torch.randn(10, 16).to(dtype).requires_grad_()
            loss = linear_cross_entropy(h, w, torch.randint(0, 10, (4,)), backend="triton")
            loss.backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()


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
    assert not _eager.eager(x, torch.empty(2, device="meta"))


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


# --- quantize and the FP8 grouped GEMM -------------------------------------------------------

from mtp.ops import quantize  # noqa: E402

FP8_OPS = ("quantize_fp8", "grouped_gemm_fp8_out", "grouped_gemm_fp8_wgrad")


@pytest.mark.parametrize("recipe,layout", [("blockwise", "rowwise"), ("blockwise", "block"),
                                           ("mxfp8", "colwise")])  # fmt: skip
def test_quantize_eager_equals_custom_op(recipe, layout):
    x = torch.randn(37, 72).to(torch.bfloat16)
    counts = torch.tensor([20, 0, 17]) if layout == "colwise" else None
    eager_q = quantize(x, recipe, layout, tokens_per_expert=counts, backend="triton")
    with _CustomOps():
        op_q = quantize(x, recipe, layout, tokens_per_expert=counts, backend="triton")
    rows = 64 if counts is not None else x.shape[0]  # the padded blocks the experts use
    assert torch.equal(eager_q.data[:rows].view(torch.uint8), op_q.data[:rows].view(torch.uint8))
    assert torch.equal(eager_q.scales.float()[: rows // eager_q.block[0] or None],
                       op_q.scales.float()[: rows // op_q.block[0] or None])  # fmt: skip


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_fp8_eager_equals_custom_op(recipe, trans_b, monkeypatch):
    x, w, _ = _gg_inputs(torch.bfloat16, trans_b=trans_b)
    y_eager, g_eager = _gg_run(x, w, {}, trans_b=trans_b, fp8_recipe=recipe)
    with _CustomOps():
        y_op, g_op = _gg_run(x, w, {}, trans_b=trans_b, fp8_recipe=recipe)
    with torch.no_grad():
        y_nograd = grouped_gemm(x, w, torch.tensor(GG_SIZES), backend="triton", trans_b=trans_b,
                                fp8_recipe=recipe)  # fmt: skip
    assert torch.equal(y_eager, y_op) and torch.equal(y_nograd, y_op)
    for a, b in zip(g_eager, g_op):
        assert torch.equal(a, b)
    for name in FP8_OPS:  # and the eager path runs the bodies, never a custom op
        monkeypatch.setattr(torch.ops.mtp, name, lambda *a, **k: pytest.fail("a custom op"))
    _gg_run(x, w, {}, trans_b=trans_b, fp8_recipe=recipe)
# --- permute / unpermute ---------------------------------------------------------------------


def _topk(tokens, experts, k, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    idx = scores.topk(k, dim=1).indices
    rm = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    return rm, idx, scores * rm


PERMUTE = {
    "map": dict(num_out_tokens=46),
    "map_no_probs": dict(num_out_tokens=46, probs=False),
    "indices": dict(indices=True),
    "drop_and_pad": dict(drop_and_pad=True, capacity=6),
    "unchecked": dict(num_out_tokens=46, validate=False),
}


def _permute_run(kw, x, rm, idx, p):
    kw = dict(kw)
    probs = None if kw.pop("probs", True) is False else p.detach().clone().requires_grad_()
    if kw.pop("indices", False):
        kw.update(indices=idx, num_experts=rm.shape[1])
    else:
        kw.update(routing_map=rm)
    tokens = x.detach().clone().requires_grad_()
    out = permute(tokens, probs=probs, backend="triton", return_token_map=True, **kw)
    g = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(3)).to(x.dtype)
    loss = (out[0] * g).sum() + (0 if out[1] is None else (out[1] * out[1]).sum())
    loss.backward()
    tm = out[3]
    grads = [tokens.grad] + ([] if probs is None else [probs.grad])
    return [t.detach() for t in out[:3] if t is not None] + [tm.rows, tm.experts, tm.count] + grads


@pytest.mark.parametrize("case", sorted(PERMUTE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_eager_equals_custom_op(case, dtype):
    rm, idx, p = _topk(23, 5, 2, seed=4)
    x = torch.randn(23, 12).to(dtype)
    eager_out = _permute_run(PERMUTE[case], x, rm, idx, p)
    with _CustomOps():
        op_out = _permute_run(PERMUTE[case], x, rm, idx, p)
    assert len(eager_out) == len(op_out)
    for a, b in zip(eager_out, op_out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_map", [True, False], ids=["token_map", "inverted"])
@pytest.mark.parametrize("case", ["probs", "indices", "drop_and_pad", "no_probs"])
def test_unpermute_eager_equals_custom_op(case, with_map):
    rm, idx, p = _topk(19, 6, 2, seed=5)
    drop = case == "drop_and_pad"
    kw = dict(drop_and_pad=True, capacity=5) if drop else dict(num_out_tokens=38)
    _, _, rid, tm = permute(torch.randn(19, 8), rm, backend="triton", return_token_map=True,
                            **kw)  # fmt: skip
    y = torch.randn(rid.shape[0], 8, dtype=torch.bfloat16)
    routing = dict(indices=idx) if case == "indices" else dict(routing_map=rm)

    def run():
        rows = y.clone().requires_grad_()
        probs = None if case == "no_probs" else p.clone().requires_grad_()
        out = unpermute(rows, rid, (19, 8), probs, drop_and_pad=drop, backend="triton",
                        token_map=tm if with_map else None, **routing)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(
            out.dtype))
        return [out.detach(), rows.grad] + ([] if probs is None else [probs.grad])

    eager_out = run()
    with _CustomOps():
        op_out = run()
    for a, b in zip(eager_out, op_out, strict=True):
        assert torch.equal(a, b)
    if not with_map:  # the inverted map gives what the map permute built gives
        with_tm = unpermute(y, rid, (19, 8), None if case == "no_probs" else p,
                            drop_and_pad=drop, backend="triton", token_map=tm, **routing)
        assert torch.equal(eager_out[0], with_tm)


@pytest.mark.parametrize("drop_and_pad", [False, True], ids=["dropless", "drop_and_pad"])
def test_scatter_rows_eager_equals_custom_op_and_the_row_gather(drop_and_pad):
    """The MoE dispatchers' permutation with the token map: eager and custom op bit-identical,
    and equal to the row gather it replaces (forward and the backward's per-token sums)."""
    from mtp.ops.moe_permute import moe_permute_row_map
    from mtp.ops.moe_permute.rows import scatter_rows

    rm, _, _ = _topk(21, 6, 2, seed=7)
    kw = dict(drop_and_pad=True, capacity=5) if drop_and_pad else {}
    row_map = moe_permute_row_map(rm, 30 if drop_and_pad else 42, backend="triton",
                                  token_map=True, **kw)  # fmt: skip
    x = torch.randn(21, 10).to(torch.bfloat16)
    g = torch.randn(row_map.row_id_map.shape[0], 10).to(torch.bfloat16)

    def run(fn):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(g)
        return out.detach(), leaf.grad

    eager_out = run(lambda t: scatter_rows(t, row_map.token_map, row_map.row_id_map))
    with _CustomOps():
        op_out = run(lambda t: scatter_rows(t, row_map.token_map, row_map.row_id_map))
    gathered = run(lambda t: torch.ops.mtp.moe_gather_rows(t, row_map.row_id_map, None))
    for a, b, c in zip(eager_out, op_out, gathered, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
