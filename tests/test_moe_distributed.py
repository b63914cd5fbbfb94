"""Expert parallelism on gloo (world sizes 2 and 4) against a single-process MoELayer that holds
all experts with the same weights.

Each rank routes its own tokens; the reference layer runs every rank's tokens one after the
other. Per rank: outputs, input gradients, router gradients and aux/z losses must match the
reference on that rank's tokens; expert weight gradients must match the reference's gradients
summed over the tokens of every rank of the EP group (the experts see all of them).
"""

import pytest
import torch
import torch.distributed as dist

import mtp.parallel as mp
from mtp.moe import MoELayer, MoEWorkspace, preprocess
from mtp.moe.gathered import gathers_received
from mtp.testing import (
    assert_close,
    assert_graph_safe,
    count_collectives,
    count_host_syncs,
    run_distributed,
)

H, FFN, TOKENS = 8, 6, (2, 5)

CONFIGS = {
    "dropless": dict(aux_loss_coeff=0.1, z_loss_coeff=0.01),
    "dropless-swiglu-bias-idle": dict(activation="swiglu", bias=True, block=True),
    "dropless-triton": dict(backend="triton", score_function="sigmoid", aux_loss_coeff=0.1),
    "capacity": dict(capacity_factor=1.0, aux_loss_coeff=0.1, bias=True),
    "capacity-triton": dict(backend="triton", capacity_factor=1.0, aux_loss_coeff=0.1),
    "capacity-tight-position": dict(capacity_factor=0.5, drop_policy="position", block=True),
    # Rank i of the group routes 10 * i tokens (none on the first rank).
    "dropless-ragged": dict(ragged=True, aux_loss_coeff=0.1),
}


def _inputs(ranks, blocked, ragged):
    xs, gs = {}, {}
    for i, r in enumerate(ranks):
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(*((2, 5 * i) if ragged else TOKENS), H, generator=g)
        if blocked:
            x[..., 0] = x[..., 0].abs() + 1
        xs[r], gs[r] = x, torch.randn(x.shape, generator=g)
    return xs, gs


def _block(layer, experts):
    """These experts lose every routing decision (inputs have feature 0 >= 1)."""
    with torch.no_grad():
        for e in experts:
            layer.router.weight[e] = 0
            layer.router.weight[e, 0] = -20


def _reference(cfg, num_experts, topk, group_ranks, xs, gs, blocked, solo):
    """Per-rank outputs/grads of a single-process layer over every rank's tokens (``solo``: a
    one-rank group, so that an initialised mtp.parallel state is not picked up)."""
    torch.manual_seed(0)
    ref = MoELayer(H, FFN, num_experts, topk, backend="torch", ep_group=solo, **cfg)
    assert ref.ep_size == 1
    _block(ref, blocked)
    per_rank = {}
    for r in group_ranks:
        ref.router.weight.grad = None
        x = xs[r].clone().requires_grad_(True)
        out = ref(x)
        if out.requires_grad:  # not with 0 tokens (mtp.ops' reference unpermute)
            (out * gs[r]).sum().backward()
        else:
            x.grad, ref.router.weight.grad = (
                torch.zeros_like(x),
                torch.zeros_like(ref.router.weight),
            )
        per_rank[r] = dict(
            out=out.detach(),
            x_grad=x.grad,
            router_grad=ref.router.weight.grad.clone(),
            aux=ref.aux_loss,
            z=ref.z_loss,
            routing=ref.router(xs[r])[1],
        )
    return ref, per_rank


def _check_config(name, ep_group, solo, topk=2, num_experts=None):
    cfg = dict(CONFIGS[name])
    backend = cfg.pop("backend", "auto")
    block = cfg.pop("block", False)
    ragged = cfg.pop("ragged", False)
    ep = dist.get_world_size(ep_group)
    me = dist.get_rank()
    group_ranks = dist.get_process_group_ranks(ep_group)
    num_experts = num_experts or 2 * ep
    local = num_experts // ep
    # Idle experts: expert 1, and with 4 ranks every expert of the last rank (it receives
    # nothing at all in dropless mode).
    blocked = [1] + (list(range(num_experts - local, num_experts)) if ep == 4 else [])
    blocked = blocked if block else []
    xs, gs = _inputs(group_ranks, bool(blocked), ragged)

    torch.manual_seed(0)
    moe = MoELayer(H, FFN, num_experts, topk, backend=backend, ep_group=ep_group, **cfg)
    _block(moe, blocked)
    ref, want = _reference(cfg, num_experts, topk, group_ranks, xs, gs, blocked, solo)
    rank_in_group = dist.get_rank(ep_group)
    first = rank_in_group * local
    # Same seed -> this rank holds the slice of the single-process layer's experts.
    for pname in ("weight1", "weight2"):
        assert torch.equal(
            getattr(moe.experts, pname), getattr(ref.experts, pname)[first : first + local]
        )

    x = xs[me].clone().requires_grad_(True)
    # the Triton configs: fused experts read the received rows through their order
    assert gathers_received(moe, x) == (backend == "triton")
    with count_host_syncs() as fwd_syncs, count_collectives() as fwd_coll:
        out = moe(x)
    with count_host_syncs() as bwd_syncs, count_collectives() as bwd_coll:
        (out * gs[me]).sum().backward()

    w = want[me]
    assert_close(out, w["out"], torch.float32, atol=2e-5, msg=f"{name} output")
    assert_close(x.grad, w["x_grad"], torch.float32, atol=2e-5, msg=f"{name} input grad")
    assert_close(
        moe.router.weight.grad,
        w["router_grad"],
        torch.float32,
        atol=2e-5,
        msg=f"{name} router grad",
    )
    for pname, p in moe.experts.named_parameters():
        full = getattr(ref.experts, pname).grad[first : first + local]
        assert_close(p.grad, full, torch.float32, atol=2e-5, msg=f"{name} expert {pname} grad")
    for loss in ("aux", "z"):
        mine = moe.aux_loss if loss == "aux" else moe.z_loss
        assert (mine is None) == (w[loss] is None), loss
        if mine is not None:
            assert_close(mine, w[loss], torch.float32, msg=f"{name} {loss} loss")
    for e in blocked:
        if first <= e < first + local:
            assert not moe.experts.weight1.grad[e - first].any(), f"idle expert {e} got a gradient"

    ws = moe.workspace
    if cfg.get("capacity_factor") is None:
        # Counts received per (source rank, local expert), from the reference routing.
        want_recv = torch.stack(
            [want[r]["routing"][:, first : first + local].sum(0) for r in group_ranks]
        )
        assert torch.equal(ws.recv_counts, want_recv)
        assert torch.equal(ws.local_tokens_per_expert, want_recv.sum(0))
        expect = dict(fwd_syncs=1, fwd_a2a=4, bwd_a2a=3)
    else:
        # First dispatch: one tiny all-to-all + a device-side assert check that the ranks agree.
        expect = dict(fwd_syncs=0, fwd_a2a=4, bwd_a2a=3)
    if backend == "reference":
        expect.pop("fwd_syncs")
    got = dict(
        fwd_syncs=fwd_syncs.count,
        fwd_a2a=fwd_coll.count("all_to_all_single"),
        bwd_a2a=bwd_coll.count("all_to_all_single"),
    )
    assert bwd_syncs.count == 0, bwd_syncs
    assert all(got[k] == v for k, v in expect.items()), (name, got, fwd_syncs, fwd_coll)
    assert fwd_coll.count() == got["fwd_a2a"]

    # Ten more calls with other routings: the workspace keeps its buffers.
    ptrs = ws.data_ptrs()
    for i in range(10 if backend != "triton" else 1):
        moe(xs[me] * (i + 2))
        assert moe.workspace is ws and ws.data_ptrs() == ptrs
    if cfg.get("capacity_factor") is not None:
        with count_host_syncs() as steady_syncs, count_collectives() as steady_coll:
            moe(xs[me])
        assert steady_syncs.count == 0 and steady_coll.count("all_to_all_single") == 3
        assert_graph_safe(moe, xs[me])
    return got


def _ep_preprocess_graph_safe(rank, world):
    """The EP preprocess (counts all-to-all on the device) is graph-safe and its receive counts
    are the other ranks' send counts."""
    E, k, T = 2 * world, 2, 9
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.rand(T, E, generator=g) * routing_map
    ws = MoEWorkspace(T, 4, E, k, ep_size=world)
    with count_host_syncs() as syncs:
        res = preprocess(routing_map, probs, ws, ep_group=dist.group.WORLD, validate=False)
    assert syncs.count == 0
    sent = [torch.zeros(world, 2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sent, routing_map.sum(0).view(world, 2))
    assert torch.equal(res.recv_counts, torch.stack([s[rank] for s in sent]))
    assert torch.equal(res.send_counts, routing_map.sum(0).view(world, 2).sum(1))
    # recv_order/recv_inverse are inverse permutations of the received rows.
    received = int(res.recv_counts.sum())
    order, inverse = res.recv_order[:received], res.recv_inverse[:received]
    assert torch.equal(inverse[order], torch.arange(received))
    assert (res.recv_order[received:] == -1).all()
    assert_graph_safe(preprocess, routing_map, probs, ws, ep_group=dist.group.WORLD)


def _ep_worker(rank, world, names):
    solo = [dist.new_group([r]) for r in range(world)][rank]
    results = {}
    if world == 2:
        _ep_preprocess_graph_safe(rank, world)
    for name in names:
        results[name] = _check_config(name, dist.group.WORLD, solo)
    if world == 4:
        results.update(_ep_subgroup_and_bad_configs(rank, world, solo))
    return results


def _ep_subgroup_and_bad_configs(rank, world, solo):
    out = {}
    # EP = 2 inside a world of 4, the group taken from mtp.parallel (ep_group=None).
    mp.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        group = mp.get_expert_model_parallel_group()
        layer = MoELayer(H, FFN, 4, 2, backend="torch")
        assert layer.ep_size == 2 and layer.ep_group is group
        out["subgroup"] = _check_config("dropless", group, solo)
    finally:
        mp.destroy_model_parallel()
    with pytest.raises(
        ValueError, match="num_experts=6 must be divisible by the expert-parallel size 4"
    ):
        MoELayer(H, FFN, 6, 2, ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="topk=9 must be <= num_experts=8"):
        MoELayer(H, FFN, 8, 9, ep_group=dist.group.WORLD)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(world):
    names = (
        list(CONFIGS)
        if world == 2
        else ["dropless-swiglu-bias-idle", "capacity-tight-position", "dropless-ragged"]
    )
    results = run_distributed(_ep_worker, world, names, timeout=300)
    for name in names:
        assert results[0][name]["fwd_a2a"] == 4
