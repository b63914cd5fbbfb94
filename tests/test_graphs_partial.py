"""Partial capture of MoE blocks on CPU (stand-in graphs): each scope stops at its boundary
(early exit), replays restore the outputs through the tensor store and the rest runs eagerly;
new routings at every replay give the eager result; every captured scope is graph-safe."""

import copy
import types

import pytest
import torch
from torch import nn

from mtp.graphs import (
    PartialCaptureSignal,
    PartialMoEBlock,
    capture_blocks,
    capturing_scope,
)
from mtp.moe import MoELayer
from mtp.pipeline import get_pipeline_order
from mtp.testing import GraphSafetyError, assert_graph_safe

H = 8


class Attn(nn.Module):
    """A stand-in for attention with its residual: x + W2 tanh(W1 x) mixed over tokens."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(H, H)
        self.o = nn.Linear(H, H)

    def forward(self, x):
        mix = torch.softmax(self.q(x) @ x.transpose(-1, -2) / H**0.5, dim=-1) @ x
        return x + self.o(mix)


def make_block(scope, seed, capacity_factor=None):
    torch.manual_seed(seed)
    moe = MoELayer(H, 12, num_experts=4, topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                   capacity_factor=capacity_factor)
    return PartialMoEBlock(Attn(), moe, scope)


@pytest.mark.parametrize("scope,cf", [("attn", None), ("moe_router", None), ("full", None),
                                      ("full", 1.5)])
def test_partial_capture_replay_equals_eager(scope, cf):
    blocks = [make_block(scope, 0, cf), make_block(scope, 1, cf)]
    eager = copy.deepcopy(blocks)
    m = 3
    order = get_pipeline_order(2, 0, m)  # [1, 1, -1, 1, -1, -1]: two microbatches in flight
    sample = torch.zeros(2, 5, H, requires_grad=True)
    graphs, plan, _ = capture_blocks(blocks, sample, order=order)
    assert plan.num_slots == 2
    gen = torch.Generator().manual_seed(11)
    maps = []
    for it in range(2):  # two steps of m microbatches each, fresh data (new routings)
        xs = [torch.randn(2, 5, H, generator=gen) for _ in range(m)]
        gs = [torch.randn(2, 5, H, generator=gen) for _ in range(m)]
        for b in blocks:
            b.graphed.reset()
        outs, ref_outs, pending = {}, {}, {}
        fwd = bwd = 0
        for c in order:
            if c > 0:
                x = xs[fwd].clone().requires_grad_(True)
                xr = xs[fwd].clone().requires_grad_(True)
                y, yr = x, xr
                for b, e in zip(blocks, eager):
                    y, yr = b(y), e(yr)
                maps.append(eager[0].moe.router(eager[0].attn(xs[fwd]).reshape(-1, H))[1])
                torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
                pending[fwd] = (x, y, xr, yr)
                fwd += 1
            else:
                x, y, xr, yr = pending.pop(bwd)
                y.backward(gs[bwd])
                yr.backward(gs[bwd])
                torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
                bwd += 1
    for b, e in zip(blocks, eager):
        for (name, p), q in zip(b.named_parameters(), e.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert any(not torch.equal(maps[0], mp) for mp in maps[1:])  # routings did change
    steps = [g for row in graphs for g in row]
    assert all(g.fwd_graph.replays == 2 and g.bwd_graph.replays == 2 for g in steps)
    assert blocks[0].tensor_store.is_empty()


@pytest.mark.parametrize("scope", ["attn", "moe_router", "full"])
def test_captured_scopes_are_graph_safe(scope):
    block = make_block(scope, 3, capacity_factor=None)
    graphs, _, _ = capture_blocks([block], torch.zeros(6, H), num_warmup_iters=0)
    step = graphs[0][0]
    n_out = {"attn": 1, "moe_router": 3, "full": 1}[scope]
    assert len(step.static_outputs) == n_out
    assert_graph_safe(step, torch.randn(6, H))


def test_early_exit_signal_and_store():
    block = make_block("moe_router", 4)
    x = torch.randn(6, H)
    with capturing_scope("attn"), pytest.raises(PartialCaptureSignal) as info:
        block.eager_forward(x)
    assert info.value.scope == "attn" and len(info.value.outputs) == 1
    torch.testing.assert_close(info.value.outputs[0], block.attn(x))
    h, probs, routing_map = block.captured_part(x)
    assert routing_map.dtype == torch.bool and probs.shape == (6, 4)
    # with the router's results in the store, the router is skipped: a constant routing
    block.tensor_store.set(hidden=h, probs=probs.detach(), routing_map=routing_map)
    out_a = block.eager_forward(torch.randn(6, H))
    out_b = block.eager_forward(torch.randn(6, H))
    torch.testing.assert_close(out_a, out_b)
    block.tensor_store.clear()


def test_scope_errors_and_unsafe_capture():
    with pytest.raises(ValueError, match="scope must be one of"):
        make_block("moe_preprocess", 0)
    with pytest.raises(ValueError, match="graph-safe only"):
        PartialMoEBlock(None, types.SimpleNamespace(ep_size=2, capacity_factor=None), "full")
    with pytest.raises(TypeError, match="PartialMoEBlock"):
        capture_blocks([nn.Linear(H, H)], torch.zeros(2, H))

    class Syncing(nn.Module):  # a host read inside the captured part
        def forward(self, x):
            return x * float(x.abs().max().item())

    block = PartialMoEBlock(Syncing(), make_block("attn", 0).moe, "attn")
    graphs, _, _ = capture_blocks([block], torch.zeros(4, H), num_warmup_iters=0)
    with pytest.raises(GraphSafetyError):
        assert_graph_safe(graphs[0][0], torch.randn(4, H))
