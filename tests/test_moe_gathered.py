"""``MoELayer`` with the dispatch fused into the experts' fc1 (:mod:`mtp.moe.gathered`: one
expert-parallel rank, fused Triton experts): the float64 oracle of the whole layer (every
gradient; dropless and capacity; every router variant; top-1 to top-8; E up to 256), bit-equal
to the materialised dispatch and across runs, the device ops and host syncs of a step, the
bytes autograd saves, graph safety and ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest
import torch

from mtp import settings
from mtp.bench.counting import count_ops
from mtp.moe import MoELayer
from mtp.moe.gathered import gathers
from mtp.testing import assert_graph_safe, saved_activation_bytes
from test_moe_layer import check_layer_against_oracle


def _layer(H=16, F=8, E=6, k=2, **kw):
    kw.setdefault("backend", "triton")
    kw.setdefault("activation", "swiglu")
    return MoELayer(H, F, E, k, **kw)


ROUTERS = [
    dict(),
    dict(bias=True, aux_loss_coeff=0.1, z_loss_coeff=0.01),
    dict(score_function="sigmoid", expert_bias=True, aux_loss_coeff=0.05),
    dict(pre_softmax=True, activation="gelu"),
]


@pytest.mark.parametrize("cfg", ROUTERS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
                         or "default")  # fmt: skip
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_fused_layer_matches_float64_oracle(cfg, capacity_factor):
    torch.manual_seed(21)
    layer = _layer(capacity_factor=capacity_factor, **cfg)
    x = torch.randn(12, 16)
    assert gathers(layer, x)
    check_layer_against_oracle(layer, x, capacity_factor=capacity_factor)


@pytest.mark.parametrize("E,k", [(4, 1), (8, 8), (64, 8), pytest.param(256, 8, marks=pytest.mark.slow)])
def test_fused_layer_topk_and_many_experts(E, k):
    torch.manual_seed(E + k)
    layer = _layer(H=8, F=4, E=E, k=k)
    check_layer_against_oracle(layer, torch.randn(10, 8))


def test_empty_experts():
    torch.manual_seed(5)
    layer = _layer(E=8)
    with torch.no_grad():  # experts 0 and 5 lose every decision
        layer.router.weight[[0, 5]] = -30 * layer.router.weight[[0, 5]].sign().abs()
    x = torch.randn(12, 16)
    with torch.no_grad():
        x[:, :] = x.abs() + 0.1
    check_layer_against_oracle(layer, x)


def _grads(layer, x, dy):
    x = x.detach().requires_grad_(True)
    out = layer(x)
    return (out, *torch.autograd.grad(out, [x, *layer.parameters()], dy))


VARIANTS = [  # the router variants the oracle does not model, against the plain dispatch
    dict(num_groups=3, group_topk=2, scaling_factor=2.0, score_function="sigmoid",
         expert_bias=True),
    dict(num_groups=2, group_topk=1, pre_softmax=True, capacity_factor=1.0,
         drop_policy="position"),
]


@pytest.mark.parametrize("dtype,cfg", [(torch.float32, {}), (torch.bfloat16, {}),
                                       (torch.float16, {}), *((torch.float32, v) for v in VARIANTS)])
def test_fused_equals_materialised_dispatch_bitwise(dtype, cfg, monkeypatch):
    """The fused layer is the plain dispatch's layer without the permuted copy: the same bits,
    forward and backward (except where noted)."""
    torch.manual_seed(3)
    layer = _layer(params_dtype=dtype, bias=True, **cfg)
    x, dy = torch.randn(16, 16, dtype=dtype), torch.randn(16, 16, dtype=dtype)
    assert gathers(layer, x)
    fused = _grads(layer, x, dy)
    monkeypatch.setattr("mtp.moe.moe_layer.gathers", lambda *a: False)
    plain = _grads(layer, x, dy)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    assert torch.equal(fused[0], plain[0])
    for name, a, b in zip(names, fused[1:], plain[1:]):
        # x: a per-token sum in another order; the router's gradients: the [T, E] probability
        # gradient rounded in a kernel, which the interpreter truncates to bf16 (a GPU and
        # torch round to nearest even)
        if name == "x" or (name.startswith("router.") and dtype is torch.bfloat16):
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < (1e-6 if dtype is torch.float32 else 1e-2), (name, rel)
        else:
            assert torch.equal(a, b), name


def test_fused_layer_deterministic():
    """Two runs (the experts' rows in another order of arrival: a permuted token batch) give
    the same bits: fixed-order sums, no atomics."""
    torch.manual_seed(4)
    layer = _layer(E=8)
    x, dy = torch.randn(32, 16), torch.randn(32, 16)
    first, second = _grads(layer, x, dy), _grads(layer, x, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    perm = torch.randperm(32)
    shuffled = _grads(layer, x[perm], dy[perm])
    assert torch.equal(shuffled[0], first[0][perm])
    assert torch.equal(shuffled[1], first[1][perm])


def _step_counts(layer, x, dy):
    with count_ops() as fwd:
        layer(x)
    x = x.detach().requires_grad_(True)
    with count_ops() as step:
        out = layer(x)
        torch.autograd.grad(out, [x, *layer.parameters()], dy)
    return fwd, step


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_device_ops_and_host_syncs(capacity_factor):
    """E=8 top-2 T=64 SwiGLU, no bias: router GEMM + router, row map, fc1, fc2, combine forward
    (dropless: 6 device ops, at most 10; the step at most 24); no host sync."""
    with settings.override(poison_outputs=False):  # the NaN fill of outputs is a test extra
        torch.manual_seed(0)
        layer = _layer(H=32, F=16, E=8, k=2, router_dtype=torch.float32,
                       capacity_factor=capacity_factor)  # fmt: skip
        x, dy = torch.randn(64, 32, requires_grad=True), torch.randn(64, 32)
        _step_counts(layer, x, dy)  # plans, workspace
        fwd, step = _step_counts(layer, x, dy)
    if capacity_factor is None:  # (a capacity adds the router's drop: aten ops)
        assert fwd.device_ops <= 10 and step.device_ops <= 24, (fwd.summary(), step.summary())
    assert dict(fwd.triton) == {"_router_fwd_kernel": 1, "_place_kernel": 1,
                                "grouped_gemm_act_kernel": 1, "grouped_gemm_kernel": 1,
                                "_combine_tokens_kernel": 1}, fwd.summary()  # fmt: skip
    assert fwd.host_syncs == step.host_syncs == []
    assert "_scatter_tokens_kernel" not in step.triton  # no permuted copy of the tokens


def test_saved_activation_bytes_near_x_and_h():
    """Autograd keeps the input X, fc1's pre-activation H and the routing metadata: at most
    1.10 x (X + H + 12 bytes per routed row)."""
    torch.manual_seed(1)
    T, H, F, E, k = 64, 32, 64, 8, 2
    layer = _layer(H=H, F=F, E=E, k=k, params_dtype=torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_activation_bytes(layer, x, skip=list(layer.parameters()))
    floor = T * H * 2 + T * k * 2 * F * 2 + 12 * T * k
    assert saved <= 1.10 * floor, (saved, floor, saved / floor)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_fused_layer_graph_safe(capacity_factor):
    torch.manual_seed(15)
    layer = _layer(H=8, F=8, E=4, capacity_factor=capacity_factor, aux_loss_coeff=0.01)
    x = torch.randn(2, 6, 8)
    out = assert_graph_safe(layer, x)
    assert out.data_ptr() == layer.workspace.output.data_ptr()


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_fused_layer_compiles_fullgraph(capacity_factor):
    torch.manual_seed(2)
    layer = _layer(H=8, F=8, E=4, capacity_factor=capacity_factor)
    x, dy = torch.randn(10, 8), torch.randn(10, 8)
    eager = _grads(layer, x, dy)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = _grads(compiled, x, dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


def test_memory_bound_part_at_its_byte_floor():
    """Router, row map and combine (the gather is inside fc1) move at most 1.10 x the bytes
    they must: the router reads the logits and writes probabilities and the map; the row map
    reads the map and writes each row's token, the token-major map and the counts; the combine
    reads each routed row and the token map and writes each token once."""
    from mtp.testing.traffic import count_traffic

    T, H, F, E, k = 64, 64, 16, 8, 2
    M, s = T * k, 2
    with settings.override(poison_outputs=False):
        torch.manual_seed(0)
        layer = _layer(H=H, F=F, E=E, k=k, params_dtype=torch.bfloat16)
        x = torch.randn(T, H, dtype=torch.bfloat16)
        layer(x)
        with count_traffic() as t:
            layer(x)
    floors = {
        "_router_fwd_kernel": T * E * s + T * E * (s + 1),
        "_place_kernel": T * E + M * 8 + 2 * M * 4 + T * 4 + E * 8,
        "_combine_tokens_kernel": M * H * s + M * 4 + T * 4 + T * H * s,
    }
    by = t.by_kernel()
    moved = sum(by[name]["read"] + by[name]["write"] for name in floors)
    assert moved <= 1.10 * sum(floors.values()), (by, floors)
    assert "_scatter_tokens_kernel" not in by and "_gather_rows_kernel" not in by


def test_padding_mask_equals_materialised_dispatch(monkeypatch):
    """With a padding mask (the router's statistics skip the padded tokens): the same bits as
    the plain dispatch."""
    torch.manual_seed(8)
    layer = _layer(E=8)
    x, dy = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 7] = True

    def run():
        xg = x.clone().requires_grad_(True)
        out = layer(xg, padding_mask=mask)
        return (out, *torch.autograd.grad(out, [xg, *layer.parameters()], dy))

    fused = run()
    monkeypatch.setattr("mtp.moe.moe_layer.gathers", lambda *a: False)
    plain = run()
    assert torch.equal(fused[0], plain[0])
    for a, b in zip(fused[2:], plain[2:]):
        assert torch.equal(a, b)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-6, atol=1e-6)
