"""Static-buffer planner and the capture protocol on CPU (stand-in graphs): captured in the
pipeline order, replayed in it with fresh data, equal to eager; buffers bounded by the depth."""

import copy

import pytest
import torch
from torch import nn

from mtp.graphs import StandInGraph, make_graphed_callables, plan_static_buffers
from mtp.pipeline import get_pipeline_order, order_to_steps

F64 = torch.float64


def in_flight(order, chunk=None):
    live = peak = 0
    for c in order:
        if chunk is None or abs(c) == chunk + 1:
            live += 1 if c > 0 else -1
            peak = max(peak, live)
    return peak


def check_no_overlap(order, plan):
    """No slot is given to a forward while another forward in it is still live."""
    owner = {}
    for s in order_to_steps(order):
        slot = plan.slot[(s.chunk, s.microbatch)]
        if s.forward:
            assert slot not in owner, f"slot {slot} reused while {owner[slot]} is live"
            owner[slot] = (s.chunk, s.microbatch)
        else:
            assert owner.pop(slot) == (s.chunk, s.microbatch)


def test_planner_peak_is_pipeline_depth_not_microbatches():
    for pp in (2, 4, 8):
        for rank in range(pp):
            small = plan_static_buffers(get_pipeline_order(pp, rank, pp))
            for m in (pp, 32):
                order = get_pipeline_order(pp, rank, m)
                plan = plan_static_buffers(order)
                check_no_overlap(order, plan)
                assert plan.peak_live == in_flight(order) == pp - rank <= pp
                assert plan.num_slots == plan.peak_live == small.num_slots
                assert len(plan.slot) == m
    # interleaved: per-chunk slots = per-chunk forwards in flight; shared: total peak
    for rank in range(4):
        order = get_pipeline_order(4, rank, 32, 2)
        plan = plan_static_buffers(order)
        check_no_overlap(order, plan)
        for c in range(2):
            assert len(plan.slots_of_chunk(c)) == in_flight(order, c)
        shared = plan_static_buffers(order, key_fn=lambda c: 0)
        check_no_overlap(order, shared)
        assert shared.num_slots == shared.peak_live == in_flight(order)
        assert shared.num_slots == plan_static_buffers(
            get_pipeline_order(4, rank, 8, 2), key_fn=lambda c: 0).num_slots
    # all forwards first: nothing to reuse
    plan = plan_static_buffers([1] * 5 + [-1] * 5)
    assert plan.num_slots == plan.peak_live == 5


class Layer(nn.Module):
    def __init__(self, h=6):
        super().__init__()
        self.a = nn.Linear(h, 2 * h, dtype=F64)
        self.b = nn.Linear(2 * h, h, dtype=F64)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def run_order(order, per_chunk, layers, x_of, g_of):
    """Execute ``order`` like a pipeline rank: a forward runs the chunk's layers on fresh data,
    a backward back-propagates a fresh gradient. Returns the outputs and input grads."""
    first = [sum(per_chunk[:c]) for c in range(len(per_chunk))]
    saved, outs, gins = {}, {}, {}
    for s in order_to_steps(order):
        key = (s.chunk, s.microbatch)
        idx = range(first[s.chunk], first[s.chunk] + per_chunk[s.chunk])
        if s.forward:
            x = x_of(key).requires_grad_(True)
            y = x
            for i in idx:
                y = layers[i](y)
            saved[key] = (x, y)
            outs[key] = y.detach().clone()
        else:
            x, y = saved.pop(key)
            y.backward(g_of(key))
            gins[key] = x.grad.clone()
    return outs, gins


@pytest.mark.parametrize("pp,rank,m,vpp", [(4, 0, 6, 1), (2, 0, 4, 2), (1, 0, 3, 1)])
def test_standin_capture_replays_in_order_equal_eager(pp, rank, m, vpp):
    torch.manual_seed(0)
    order = get_pipeline_order(pp, rank, m, vpp)
    per_chunk = [2] * vpp
    eager = [Layer() for _ in range(2 * vpp)]
    graphed_layers = copy.deepcopy(eager)
    sample = (torch.zeros(3, 6, dtype=F64, requires_grad=True),)
    graphs, plan, buffers = make_graphed_callables(
        graphed_layers, [sample] * len(eager), order=order, num_layers_per_chunk=per_chunk)
    assert all(isinstance(g.fwd_graph, StandInGraph) for row in graphs for g in row)
    gen = torch.Generator().manual_seed(5)
    data = {(c, i): (torch.randn(3, 6, generator=gen, dtype=F64),
                     torch.randn(3, 6, generator=gen, dtype=F64))
            for c in range(vpp) for i in range(m)}

    class Replayer:
        def __init__(self, l):
            self.l = l

        def __call__(self, x):
            return graphs[self.l][self.mb](x)

    replayers = [Replayer(l) for l in range(len(eager))]

    def x_of(key):
        for r in replayers:
            r.mb = key[1]
        return data[key][0].clone()

    ref_out, ref_gin = run_order(order, per_chunk, eager, x_of, lambda k: data[k][1])
    out, gin = run_order(order, per_chunk, replayers, x_of, lambda k: data[k][1])
    for key in ref_out:
        torch.testing.assert_close(out[key], ref_out[key], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gin[key], ref_gin[key], rtol=1e-12, atol=1e-12)
    for le, lg in zip(eager, graphed_layers):
        for pe, pg in zip(le.parameters(), lg.parameters()):
            torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-12, atol=1e-12)
    # every forward/backward ran as a replay, once
    assert all(g.fwd_graph.replays == 1 and g.bwd_graph.replays == 1 for row in graphs for g in row)
    # static inputs are shared per slot: as many distinct input buffers as slots x layers
    ptrs = {g.static_inputs[0].data_ptr() for row in graphs for g in row}
    assert len(ptrs) == plan.num_slots * 2


def test_static_buffers_bounded_by_depth():
    def nbytes(m):
        layers = [Layer() for _ in range(2)]
        sample = (torch.zeros(3, 6, dtype=F64, requires_grad=True),)
        _, plan, buffers = make_graphed_callables(
            layers, [sample] * 2, order=get_pipeline_order(4, 0, m), num_warmup_iters=0)
        return buffers.nbytes(), plan.num_slots

    b4, s4 = nbytes(4)
    b32, s32 = nbytes(32)
    assert s4 == s32 == 4 and b4 == b32
    layers = [Layer() for _ in range(2)]
    sample = (torch.zeros(3, 6, dtype=F64, requires_grad=True),)
    _, _, no_reuse = make_graphed_callables(
        layers, [sample] * 2, order=get_pipeline_order(4, 0, 32), num_warmup_iters=0,
        reuse_buffers=False)
    assert no_reuse.nbytes() > 4 * b32  # 8x the slots (parameter grads are per layer)


def test_capture_bad_arguments():
    layer = Layer()
    sample = (torch.zeros(3, 6, dtype=F64),)
    with pytest.raises(ValueError, match="sample_args has 2"):
        make_graphed_callables([layer], [sample, sample])
    with pytest.raises(TypeError, match="sample_args\\[0\\]"):
        make_graphed_callables([layer], [(3,)])
    with pytest.raises(ValueError, match="num_layers_per_chunk"):
        make_graphed_callables([layer, layer], [sample] * 2, order=[1, 2, -2, -1],
                               num_layers_per_chunk=[2, 1])
    graphs, _, _ = make_graphed_callables([layer], [sample])
    with pytest.raises(ValueError, match="expected \\(3, 6\\)"):
        graphs[0][0](torch.zeros(4, 6, dtype=F64))
    with pytest.raises(TypeError, match="takes 1 tensors"):
        graphs[0][0]()
