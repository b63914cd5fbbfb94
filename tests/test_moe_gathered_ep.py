"""``MoELayer`` at expert parallelism 2 (gloo) with fused Triton experts: fc1 reads the received
buffer through its expert-major order and fc2 stores its rows back at their received positions
(:func:`mtp.moe.gathered.gathered_inputs`), no reordered copy either way. Dropless and with a capacity: forward and every gradient bit-equal to the materialised
dispatch (fp32 and bf16, top-1 to top-3, idle experts), the reorder copies gone from the forward,
one host sync (the dropless split sizes; none with a capacity). The float64-close comparison with a single-process layer is
``test_moe_distributed``'s ``dropless-triton`` config (which now takes this path)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtp import settings
from mtp.bench.counting import count_ops
from mtp.testing import run_distributed

H, F = 16, 8
CASES = [  # (dtype, experts, topk, idle experts, capacity factor)
    ("float32", 4, 2, None, None),
    ("bfloat16", 4, 2, None, None),
    ("float32", 4, 1, None, None),
    ("float32", 6, 2, (1,), None),
    ("bfloat16", 6, 3, (4,), None),
    ("float32", 4, 2, None, 1.0),
    ("bfloat16", 6, 2, (1,), 0.5),
]
#: rank 1's experts lose every decision: it receives no row (its experts see an empty buffer)
NOTHING_RECEIVED = [("float32", 4, 1, (2, 3), None), ("float32", 4, 2, (2, 3), 1.0)]


def _layer(dtype, E, k, idle, capacity_factor):
    from mtp.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(H, F, E, k, backend="triton", activation="swiglu", bias=True,
                     params_dtype=dtype, ep_group=dist.group.WORLD,
                     capacity_factor=capacity_factor)  # fmt: skip
    for e in idle or ():  # inputs have feature 0 >= 1: expert ``e`` loses every decision
        with torch.no_grad():
            layer.router.weight[e] = 0
            layer.router.weight[e, 0] = -20
    return layer


def _grads(layer, x, dy):
    x = x.detach().requires_grad_(True)
    out = layer(x)
    return (out, *torch.autograd.grad(out, [x, *layer.parameters()], dy))


def _compare(rank, dtype_name, E, k, idle, capacity_factor):
    import mtp.moe.moe_layer as moe_layer
    from mtp.moe.gathered import gathers_received

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(12 + (0 if capacity_factor else 4 * rank), H, generator=g).to(dtype)
    x[:, 0] = x[:, 0].abs() + 1
    dy = torch.randn(x.shape, generator=g).to(dtype)
    layer = _layer(dtype, E, k, idle, capacity_factor)
    assert gathers_received(layer, x)
    with settings.override(poison_outputs=False):
        _grads(layer, x, dy)  # plans, workspace
        with count_ops() as fwd:
            layer(x)
    fused = _grads(layer, x, dy)
    saved = moe_layer.gathers_received
    moe_layer.gathers_received = lambda *a: False
    try:
        with settings.override(poison_outputs=False):
            with count_ops() as plain_fwd:
                layer(x)
        plain = _grads(layer, x, dy)
    finally:
        moe_layer.gathers_received = saved
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(["out", *names], fused, plain):
        assert torch.equal(a, b), name
    for e in idle or ():
        if e // (E // 2) == rank:
            assert not fused[names.index("experts.weight1") + 1][e % (E // 2)].any()
    return dict(capacity=capacity_factor is not None, fwd=fwd.triton, plain=plain_fwd.triton,
                clones=fwd.aten["aten::clone"], plain_clones=plain_fwd.aten["aten::clone"],
                syncs=len(fwd.host_syncs), plain_syncs=len(plain_fwd.host_syncs),
                ops=fwd.device_ops, plain_ops=plain_fwd.device_ops)


def _worker(rank, world, cases):
    return [_compare(rank, *case) for case in cases]


@pytest.mark.parametrize("cases", [CASES[:3], CASES[3:5], CASES[5:]],
                         ids=["dropless", "dropless-idle-expert", "capacity"])
def test_received_rows_read_through_order_bitwise(cases):
    results = run_distributed(_worker, 2, cases, timeout=600)
    for per_rank in results:
        for got in per_rank:
            if got["capacity"]:  # the reorders' view copies (rows, probs, fc2's rows) are gone
                assert got["syncs"] == got["plain_syncs"] == 0, got
                assert got["clones"] == got["plain_clones"] - 3, got
                assert got["ops"] == got["plain_ops"] - 3, got
                continue
            # row gathers: the permute, the received rows' reorder, the combine's reorder back
            # (fc2's rows to the received order before the return all-to-all): only the first
            # is left (and the probabilities' index_select is gone; the row map's int32 copy
            # of the reorder is new)
            assert got["plain"]["_gather_rows_kernel"] == 3, got
            assert got["fwd"]["_gather_rows_kernel"] == 1, got
            assert got["syncs"] == got["plain_syncs"] == 1, got
            assert got["ops"] == got["plain_ops"] - 2, got


def test_a_rank_that_receives_nothing():
    """Dropless: the empty received buffer is reordered (nothing to copy) and the experts run
    on it unfused; capacity: the padding slots are read through the order as ever. Both bit
    for bit as the materialised dispatch."""
    results = run_distributed(_worker, 2, NOTHING_RECEIVED, timeout=600)
    empty = results[1][0]  # dropless, the rank receiving nothing: the same launches either way
    assert empty["fwd"] == empty["plain"] and empty["ops"] == empty["plain_ops"], empty


def _fp8_worker(rank, world, recipe):
    """FP8 experts at EP = 2 take the reordered copy (their fused MLP has no row scatter): the
    layer runs, and its output and gradients stay within the recipe's error of the same
    layer's high-precision experts."""
    from mtp.moe import MoELayer
    from mtp.moe.gathered import gathers_received

    torch.manual_seed(0)
    layer = MoELayer(H, F, 4, 2, backend="triton", activation="swiglu",
                     ep_group=dist.group.WORLD, fp8_recipe=recipe)  # fmt: skip
    g = torch.Generator().manual_seed(20 + rank)
    x, dy = torch.randn(12, H, generator=g), torch.randn(12, H, generator=g)
    assert not gathers_received(layer, x)
    got = _grads(layer, x, dy)
    layer.set_fp8_recipe(None)
    ref = _grads(layer, x, dy)
    return [float((a - b).norm() / b.norm()) for a, b in zip(got, ref)]


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_fp8_experts_at_ep2_take_the_reordered_copy(recipe):
    for errs in run_distributed(_fp8_worker, 2, recipe, timeout=600):
        assert all(e < 0.15 for e in errs) and errs[0] > 1e-4, errs  # FP8 ran, within its error
