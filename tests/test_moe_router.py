"""TopKRouter: routing semantics, capacity dropping, auxiliary losses, expert bias.

The oracle below is a per-token Python loop in float64 written from Megatron-Core's formulas;
test_moe_layer.py reuses it.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtp.moe import (
    MoEAuxLossAutoScaler,
    TopKRouter,
    get_capacity,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from mtp.testing import assert_close, count_host_syncs

# --- float64 oracle --------------------------------------------------------------------------


def _top(values, k):
    return sorted(range(len(values)), key=lambda e: (-values[e], e))[:k]


def oracle_route(
    logits,
    topk,
    score_function="softmax",
    pre_softmax=False,
    bias=None,
    scaling=None,
    num_groups=None,
    group_topk=None,
):
    """``probs [T, E]`` (differentiable in ``logits``) and the chosen experts per token."""
    T, E = logits.shape
    rows, chosen = [], []
    bias_l = [0.0] * E if bias is None else [float(b) for b in bias]
    for t in range(T):
        lt = logits[t]
        if score_function == "softmax":
            base = torch.softmax(lt, 0) if pre_softmax else lt
        else:
            base = torch.sigmoid(lt)
        sel = [float(base[e].detach()) + bias_l[e] for e in range(E)]
        if num_groups:
            size = E // num_groups
            gscore = [
                sum(sorted(sel[g * size : (g + 1) * size], reverse=True)[: topk // group_topk])
                for g in range(num_groups)
            ]
            keep = set(_top(gscore, group_topk))
            sel = [s if e // size in keep else -math.inf for e, s in enumerate(sel)]
        idx = _top(sel, topk)
        if score_function == "softmax" and not pre_softmax:
            p = torch.softmax(lt[idx], 0)
        else:
            p = base[idx]
            if score_function == "sigmoid" and topk > 1:
                p = p / p.sum()
        if scaling:
            p = p * scaling
        row = torch.zeros(E, dtype=logits.dtype, device=logits.device)
        row = row.index_put((torch.tensor(idx, device=logits.device),), p)
        rows.append(row)
        chosen.append(idx)
    return torch.stack(rows), chosen


def oracle_drop(probs, chosen, capacity, policy):
    """Kept (token, expert) pairs: per expert the top-``capacity`` by probability (ties: lower
    token) or the first ``capacity`` in token order."""
    E = probs.shape[1]
    kept = set()
    for e in range(E):
        tokens = [t for t, idx in enumerate(chosen) if e in idx]
        if policy == "probs":
            tokens.sort(key=lambda t: (-float(probs[t, e].detach()), t))
        kept.update((t, e) for t in tokens[:capacity])
    return kept


def oracle_aux_loss(logits, topk, score_function, coeff):
    T, E = logits.shape
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=1)
    else:
        s = torch.sigmoid(logits)
        scores = s / s.sum(dim=1, keepdim=True)
    counts = [0] * E
    for t in range(T):
        for e in _top([float(v) for v in scores[t].detach()], topk):
            counts[e] += 1
    total = sum(scores[:, e].sum() * counts[e] for e in range(E))
    return total * coeff * E / (topk * T * T)


def oracle_z_loss(logits, coeff):
    return coeff * (torch.logsumexp(logits, dim=1) ** 2).mean()


# --- routing -----------------------------------------------------------------------------------

ROUTINGS = [
    dict(score_function="softmax", use_pre_softmax=False),
    dict(score_function="softmax", use_pre_softmax=True),
    dict(score_function="sigmoid"),
    dict(score_function="sigmoid", scaling_factor=2.5),
    dict(score_function="sigmoid", num_groups=4, group_topk=2),
    dict(score_function="softmax", use_pre_softmax=True, num_groups=2, group_topk=1),
]


@pytest.mark.parametrize("cfg", ROUTINGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("topk", [1, 2, 4])
def test_topk_matches_oracle(cfg, topk):
    if topk % cfg.get("group_topk", 1):
        pytest.skip("group-limited routing needs group_topk | topk")
    torch.manual_seed(0)
    logits = torch.randn(13, 8, dtype=torch.float64)
    probs, routing_map, tpe = topk_softmax_with_capacity(logits.float(), topk, **cfg)
    want, chosen = oracle_route(
        logits,
        topk,
        cfg["score_function"],
        cfg.get("use_pre_softmax", False),
        scaling=cfg.get("scaling_factor"),
        num_groups=cfg.get("num_groups"),
        group_topk=cfg.get("group_topk"),
    )
    assert_close(probs, want, torch.float32)
    expected_map = torch.zeros(13, 8, dtype=torch.bool)
    for t, idx in enumerate(chosen):
        expected_map[t, idx] = True
    assert torch.equal(routing_map, expected_map)
    assert torch.equal(tpe, expected_map.sum(0))
    assert probs.dtype == torch.float32


@pytest.mark.parametrize(
    "score_function,pre", [("sigmoid", False), ("softmax", True), ("softmax", False)]
)
def test_expert_bias_steers_selection_not_probs(score_function, pre):
    torch.manual_seed(1)
    logits = torch.randn(10, 6, dtype=torch.float64)
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0, -5.0, 0.0])
    probs, routing_map, _ = topk_softmax_with_capacity(
        logits.float(), 2, score_function=score_function, use_pre_softmax=pre, expert_bias=bias
    )
    want, chosen = oracle_route(logits, 2, score_function, pre, bias=bias)
    assert all(1 in idx and 4 not in idx for idx in chosen)
    assert torch.equal(routing_map, want != 0)
    assert_close(probs, want, torch.float32)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 4.0])
def test_capacity_drop_matches_oracle(policy, cf):
    torch.manual_seed(2)
    T, E, k = 16, 4, 2
    logits = torch.randn(T, E, dtype=torch.float64)
    probs, routing_map, tpe = topk_softmax_with_capacity(
        logits.float(), k, capacity_factor=cf, drop_policy=policy
    )
    capacity = min(math.ceil(T * k / E * cf), T)
    full, chosen = oracle_route(logits, k)
    kept = oracle_drop(full, chosen, capacity, policy)
    expected_map = torch.zeros(T, E, dtype=torch.bool)
    for t, e in kept:
        expected_map[t, e] = True
    assert torch.equal(routing_map, expected_map)
    assert int(routing_map.sum(0).max()) <= capacity
    assert_close(probs, full * expected_map, torch.float32)
    assert torch.equal(tpe, (full != 0).sum(0))  # counts before dropping


def test_capacity_ties_go_to_the_lower_token():
    # Identical rows: every token has the same probabilities, so "probs" keeps the first ones.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(8, 1)
    _, routing_map, _ = topk_softmax_with_capacity(logits, 1, capacity_factor=1.0)
    assert routing_map[:2, 0].all() and not routing_map[2:].any()
    _, pad_map, _ = topk_softmax_with_capacity(logits, 1, capacity_factor=1.0, pad_to_capacity=True)
    assert torch.equal(pad_map.sum(0), torch.full((4,), 2))


def test_get_capacity():
    assert get_capacity(32, 8, 1.0) == 4
    assert get_capacity(30, 8, 1.25) == 5
    assert get_capacity(4, 8, 1.0, min_capacity=2) == 2


# --- auxiliary losses --------------------------------------------------------------------------


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_and_z_loss_values_and_gradients(score_function):
    torch.manual_seed(3)
    T, H, E, k = 12, 8, 6, 2
    router = TopKRouter(
        H, E, k, score_function=score_function, aux_loss_coeff=0.1, z_loss_coeff=0.01
    )
    x = torch.randn(3, 4, H, requires_grad=True)
    g = torch.randn(T, E)
    probs, _ = router(x)
    (probs * g).sum().backward()

    x64 = x.detach().double().reshape(T, H).requires_grad_(True)
    w64 = router.weight.detach().double().requires_grad_(True)
    logits = x64 @ w64.t()
    want, _ = oracle_route(logits, k, score_function)
    aux = oracle_aux_loss(logits, k, score_function, 0.1)
    z = oracle_z_loss(logits, 0.01)
    ((want * g.double()).sum() + aux + z).backward()

    assert_close(probs, want, torch.float32)
    assert_close(router.aux_loss, aux.detach(), torch.float32)
    assert_close(router.z_loss, z.detach(), torch.float32)
    assert_close(router.weight.grad, w64.grad, torch.float32, atol=3e-5)
    assert_close(x.grad.reshape(T, H), x64.grad, torch.float32, atol=3e-5)
    # The functional forms agree with the oracle too.
    assert_close(z_loss_func(logits.detach(), 0.01), z.detach(), torch.float64)
    scores = torch.softmax(logits.detach(), 1) if score_function == "softmax" else None
    if scores is not None:
        counts = torch.zeros(E).index_add_(0, scores.topk(k).indices.reshape(-1), torch.ones(T * k))
        value = switch_load_balancing_loss_func(scores, counts, T, k, E, 0.1)
        assert_close(value, aux.detach(), torch.float64)


def test_losses_only_in_training_with_grad():
    router = TopKRouter(8, 4, 2, aux_loss_coeff=0.1, z_loss_coeff=0.1)
    x = torch.randn(5, 8)
    router(x)
    assert router.aux_loss is not None and router.z_loss is not None
    with torch.no_grad():
        router(x)
    assert router.aux_loss is None and router.z_loss is None
    router.eval()
    router(x)
    assert router.aux_loss is None


def test_loss_scale_scales_the_aux_gradient():
    torch.manual_seed(4)
    router = TopKRouter(8, 4, 2, aux_loss_coeff=0.5)
    x = torch.randn(6, 8)

    def router_grad():
        router.weight.grad = None
        probs, _ = router(x)
        (probs * 0).sum().backward()  # only the aux loss contributes
        return router.weight.grad.clone()

    try:
        one = router_grad()
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.25))
        quarter = router_grad()
    finally:
        MoEAuxLossAutoScaler.reset_loss_scale()
    assert one.abs().sum() > 0
    assert_close(quarter, one * 0.25, torch.float32)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

        self.transfers = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.names.append(name)
        if "lift_fresh" in name or (name == "aten::_to_copy" and (kwargs or {}).get("device")):
            self.transfers.append(name)
        return func(*args, **(kwargs or {}))


def test_router_has_no_host_sync_or_host_to_device_copy():
    router = TopKRouter(
        8, 6, 2, aux_loss_coeff=0.1, z_loss_coeff=0.1, expert_bias=True, capacity_factor=1.0
    )
    x = torch.randn(10, 8, requires_grad=True)
    with count_host_syncs() as syncs, _OpLog() as log:
        probs, _ = router(x)
        probs.sum().backward()
    assert syncs.count == 0, syncs
    # Tensors made from Python values (torch.tensor(...)) show up as lift_fresh, copies to
    # another device as _to_copy(device=...): none allowed.
    assert log.names and not log.transfers, log.transfers


# --- expert bias -------------------------------------------------------------------------------


def test_expert_bias_update():
    torch.manual_seed(5)
    router = TopKRouter(8, 4, 1, score_function="sigmoid", expert_bias=True)
    x = torch.randn(20, 8)
    _, routing_map = router(x)
    _, routing_map2 = router(x)
    counts = (routing_map.sum(0) + routing_map2.sum(0)).float()
    assert torch.equal(router.local_tokens_per_expert, counts)
    with torch.no_grad():
        router(x)  # no counting without gradients
    assert torch.equal(router.local_tokens_per_expert, counts)
    router.update_expert_bias(0.01)
    want = torch.sign(counts.mean() - counts) * 0.01
    assert torch.equal(router.expert_bias, want)
    assert not router.local_tokens_per_expert.any()
    assert "expert_bias" in router.state_dict()
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        TopKRouter(8, 4, 1).update_expert_bias()


# --- bad configurations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk=5), "topk=5 must be <= num_experts=4"),
        (dict(topk=0), "topk must be >= 1"),
        (dict(score_function="relu"), "score_function"),
        (dict(capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
        (dict(drop_policy="random"), "drop_policy"),
        (dict(num_groups=3, group_topk=1), "divisible by num_groups"),
        (dict(num_groups=2), "together"),
        (dict(router_dtype=torch.float16), "router_dtype"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
    ],
)
def test_bad_router_configs(kwargs, match):
    args = dict(hidden_size=8, num_experts=4, topk=2)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        TopKRouter(args.pop("hidden_size"), args.pop("num_experts"), args.pop("topk"), **args)


def test_bad_router_input():
    router = TopKRouter(8, 4, 2)
    with pytest.raises(ValueError, match="hidden_size=8"):
        router(torch.randn(3, 7))


# --- the fused router against the aten router ---------------------------------------------------


@pytest.mark.parametrize("kw", [
    dict(aux_loss_coeff=0.1, z_loss_coeff=0.01),
    dict(score_function="sigmoid", expert_bias=True, aux_loss_coeff=[0.1, 0.05],
         load_balancing_type=["aux_loss", "global_aux_loss"], z_loss_coeff=0.01, num_groups=2,
         group_topk=1, group_score="top2", scaling_factor=2.5),
    dict(pre_softmax=True, norm_topk_prob=True, capacity_factor=1.0, expert_bias=True,
         aux_loss_coeff=0.1, load_balancing_type="seq_aux_loss", z_loss_coeff=0.02),
    dict(capacity_factor=0.5, drop_policy="position", z_loss_coeff=0.1, aux_loss_coeff=0.1),
], ids=["softmax", "sigmoid-groups-bias", "pre-capacity-seq", "position-drop"])  # fmt: skip
@pytest.mark.parametrize("masked", [False, True])
def test_fused_router_equals_the_aten_router(kw, masked):
    """TopKRouter(backend="triton") (the fused kernels, under the interpreter on CPU) gives the
    aten router's probabilities, map, losses, counts and gradients."""
    torch.manual_seed(6)
    s, b, H, E, k = 6, 3, 8, 8, 2
    x = torch.randn(s, b, H)
    g = torch.randn(s * b, E)
    pad = (torch.rand(s, b) < 0.3) if masked else None
    weight = torch.randn(E, H)
    got = {}
    for backend in ("reference", "triton"):
        router = TopKRouter(H, E, k, backend=backend, **kw)
        with torch.no_grad():
            router.weight.copy_(weight)
            if router.expert_bias is not None:
                router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
        xi = x.clone().requires_grad_(True)
        probs, routing_map = router(xi, pad)
        (probs * g).sum().backward()
        got[backend] = (probs, routing_map, router.aux_loss, router.z_loss, router.weight.grad,
                        xi.grad, router.local_tokens_per_expert)  # fmt: skip
    ref, fused = got["reference"], got["triton"]
    assert torch.equal(ref[1], fused[1])
    for name, a, want in zip(("probs", "aux", "z", "dweight", "dx", "counts"),
                             (fused[0], *fused[2:]), (ref[0], *ref[2:])):  # fmt: skip
        if want is None:
            assert a is None, name
        else:
            assert_close(a, want, torch.float32, msg=name)


def test_router_in_the_layer_is_one_launch_and_one_gemm():
    """MoELayer(backend="triton"): the router is its GEMM and one launch forward, one launch
    (and the GEMM's two) backward, no host sync; no softmax/top-k/scatter aten op is left."""
    from mtp import settings
    from mtp.bench.counting import count_ops
    from mtp.moe import MoELayer

    settings.configure(poison_outputs=False)  # the NaN fill of outputs is a test extra
    torch.manual_seed(0)
    layer = MoELayer(32, 16, 8, 2, activation="swiglu", backend="triton",
                     router_dtype=torch.float32)  # fmt: skip
    x = torch.randn(64, 32, requires_grad=True)
    layer(x)
    with count_ops() as router:
        probs, _ = layer.router(x)
    loss, seed = probs.sum(), torch.ones(())
    with count_ops() as router_bwd:
        loss.backward(seed)
    assert dict(router.triton) == {"_router_fwd_kernel": 1} and dict(router.compute) == {
        "aten::mm": 1}, router.summary()  # fmt: skip
    assert dict(router_bwd.triton) == {"_router_bwd_kernel": 1} and dict(router_bwd.compute) == {
        "aten::mm": 2}, router_bwd.summary()  # fmt: skip
    assert router.host_syncs == router_bwd.host_syncs == []
    with count_ops() as forward:
        layer(x)
    names = set(forward.compute)
    assert not names & {"aten::topk", "aten::_softmax", "aten::scatter", "aten::gather"}, names
