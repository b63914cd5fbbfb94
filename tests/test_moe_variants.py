"""MoE routing variants, experts, shared experts, Hugging Face layouts, the capacity fix and
torch.compile: each against closed forms or the published models' maths written out here
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS), in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mtp.moe import (
    MoEWorkspace,
    GroupedMLP,
    MoELayer,
    TopKRouter,
    clear_aux_losses_tracker,
    grouped_to_hf,
    hf_to_grouped,
    topk_softmax_with_capacity,
    track_moe_metrics,
)
from mtp.moe.router import get_capacity
from mtp.testing import assert_close

D = torch.float64


def _dense(weights, idx, E):
    return torch.zeros(weights.shape[0], E, dtype=weights.dtype).scatter(1, idx, weights)


# --- Hugging Face routing formulas (from the published modeling code's maths) -------------------


def hf_mixtral(logits, k):
    p = torch.softmax(logits, dim=-1)
    v, i = p.topk(k, dim=-1)
    return _dense(v / v.sum(-1, keepdim=True), i, logits.shape[1])


def hf_qwen_moe(logits, k, norm_topk_prob):  # Qwen2-MoE and Qwen3-MoE routers
    p = torch.softmax(logits, dim=-1)
    v, i = p.topk(k, dim=-1)
    if norm_topk_prob:
        v = v / v.sum(-1, keepdim=True)
    return _dense(v, i, logits.shape[1])


def hf_deepseek_v3(logits, k, bias, n_group, topk_group, norm_topk_prob, scale):
    scores = logits.sigmoid()
    choice = scores + bias
    T, E = logits.shape
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    idx = choice.masked_fill(mask == 0, 0.0).topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return _dense(w * scale, idx, E)


def hf_gpt_oss(logits, k):
    v, i = logits.topk(k, dim=-1)
    return _dense(torch.softmax(v, dim=1), i, logits.shape[1])


def _router(E, k, H=8, **kw):
    r = TopKRouter(H, E, k, params_dtype=D, router_dtype=D, init_std=1.0, **kw)
    return r


@pytest.mark.parametrize("trial", range(3))
def test_routing_matches_hugging_face(trial):
    g = torch.Generator().manual_seed(trial)
    x = torch.randn(40, 8, generator=g, dtype=D)
    # Mixtral: softmax, top-2 renormalised == Megatron's top-k softmax.
    r = _router(8, 2)
    assert_close(r(x)[0], hf_mixtral(r.gating(x), 2), D)
    # Qwen2-MoE (norm_topk_prob False) and Qwen3-MoE (True).
    for norm in (False, True):
        r = _router(8, 3, pre_softmax=True, norm_topk_prob=norm)
        assert_close(r(x)[0], hf_qwen_moe(r.gating(x), 3, norm), D)
    # DeepSeek-V3: sigmoid + e_score_correction_bias, top-2-sum group scores with
    # topk / topk_group = 3 (not 2, where Megatron's group score differs), scaling.
    for norm in (True, False):
        r = _router(16, 6, score_function="sigmoid", expert_bias=True, num_groups=4,
                     group_topk=2, group_score="top2", norm_topk_prob=norm, scaling_factor=2.5)
        # Positive biases: Hugging Face fills the masked groups with 0.0 (not -inf), which only
        # differs when a chosen group has fewer than topk positive biased scores.
        r.expert_bias.copy_(torch.rand(16, generator=g) * 0.3)
        want = hf_deepseek_v3(r.gating(x), 6, r.expert_bias.double(), 4, 2, norm, 2.5)
        assert_close(r(x)[0], want, D)
    # GPT-OSS: router bias, softmax over the top-k logits.
    r = _router(8, 4, router_bias=True)
    with torch.no_grad():
        r.bias.copy_(torch.randn(8, generator=g, dtype=D))
    logits = x @ r.weight.t() + r.bias
    assert_close(r(x)[0], hf_gpt_oss(logits, 4), D)


def test_sigmoid_without_renormalisation_closed_form():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]], dtype=D)
    probs, rmap, _ = topk_softmax_with_capacity(logits, 2, score_function="sigmoid",
                                                norm_topk_prob=False)
    s2, s05 = torch.sigmoid(torch.tensor([2.0, 0.5], dtype=D)).tolist()
    want = torch.tensor([[s2, 0, s05, 0]], dtype=D)
    assert_close(probs, want, D)
    probs, _, _ = topk_softmax_with_capacity(logits, 2, score_function="sigmoid")
    assert_close(probs.sum(), torch.tensor(1.0, dtype=D), D)


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_pad_to_capacity_gives_exactly_capacity_slots(policy):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 4, generator=g)
    logits[:, 0] += 3  # expert 0 oversubscribed, others under
    probs, rmap, _ = topk_softmax_with_capacity(
        logits, 2, capacity_factor=1.0, drop_policy=policy, pad_to_capacity=True
    )
    cap = min(get_capacity(20 * 2, 4, 1.0), 20)
    assert rmap.sum(0).tolist() == [cap] * 4
    routed = torch.zeros_like(rmap).scatter(1, logits.topk(2, dim=1).indices, True)
    p_full = torch.zeros(20, 4).scatter(1, logits.topk(2, dim=1).indices,
                                        torch.softmax(logits.topk(2, dim=1).values, dim=1))
    for e in range(4):
        tokens = [t for t in range(20) if routed[t, e]]
        if policy == "probs":
            tokens.sort(key=lambda t: (-float(p_full[t, e]), t))
        kept_routed = set(tokens[:cap])
        assert {t for t in range(20) if rmap[t, e] and routed[t, e]} == kept_routed
        assert (probs[~routed[:, e], e] == 0).all()  # padding slots carry probability 0


def test_seq_and_global_aux_loss_closed_form():
    s, b, E, k, coeff = 5, 3, 4, 2, 0.1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, 8, generator=g, dtype=D)
    types = ["seq_aux_loss", "global_aux_loss"]
    r = _router(E, k, aux_loss_coeff=[coeff, coeff], load_balancing_type=types)
    r.train()
    r(x)
    logits = r.gating(x).view(s, b, E)
    scores = torch.softmax(logits, -1)
    top = torch.zeros_like(scores).scatter(-1, scores.topk(k, -1).indices, 1.0)
    seq = sum(
        E * coeff / (k * s * s) * (scores[:, j].sum(0) * top[:, j].sum(0)).sum() for j in range(b)
    ) / b
    T = s * b
    glob = E * coeff / (k * T * T) * (scores.sum((0, 1)) * top.sum((0, 1))).sum()
    assert_close(r.aux_loss, seq + glob, D)
    # global: token counts averaged over the micro-batches since the last reset.
    x2 = torch.randn(s, b, 8, generator=g, dtype=D)
    r(x2)
    logits2 = r.gating(x2).view(T, E)
    sc2 = torch.softmax(logits2, -1)
    top2 = torch.zeros_like(sc2).scatter(-1, sc2.topk(k, -1).indices, 1.0)
    avg = (top.sum((0, 1)) + top2.sum(0)) / 2
    glob2 = E * coeff / (k * T * T) * (sc2.sum(0) * avg).sum()
    seq2 = sum(
        E * coeff / (k * s * s)
        * (sc2.view(s, b, E)[:, j].sum(0) * top2.view(s, b, E)[:, j].sum(0)).sum()
        for j in range(b)
    ) / b
    assert_close(r.aux_loss, seq2 + glob2, D)
    r.reset_global_aux_loss_tracker()
    assert r.ga_steps.item() == 0


def test_padding_mask_excludes_tokens_from_losses_and_tracker():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g, dtype=D)
    mask = torch.zeros(12, dtype=torch.bool)
    mask[[1, 5, 6]] = True
    r = _router(4, 2, aux_loss_coeff=0.3, z_loss_coeff=0.2, layer_number=2, num_layers=3)
    r.train()
    clear_aux_losses_tracker()
    probs, rmap = r(x, padding_mask=mask)
    aux, z = r.aux_loss, r.z_loss
    metrics = track_moe_metrics(per_layer=True)
    r(x[~mask])
    assert_close(aux, r.aux_loss, D)
    assert_close(z, r.z_loss, D)
    assert math.isclose(metrics["moe/aux_loss_layer_1"], float(aux) / 0.3, rel_tol=1e-6)
    assert metrics["moe/aux_loss_layer_0"] == 0.0
    assert rmap.sum(1).eq(2).all()  # padded tokens are still routed


def test_input_jitter():
    r = _router(4, 2, input_jitter_eps=0.1)
    x = torch.randn(6, 8, dtype=D)
    r.eval()
    assert_close(r(x)[0], _router(4, 2)(x)[0] * 0 + r.routing(r.gating(x))[0], D)
    r.train()
    torch.manual_seed(5)
    got = r(x)[0]
    torch.manual_seed(5)
    noise = torch.empty_like(x).uniform_(0.9, 1.1)
    assert_close(got, hf_mixtral((x * noise) @ r.weight.t(), 2), D)


# --- experts -------------------------------------------------------------------------------------


def _gpt_oss_expert(x, gate_up, gate_up_b, down, down_b, limit=7.0, alpha=1.702):
    h = x @ gate_up + gate_up_b
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return ((up + 1) * glu) @ down + down_b


def _run_experts(mlp, x, counts, probs):
    """The float32 experts on float64 data (the reference stays in float64)."""
    return mlp(x.float(), torch.tensor(counts), None if probs is None else probs.float())


def test_gpt_oss_experts_from_hugging_face_weights():
    E, H, Fh = 3, 6, 5
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(E, H, 2 * Fh, generator=g, dtype=D) * 2  # large: the clamps matter
    gate_up_b = torch.randn(E, 2 * Fh, generator=g, dtype=D)
    down = torch.randn(E, Fh, H, generator=g, dtype=D)
    down_b = torch.randn(E, H, generator=g, dtype=D)
    mlp = GroupedMLP(E, H, Fh, activation="clamped_swiglu", bias=True, probs_after_fc2=True,
                     backend="reference")
    mlp.load_hf_weights(layout="matmul", gate_up_proj=gate_up, gate_up_proj_bias=gate_up_b,
                        down_proj=down, down_proj_bias=down_b)
    x = torch.randn(7, H, generator=g, dtype=D) * 3
    counts, probs = [3, 0, 4], torch.rand(7, generator=g, dtype=D)
    expert = [0, 0, 0, 2, 2, 2, 2]
    want = torch.stack([
        _gpt_oss_expert(x[i], gate_up[e], gate_up_b[e], down[e], down_b[e]) * probs[i]
        for i, e in enumerate(expert)
    ])
    assert_close(_run_experts(mlp, x, counts, probs), want.float(), torch.float32, atol=1e-4)
    back = mlp.hf_weights(style="stacked_matmul")
    assert torch.equal(back["gate_up_proj"], gate_up.float())
    assert torch.equal(back["down_proj_bias"], down_b.float())


@pytest.mark.parametrize("source", ["stacked", "per_expert"])
def test_mixtral_style_experts_and_round_trip(source):
    E, H, Fh = 3, 6, 4
    g = torch.Generator().manual_seed(4)
    w1 = torch.randn(E, Fh, H, generator=g, dtype=D)  # gate_proj / w1
    w3 = torch.randn(E, Fh, H, generator=g, dtype=D)  # up_proj / w3
    w2 = torch.randn(E, H, Fh, generator=g, dtype=D)  # down_proj / w2
    mlp = GroupedMLP(E, H, Fh, activation="swiglu", backend="reference")
    if source == "stacked":
        mlp.load_hf_weights(gate_up_proj=torch.cat([w1, w3], dim=1), down_proj=w2)
    else:
        mlp.load_hf_weights(gate_proj=list(w1), up_proj=list(w3), down_proj=list(w2))
    x = torch.randn(5, H, generator=g, dtype=D)
    expert = [0, 1, 1, 2, 2]
    want = torch.stack([F.linear(F.silu(F.linear(x[i], w1[e])) * F.linear(x[i], w3[e]), w2[e])
                        for i, e in enumerate(expert)])
    assert_close(_run_experts(mlp, x, [1, 2, 2], None), want.float(), torch.float32, atol=1e-4)
    per = mlp.hf_weights(style="per_expert")
    assert torch.equal(per["gate_proj"], w1.float()) and torch.equal(per["up_proj"], w3.float())
    assert torch.equal(mlp.hf_weights()["gate_up_proj"], torch.cat([w1, w3], dim=1).float())
    w1b, w2b, _, _ = hf_to_grouped(**grouped_to_hf(mlp.weight1.detach(), mlp.weight2.detach()))
    assert torch.equal(w1b, mlp.weight1.detach()) and torch.equal(w2b, mlp.weight2.detach())


def test_relu2_experts_and_tp_shards():
    E, H, Fh = 2, 4, 6
    g = torch.Generator().manual_seed(5)
    full = GroupedMLP(E, H, Fh, activation="relu2", bias=True, backend="reference")
    w = {n: p.detach().double() for n, p in full.named_parameters()}
    x = torch.randn(5, H, generator=g, dtype=D)
    counts, probs = [2, 3], torch.rand(5, generator=g, dtype=D)
    expert = [0, 0, 1, 1, 1]
    want = torch.stack([
        (F.relu(x[i] @ w["weight1"][e] + w["bias1"][e]) ** 2 * probs[i]) @ w["weight2"][e]
        + w["bias2"][e]
        for i, e in enumerate(expert)
    ]).float()
    assert_close(_run_experts(full, x, counts, probs), want, torch.float32, atol=1e-5)
    # Three expert-TP shards: partial outputs sum to the full one (bias2 once).
    parts = []
    for rank in range(3):
        shard = GroupedMLP(E, H, Fh, activation="relu2", bias=True, backend="reference",
                           tp_size=3, tp_rank=rank)
        shard.load_full_weights(full.weight1.detach(), full.weight2.detach(),
                                full.bias1.detach(), full.bias2.detach())
        parts.append(_run_experts(shard, x, counts, probs))
    assert_close(sum(parts), want, torch.float32, atol=1e-5)


# --- whole blocks: Qwen2-MoE-like (gated shared expert) and DeepSeek-V3-like ----------------------


def _hf_block(x, routing, w1, w3, w2, shared, shared_gate):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e in routing[t].nonzero().flatten().tolist():
            h = F.silu(F.linear(x[t], w1[e])) * F.linear(x[t], w3[e])
            y[t] += routing[t, e] * F.linear(h, w2[e])
    sg, su, sd = shared
    s = F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
    if shared_gate is not None:
        s = torch.sigmoid(F.linear(x, shared_gate)) * s
    return y + s


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_hf_like_block(family):
    E, H, Fh, Fs, k = 8, 8, 4, 6, 3
    g = torch.Generator().manual_seed(6)
    w1, w3 = (torch.randn(E, Fh, H, generator=g, dtype=D) for _ in range(2))
    w2 = torch.randn(E, H, Fh, generator=g, dtype=D)
    shared = (torch.randn(Fs, H, generator=g, dtype=D), torch.randn(Fs, H, generator=g, dtype=D),
              torch.randn(H, Fs, generator=g, dtype=D))
    router_w = torch.randn(E, H, generator=g, dtype=D)
    if family == "qwen2_moe":
        kw = dict(pre_softmax=True, norm_topk_prob=False, shared_expert_gate=True)
        gate = torch.randn(1, H, generator=g, dtype=D)
    else:
        kw = dict(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2,
                  group_score="top2", norm_topk_prob=True, scaling_factor=2.5)
        gate = None
    layer = MoELayer(H, Fh, E, k, activation="swiglu", shared_expert_intermediate_size=Fs,
                     backend="reference", params_dtype=D, router_dtype=D, **kw)
    layer.experts.load_hf_weights(gate_proj=w1, up_proj=w3, down_proj=w2)
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
        layer.shared_experts.linear_fc1.weight.copy_(torch.cat(shared[:2]))
        layer.shared_experts.linear_fc2.weight.copy_(shared[2])
        if gate is not None:
            layer.shared_experts.gate_weight.copy_(gate)
        else:
            layer.router.expert_bias.copy_(torch.rand(E, generator=g) * 0.3)
    x = torch.randn(10, H, generator=g, dtype=D)
    logits = x @ router_w.t()
    if family == "qwen2_moe":
        routing = hf_qwen_moe(logits, k, False)
    else:
        routing = hf_deepseek_v3(logits, k, layer.router.expert_bias.double(), 4, 2, True, 2.5)
    xs = x.to(torch.float32)
    layer32 = layer.to(torch.float32)
    want = _hf_block(x, routing, w1, w3, w2, shared, gate)
    assert_close(layer32(xs), want.float(), torch.float32, atol=1e-4)


# --- torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_compile_fullgraph_forward_backward(capacity_factor):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, 2, capacity_factor=capacity_factor, aux_loss_coeff=0.01,
                     z_loss_coeff=0.001, activation="swiglu", shared_expert_intermediate_size=8,
                     shared_expert_gate=True)
    x = torch.randn(8, 16, requires_grad=True)
    grad = torch.randn(8, 16)
    explain = torch._dynamo.explain(layer)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    (y * grad).sum().backward()
    got = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    y_eager = layer(x)
    (y_eager * grad).sum().backward()
    want = [p.grad for p in layer.parameters()] + [x.grad]
    assert_close(y, y_eager, torch.float32)
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32)


# --- bad values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(norm_topk_prob="yes"), TypeError, "norm_topk_prob"),
        (dict(norm_topk_prob=False), ValueError, "norm_topk_prob=False"),
        (dict(group_score="top3", num_groups=2, group_topk=1), ValueError, "group_score"),
        (dict(load_balancing_type="switch"), ValueError, "load_balancing_type"),
        (dict(load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[0.1, 0.2, 0.3]),
         ValueError, "aux_loss_coeff"),
        (dict(aux_loss_coeff=float("nan")), ValueError, "aux_loss_coeff"),
        (dict(z_loss_coeff=float("inf")), ValueError, "z_loss_coeff"),
        (dict(z_loss_coeff="0.1"), TypeError, "z_loss_coeff"),
        (dict(input_jitter_eps=1.5), ValueError, "input_jitter_eps"),
        (dict(scaling_factor=float("inf")), ValueError, "scaling_factor"),
        (dict(capacity_factor=float("inf")), ValueError, "capacity_factor"),
        (dict(layer_number=1), ValueError, "layer_number"),
        (dict(layer_number=4, num_layers=3), ValueError, "layer_number"),
        (dict(params_dtype=torch.int32), TypeError, "params_dtype"),
    ],
)
def test_bad_router_and_layer_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        TopKRouter(8, 4, 2, **kwargs)
    with pytest.raises(error, match=match):
        MoELayer(8, 8, 4, 2, **kwargs)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(token_dispatcher_type="a2a"), ValueError, "token_dispatcher_type"),
        (dict(shared_expert_gate=True), ValueError, "shared_expert_intermediate_size"),
        (dict(shared_expert_intermediate_size=0), ValueError, "shared_expert_intermediate_size"),
        (dict(activation="silu"), ValueError, "activation"),
        (dict(activation="clamped_swiglu", activation_limit=-1.0), ValueError, "activation_limit"),
        (dict(sequence_parallel=1), TypeError, "sequence_parallel"),
        (dict(check_ranks="yes"), TypeError, "check_ranks"),
        (dict(ffn_hidden_size=0), ValueError, "ffn_hidden_size"),
    ],
)
def test_bad_layer_only_options(kwargs, error, match):
    args = dict(hidden_size=8, ffn_hidden_size=8, num_experts=4, topk=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        MoELayer(args.pop("hidden_size"), args.pop("ffn_hidden_size"), args.pop("num_experts"),
                 args.pop("topk"), **args)


def test_bad_inputs_and_expert_options():
    router = TopKRouter(8, 4, 2)
    with pytest.raises(TypeError, match="floating-point"):
        router(torch.ones(3, 8, dtype=torch.int64))
    assert router.weight.dtype == torch.float32  # not cast
    with pytest.raises(TypeError, match="padding_mask"):
        router(torch.randn(3, 8), padding_mask=torch.zeros(3))
    with pytest.raises(ValueError, match="padding_mask"):
        router(torch.randn(3, 8), padding_mask=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq_aux_loss"):
        seq = TopKRouter(8, 4, 2, aux_loss_coeff=0.1, load_balancing_type="seq_aux_loss")
        seq(torch.randn(3, 8))
    with pytest.raises(ValueError, match="tp_size"):
        GroupedMLP(2, 4, 6, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank"):
        GroupedMLP(2, 4, 6, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="down_proj"):
        hf_to_grouped(gate_up_proj=torch.zeros(2, 8, 4))
    with pytest.raises(ValueError, match="layout"):
        hf_to_grouped(
            layout="rows", gate_up_proj=torch.zeros(2, 8, 4), down_proj=torch.zeros(2, 4, 4)
        )
    with pytest.raises(ValueError, match="output features"):
        hf_to_grouped(gate_up_proj=torch.zeros(2, 6, 4), down_proj=torch.zeros(2, 4, 4))


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda: MoEWorkspace(4, 8, 4, 2, dtype=torch.int32), TypeError, "dtype"),
        (lambda: MoEWorkspace(4, 8, 4, 2, probs_dtype=torch.int32), TypeError, "probs_dtype"),
        (lambda: MoEWorkspace(4, 8, 4, 2, device="nope"), ValueError, "device"),
        (lambda: MoEWorkspace(4, 8, 4, 2, capacity_factor="1"), TypeError, "capacity_factor"),
        (lambda: MoEWorkspace(4, 8, 4, 2, capacity_factor=float("nan")), ValueError,
         "capacity_factor"),
        (lambda: TopKRouter(8, 4, 2, device="nope"), ValueError, "device"),
        (lambda: TopKRouter(8, 4, 2, pre_softmax="no"), TypeError, "pre_softmax"),
        (lambda: TopKRouter(8, 4, 2, expert_bias=1), TypeError, "expert_bias"),
        (lambda: TopKRouter(8, 4, 2, init_std=float("nan")), ValueError, "init_std"),
        (lambda: MoELayer(8, 8, 4, 2, backend="nope"), ValueError, "backend"),
        (lambda: MoELayer(8, 8, 4, 2, ep_group="world"), TypeError, "ep_group"),
        (lambda: MoELayer(8, 8, 4, 2, bias="yes"), TypeError, "bias"),
        (lambda: MoELayer(8, 8, 4, 2, device="nope"), ValueError, "device"),
    ],
)
def test_constructor_arguments_named_in_errors(build, error, match):
    with pytest.raises(error, match=match):
        build()
