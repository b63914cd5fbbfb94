"""MoEWorkspace and the graph-safe preprocess (single rank; the expert-parallel part is in
test_moe_distributed.py)."""

import math

import pytest
import torch

from mtp.moe import MoEWorkspace, WorkspaceMismatchError, preprocess
from mtp.testing import assert_graph_safe, count_host_syncs


def topk_routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    idx = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.rand(T, E, generator=g) * routing_map
    return routing_map, probs


def oracle_rows(routing_map, capacity=None):
    """(token, expert) of each permuted row; None for an empty capacity slot."""
    T, E = routing_map.shape
    rows = []
    for e in range(E):
        mine = [(t, e) for t in range(T) if routing_map[t, e]]
        if capacity is not None:
            mine = mine[:capacity] + [None] * max(0, capacity - len(mine))
        rows += mine
    return rows


def check_against_oracle(res, routing_map, probs, capacity=None):
    rows = oracle_rows(routing_map, capacity)
    E = routing_map.shape[1]
    want_rid = torch.tensor([-1 if r is None else r[0] for r in rows], dtype=torch.int64)
    want_probs = torch.tensor([0.0 if r is None else float(probs[r]) for r in rows])
    if capacity is None:
        want_tpe = routing_map.sum(0)
    else:
        want_tpe = torch.full((E,), capacity)
    assert torch.equal(res.row_id_map, want_rid)
    assert torch.equal(res.permuted_probs, want_probs.to(res.permuted_probs.dtype))
    assert torch.equal(res.tokens_per_expert, want_tpe.to(torch.int64))


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 3.0])
def test_preprocess_matches_oracle_and_keeps_addresses(capacity_factor):
    T, H, E, k = 12, 4, 5, 2
    ws = MoEWorkspace(T, H, E, k, capacity_factor=capacity_factor)
    capacity = None if capacity_factor is None else min(math.ceil(T * k / E * capacity_factor), T)
    assert ws.capacity == capacity
    ptrs = ws.data_ptrs()
    for call in range(10):
        routing_map, probs = topk_routing(T, E, k, seed=call)
        if call == 3:  # expert 2 receives no token
            routing_map, probs = topk_routing(T, E - 1, k, seed=call)
            routing_map = torch.cat(
                [routing_map[:, :2], routing_map.new_zeros(T, 1), routing_map[:, 2:]], 1
            )
            probs = torch.cat([probs[:, :2], probs.new_zeros(T, 1), probs[:, 2:]], 1)
        with count_host_syncs() as syncs:
            res = preprocess(routing_map, probs, ws, validate=False)
        assert syncs.count == 0
        check_against_oracle(res, routing_map, probs, capacity)
        assert res.row_id_map.data_ptr() == ws.row_id_map.data_ptr()
        assert ws.data_ptrs() == ptrs
    if capacity_factor is None:
        assert res.send_counts is None and res.recv_order is None


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_preprocess_is_graph_safe(capacity_factor):
    ws = MoEWorkspace(16, 8, 4, 2, capacity_factor=capacity_factor)
    routing_map, probs = topk_routing(16, 4, 2, seed=7)
    out = assert_graph_safe(preprocess, routing_map, probs, ws)
    assert out.tokens_per_expert.data_ptr() == ws.tokens_per_expert.data_ptr()


def test_workspace_buffers_and_nbytes():
    T, H, E, k = 10, 6, 4, 3
    ws = MoEWorkspace(T, H, E, k, dtype=torch.bfloat16, probs_dtype=torch.float32)
    n = T * k
    want = E * 8 + n * 8 * 2 + n * 4  # counts, row map + index, probs
    assert ws.num_rows == n and ws.nbytes == want and ws.output is None
    assert (
        MoEWorkspace.estimate_nbytes(T, H, E, k, dtype=torch.bfloat16, probs_dtype=torch.float32)
        == want
    )
    cap = MoEWorkspace(T, H, E, k, capacity_factor=1.0)
    C = math.ceil(T * k / E)
    assert cap.capacity == C and cap.num_rows == E * C
    ep = MoEWorkspace.estimate_nbytes(
        T, H, E, k, ep_size=2, dtype=torch.bfloat16, probs_dtype=torch.float32
    )
    L, R = E // 2, 2 * T * min(k, E // 2)
    assert ep == want + 2 * 8 + 2 * L * 8 + L * 8 + 2 * R * 8
    assert "nbytes" in repr(ws)
    out = ws.static_output()  # the captured layer's output, allocated on first use
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and ws.static_output() is out
    assert ws.nbytes == want + T * H * 2


def test_workspace_mismatch_and_bad_sizes():
    ws = MoEWorkspace(8, 4, 4, 2)
    routing_map, probs = topk_routing(8, 4, 2, seed=0)
    with pytest.raises(WorkspaceMismatchError, match=r"tokens 9 \(workspace: 8\)"):
        preprocess(*topk_routing(9, 4, 2, seed=0), ws)
    with pytest.raises(WorkspaceMismatchError, match=r"experts 6 \(workspace: 4\)"):
        preprocess(*topk_routing(8, 6, 2, seed=0), ws)
    with pytest.raises(TypeError, match="probs_dtype"):
        preprocess(routing_map, probs.double(), ws)
    with pytest.raises(ValueError, match="exactly topk=2"):
        preprocess(*topk_routing(8, 4, 3, seed=0), ws)
    with pytest.raises(TypeError, match="routing_map must have dtype"):
        preprocess(routing_map.int(), probs, ws)
    with pytest.raises(ValueError, match="probs must have routing_map's shape"):
        preprocess(routing_map, probs[:, :3], ws)
    with pytest.raises(TypeError, match="MoEWorkspace"):
        preprocess(routing_map, probs, None)
    with pytest.raises(ValueError, match="divisible by ep_size=3"):
        MoEWorkspace(8, 4, 4, 2, ep_size=3)
    with pytest.raises(ValueError, match="topk=5 must be <= num_experts=4"):
        MoEWorkspace(8, 4, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEWorkspace(8, 4, 4, 2, capacity_factor=0.0)
    with pytest.raises(WorkspaceMismatchError, match="dtype"):
        ws.check("x", 8, dtype=torch.float16)
