"""Real CUDA-graph capture and replay in pipeline order (run when a GPU is lent): equal to eager
for dense blocks and for partially captured MoE blocks with new routings at every replay; static
buffer memory at 32 microbatches about that at pp microbatches."""

import copy
import gc

import pytest
import torch
from torch import nn

from mtp.graphs import CudaGraph, PartialMoEBlock, capture_blocks, make_graphed_callables
from mtp.pipeline import get_pipeline_order, order_to_steps

pytestmark = pytest.mark.gpu


class Dense(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a = nn.Linear(h, 4 * h)
        self.b = nn.Linear(4 * h, h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(self.norm(x))))


def replay_against_eager(order, graphed_fn, eager_fn, shape, device, tol):
    """Run the order: forwards on fresh inputs, backwards with fresh output gradients; compare
    each output and input gradient with the eager module."""
    gen = torch.Generator(device=device).manual_seed(0)
    pending = {}
    mb = [0, 0]
    for s in order_to_steps(order):
        if s.forward:
            x = torch.randn(shape, device=device, generator=gen)
            xg, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            yg, ye = graphed_fn(xg, s.microbatch), eager_fn(xe)
            torch.testing.assert_close(yg, ye, rtol=tol, atol=tol)
            pending[s.microbatch] = (xg, yg, xe, ye, yg.detach().clone())
            mb[0] += 1
        else:
            xg, yg, xe, ye, y_then = pending.pop(s.microbatch)
            g = torch.randn(shape, device=device, generator=gen)
            yg.backward(g)
            ye.backward(g)
            torch.testing.assert_close(xg.grad, xe.grad, rtol=tol, atol=tol)
            mb[1] += 1
    assert mb[0] == mb[1] > 0


def test_dense_blocks_capture_equals_eager():
    torch.manual_seed(0)
    dev = "cuda"
    layers = [Dense(64).to(dev) for _ in range(2)]
    eager = copy.deepcopy(layers)
    order = get_pipeline_order(4, 0, 8)
    sample = (torch.zeros(128, 64, device=dev, requires_grad=True),)
    graphs, plan, _ = make_graphed_callables(layers, [sample] * 2, order=order)
    assert isinstance(graphs[0][0].fwd_graph, CudaGraph) and plan.num_slots == 4

    def graphed(x, m):
        return graphs[1][m](graphs[0][m](x))

    def ref(x):
        return eager[1](eager[0](x))

    replay_against_eager(order, graphed, ref, (128, 64), dev, 1e-4)
    for lg, le in zip(layers, eager):
        for pg, pe in zip(lg.parameters(), le.parameters()):
            torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scope,cf", [("moe_router", None), ("attn", None), ("full", None),
                                      ("full", 1.25), ("moe_preprocess", None),
                                      ("moe_preprocess", 1.25)])
def test_moe_partial_capture_new_routings_equals_eager(scope, cf):
    from mtp.moe import MoELayer

    torch.manual_seed(0)
    dev, h = "cuda", 64
    blocks = [
        PartialMoEBlock(Dense(h), MoELayer(h, 128, num_experts=8, topk=2, aux_loss_coeff=0.01,
                                           capacity_factor=cf), scope).to(dev)
        for _ in range(2)
    ]
    eager = copy.deepcopy(blocks)
    order = get_pipeline_order(2, 0, 4)
    capture_blocks(blocks, torch.zeros(256, h, device=dev, requires_grad=True), order=order)

    def graphed(x, m):
        return blocks[1](blocks[0](x))

    def ref(x):
        return eager[1](eager[0](x))

    for _ in range(2):
        for b in blocks:
            b.graphed.reset()
        replay_against_eager(order, graphed, ref, (256, h), dev, 2e-4)
    for bg, be in zip(blocks, eager):
        for (name, pg), pe in zip(bg.named_parameters(), be.parameters()):
            torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-3, atol=1e-4, msg=name)


def _captured_bytes(m, reuse=True):
    torch.manual_seed(0)
    layers = [Dense(1024).cuda() for _ in range(2)]
    sample = (torch.zeros(2048, 1024, device="cuda", requires_grad=True),)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graphs, _, buffers = make_graphed_callables(
        layers, [sample] * 2, order=get_pipeline_order(4, 0, m), reuse_buffers=reuse)
    torch.cuda.synchronize()
    used = torch.cuda.memory_reserved() - before
    del graphs
    return used, buffers.nbytes()


def test_static_memory_grows_with_depth_not_microbatches():
    at_pp, static_pp = _captured_bytes(4)
    at_32, static_32 = _captured_bytes(32)
    assert static_32 == static_pp
    assert at_32 <= 1.25 * at_pp + (64 << 20), (at_pp, at_32)
    no_reuse, static_no_reuse = _captured_bytes(32, reuse=False)
    assert static_no_reuse > 4 * static_32 and no_reuse > at_32
