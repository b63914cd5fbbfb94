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
                                      ("full", 1.5), ("moe_preprocess", None),
                                      ("moe_preprocess", 1.5)])
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
                for b, e in zip(blocks, eager):  # the logged losses are this replay's
                    torch.testing.assert_close(b.moe.router.aux_loss, e.moe.router.aux_loss)
                    torch.testing.assert_close(b.moe.router.z_loss, e.moe.router.z_loss)
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


@pytest.mark.parametrize("scope,cf", [("attn", None), ("moe_router", None), ("full", None),
                                      ("moe_preprocess", None), ("moe_preprocess", 1.5)])
def test_captured_scopes_are_graph_safe(scope, cf):
    block = make_block(scope, 3, capacity_factor=cf)
    graphs, _, _ = capture_blocks([block], torch.zeros(6, H), num_warmup_iters=0)
    step = graphs[0][0]
    # + router.aux_loss and router.z_loss where the scope holds the router; moe_preprocess:
    # hidden, permuted tokens and probs, tokens_per_expert, row_id_map, probs_index
    n_out = {"attn": 1, "moe_router": 5, "full": 3, "moe_preprocess": 8}[scope]
    assert len(step.static_outputs) == n_out
    assert_graph_safe(step, torch.randn(6, H))


def test_early_exit_signal_and_store():
    block = make_block("moe_router", 4)
    x = torch.randn(6, H)
    with capturing_scope("attn"), pytest.raises(PartialCaptureSignal) as info:
        block.eager_forward(x)
    assert info.value.scope == "attn" and len(info.value.outputs) == 1
    torch.testing.assert_close(info.value.outputs[0], block.attn(x))
    h, probs, routing_map, *_ = block.captured_part(x)  # + the router's logged losses
    assert routing_map.dtype == torch.bool and probs.shape == (6, 4)
    # with the router's results in the store, the router is skipped: a constant routing
    block.tensor_store.set(hidden=h, probs=probs.detach(), routing_map=routing_map)
    out_a = block.eager_forward(torch.randn(6, H))
    out_b = block.eager_forward(torch.randn(6, H))
    torch.testing.assert_close(out_a, out_b)
    block.tensor_store.clear()


def test_scope_errors_and_unsafe_capture():
    with pytest.raises(ValueError, match="scope must be one of"):
        make_block("moe_dispatch", 0)
    allgather = MoELayer(H, 12, num_experts=4, topk=2, token_dispatcher_type="allgather")
    with pytest.raises(ValueError, match="dispatch_preprocess"):
        PartialMoEBlock(None, allgather, "moe_preprocess")
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


def _permute_reference(h, routing_map, probs, capacity):
    """float64 expert-major permutation: rows of each expert in token order (first ``capacity``
    kept, padded with zero rows); returns (rows, probs, tokens_per_expert)."""
    rows, row_probs, counts = [], [], []
    for e in range(routing_map.shape[1]):
        tokens = torch.nonzero(routing_map[:, e]).flatten().tolist()
        if capacity is not None:
            tokens = tokens[:capacity] + [-1] * (capacity - len(tokens[:capacity]))
        counts.append(len(tokens))
        for t in tokens:
            rows.append(h[t] if t >= 0 else torch.zeros_like(h[0]))
            row_probs.append(probs[t, e] if t >= 0 else probs.new_zeros(()))
    return torch.stack(rows), torch.stack(row_probs), torch.tensor(counts)


@pytest.mark.parametrize("cf", [None, 1.0])
def test_moe_preprocess_boundary_outputs(cf):
    """The early exit of ``moe_preprocess`` carries the permuted rows and probabilities (float64
    reference) and the preprocess tensors the dispatcher's eager rest reads."""
    block = make_block("moe_preprocess", 5, cf)
    x = torch.randn(7, H)
    outs = block.captured_part(x)
    named = dict(zip(block._output_names, outs))
    h = block.attn(x)
    probs, routing_map = block.moe.router(h)
    capacity = block.moe.workspace.capacity
    rows, row_probs, counts = _permute_reference(
        h.detach().double(), routing_map, probs.detach().double(), capacity
    )
    torch.testing.assert_close(named["hidden"], h)
    torch.testing.assert_close(named["permuted_tokens"].double(), rows)
    torch.testing.assert_close(named["permuted_probs"].double(), row_probs)
    torch.testing.assert_close(named["preprocess.tokens_per_expert"], counts)
    assert named["permuted_tokens"].requires_grad and named["permuted_probs"].requires_grad
    assert set(named) >= {"preprocess.row_id_map", "router.aux_loss", "router.z_loss"}
    # As at a CUDA replay: the dispatcher last ran another input; the eager rest must take the
    # preprocess from the store, not from the dispatcher's state.
    block.captured_part(torch.randn(7, H))
    block.tensor_store.set(**{k: v for k, v in named.items() if not k.startswith("router.")})
    out = block.eager_forward(torch.full_like(x, float("nan")))  # x itself is not read
    block.tensor_store.clear()
    torch.testing.assert_close(out, block.eager_forward(x))


def _ep_moe_preprocess_worker(rank, world):
    """EP=2 dropless: the captured moe_preprocess part holds no collective and is graph-safe;
    replays with new routings on every rank equal the eager blocks (outputs and gradients)."""
    import torch.distributed as dist

    from mtp.testing import count_collectives

    def blocks_():
        out = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            moe = MoELayer(H, 12, num_experts=4, topk=2, aux_loss_coeff=0.01,
                           ep_group=dist.group.WORLD, backend="torch")
            out.append(PartialMoEBlock(Attn(), moe, "moe_preprocess"))
        return out

    blocks, eager = blocks_(), blocks_()
    m = 3
    order = get_pipeline_order(2, 0, m)
    capture_blocks(blocks, torch.zeros(2, 5, H, requires_grad=True), order=order)
    step = blocks[0].graphed.steps[0]
    with count_collectives() as coll:
        step(torch.randn(2, 5, H))
    assert coll.count() == 0, coll  # no collective in the captured part
    assert_graph_safe(step, torch.randn(2, 5, H))
    gen = torch.Generator().manual_seed(50 + rank)
    for _ in range(2):
        xs = [torch.randn(2, 5, H, generator=gen) for _ in range(m)]
        gs = [torch.randn(2, 5, H, generator=gen) for _ in range(m)]
        for b in blocks:
            b.graphed.reset()
        pending, fwd, bwd = {}, 0, 0
        for c in order:
            if c > 0:
                x = xs[fwd].clone().requires_grad_(True)
                xr = xs[fwd].clone().requires_grad_(True)
                y, yr = x, xr
                for b, e in zip(blocks, eager):
                    y, yr = b(y), e(yr)
                torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(blocks[1].moe.router.aux_loss,
                                           eager[1].moe.router.aux_loss)
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
    return True


def test_moe_preprocess_scope_expert_parallel_dropless():
    from mtp.testing import run_distributed

    assert run_distributed(_ep_moe_preprocess_worker, 2, timeout=120) == [True, True]
