"""Hugging Face MoE families through mtp.integrations.hf keep HF's routing and router outputs:

- DeepSeek-V3 (several ``num_experts_per_tok`` / ``n_group`` / ``topk_group`` combinations, with
  ``num_experts_per_tok / topk_group`` other than 2, ``norm_topk_prob`` True and False,
  ``routed_scaling_factor``), Mixtral and Qwen2/3-MoE (``norm_topk_prob`` both ways): the
  swapped router's logits, chosen experts and weights equal HF's router on fresh inputs, in a
  float64 and a bf16 model (HF computes DeepSeek-V3's router in float32 with a float32 weight
  whatever the model's dtype), and the model's loss and logits equal HF's (float64 reference);
- ``output_router_logits=True`` (call or config): ``parallelize_hf`` (tp=1 and tp=2, with and
  without sequence parallelism) and ``apply_kernels`` return HF's ``router_logits`` and
  ``aux_loss`` and the same loss and router gradient (OLMoE, which mtp does not swap, keeps its
  aux loss under ``apply_kernels``; DeepSeek-V3 has no aux loss in HF: the logits only)."""

from __future__ import annotations

import copy

import pytest
import torch

from mtp.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 64, 32
COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4,
    num_hidden_layers=2, intermediate_size=48, max_position_embeddings=64,
    attn_implementation="eager", experts_implementation="eager",
)
#: DeepSeek-V3 routings: (num_experts_per_tok, n_group, topk_group, norm_topk_prob, scaling)
DEEPSEEK = [(4, 4, 1, True, 2.5), (6, 4, 2, False, 1.0), (3, 4, 2, True, 1.0),
            (8, 8, 4, False, 2.5), (2, 1, 1, False, 1.5)]  # fmt: skip


def _config(family: str, **kw):
    if family == "deepseek_v3":
        topk, n_group, topk_group, norm, scale = kw.pop("routing", DEEPSEEK[0])
        return transformers.DeepseekV3Config(
            n_routed_experts=16, num_experts_per_tok=topk, n_group=n_group,
            topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale,
            moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, **COMMON, **kw,
        )  # fmt: skip
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                          router_aux_loss_coef=0.05, **COMMON, **kw)
    if family == "olmoe":
        return transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2,
                                        router_aux_loss_coef=0.02, **COMMON, **kw)
    cls = transformers.Qwen2MoeConfig if family == "qwen2_moe" else transformers.Qwen3MoeConfig
    extra = dict(shared_expert_intermediate_size=24) if family == "qwen2_moe" else {}
    return cls(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
               router_aux_loss_coef=0.02, **extra, **COMMON, **kw)  # fmt: skip


def _model(family: str, dtype=torch.float32, seed: int = 0, **kw):
    """A tiny model whose routers have trained-like logits (weights of std 1/sqrt(H), not HF's
    0.02) and, for DeepSeek-V3, a nonzero ``e_score_correction_bias``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **kw), dtype=dtype)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("gate.weight"):
                t.copy_(torch.randn(t.shape) / HIDDEN**0.5)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.3)
    return model.train()


def _sparse_blocks(model):
    """The MoE blocks: HF's (with a ``gate``) or the swapped ones (with a ``router``)."""
    return [layer.mlp for layer in model.model.layers
            if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")]  # fmt: skip


def _err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


ROUTERS = [("deepseek_v3", dict(routing=r)) for r in DEEPSEEK] + [
    ("mixtral", {}), ("qwen2_moe", dict(norm_topk_prob=False)),
    ("qwen3_moe", dict(norm_topk_prob=True)), ("qwen3_moe", dict(norm_topk_prob=False)),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("family,kw", ROUTERS)
def test_swapped_router_chooses_hf_experts_and_weights(family, kw, dtype):
    from mtp.integrations.hf import apply_kernels

    ref = _model(family, dtype, **kw)
    ours = apply_kernels(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    for hf_block, block in zip(_sparse_blocks(ref), _sparse_blocks(ours), strict=True):
        router = block.router
        assert router.weight.dtype == hf_block.gate.weight.dtype  # DeepSeek-V3: float32
        x = torch.randn(512, HIDDEN, generator=g).to(dtype)
        with torch.no_grad():
            hf_logits, hf_weights, hf_idx = hf_block.gate(x)
            logits = router.gating(x)
            probs, routing_map = router(x)
        assert logits.dtype == hf_logits.dtype and torch.equal(logits, hf_logits)
        hf_map = torch.zeros_like(routing_map).scatter(1, hf_idx, True)
        assert torch.equal(routing_map, hf_map), (routing_map != hf_map).any(1).sum()
        weights = probs.gather(1, hf_idx)
        # HF's softmax / sigmoid runs in float32 (in a float64 model too); the same sums in
        # another order, rounded to the coarsest of the dtypes involved
        coarse = min((weights.dtype, hf_weights.dtype, torch.float32),
                     key=lambda d: torch.finfo(d).bits)  # fmt: skip
        eps = torch.finfo(coarse).eps
        torch.testing.assert_close(weights.double(), hf_weights.double(), rtol=4 * eps, atol=0)


@pytest.mark.parametrize("routing", DEEPSEEK)
def test_deepseek_v3_model_equals_hf(routing):
    """Loss and eval logits of ``apply_kernels`` against the float64 HF model, within a small
    multiple of HF's own float32 error."""
    from mtp.integrations.hf import apply_kernels

    ref32 = _model("deepseek_v3", routing=routing)
    ref64 = copy.deepcopy(ref32).double()
    ours = apply_kernels(copy.deepcopy(ref32))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    for mode in ("train", "eval"):
        o32, o64, o = (m.train(mode == "train")(input_ids=ids, labels=ids)
                       for m in (ref32, ref64, ours))  # fmt: skip
        ulps = 8 * torch.finfo(torch.float32).eps * float(o64.loss.detach().abs())
        assert _err(o.loss, o64.loss) <= 4 * _err(o32.loss, o64.loss) + ulps, mode
        if mode == "eval":
            scale = float(o64.logits.detach().abs().max())
            bound = 4 * _err(o32.logits, o64.logits) + 1e-6 * scale
            assert _err(o.logits, o64.logits) <= bound


# --- output_router_logits ---------------------------------------------------------------------


def _router_case(family: str, path: str, tp: int, sp: bool, via_config: bool) -> dict:
    from mtp.integrations.hf import apply_kernels, hf_state_dict, parallelize_hf
    from mtp.tensor_parallel import allreduce_sequence_parallel_grads

    kw = dict(output_router_logits=True) if via_config else {}
    ref = _model(family, **kw)
    if path == "apply_kernels":
        ours = apply_kernels(copy.deepcopy(ref), tp=tp, sequence_parallel=sp)
    else:
        ours = parallelize_hf(copy.deepcopy(ref), tp=tp, sequence_parallel=sp)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # HF's aux loss leaves padding out
    call = {} if via_config else dict(output_router_logits=True)
    o_ref = ref(input_ids=ids, attention_mask=mask, labels=ids, **call)
    o = ours(input_ids=ids, attention_mask=mask, labels=ids, **call)
    o_ref.loss.backward()
    o.loss.backward()
    if sp:
        allreduce_sequence_parallel_grads(ours)
    grads = hf_state_dict(ours, grads=True)
    gates = [n for n, _ in ref.named_parameters() if n.endswith("mlp.gate.weight")]
    ref_grads = dict(ref.named_parameters())
    return dict(
        loss=_err(o.loss, o_ref.loss),
        aux=None if o_ref.aux_loss is None else _err(o.aux_loss, o_ref.aux_loss),
        aux_none=o.aux_loss is None,
        layers=(len(o.router_logits), len(o_ref.router_logits)),
        logits=max(_err(a, b) for a, b in zip(o.router_logits, o_ref.router_logits)),
        gate_grad=max(_err(grads[n], ref_grads[n].grad) for n in gates),
    )


def _router_worker(rank, world, cases):
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    return {case: _router_case(*case) for case in cases}


ROUTER_CASES = [
    (family, path, 1, False, via_config)
    for family in ("mixtral", "qwen2_moe", "deepseek_v3")
    for path in ("parallelize_hf", "apply_kernels")
    for via_config in (False, True)
] + [("olmoe", "apply_kernels", 1, False, True)]
TP2_CASES = [("mixtral", "parallelize_hf", 2, False, False), ("qwen2_moe", "parallelize_hf", 2,
             True, True), ("deepseek_v3", "parallelize_hf", 2, False, False)]  # fmt: skip


@pytest.mark.parametrize("world,cases", [(1, ROUTER_CASES), (2, TP2_CASES)], ids=["tp1", "tp2"])
def test_output_router_logits_equal_hf(world, cases):
    for result in run_distributed(_router_worker, world, cases, timeout=300):
        for case, r in result.items():
            assert r["layers"][0] == r["layers"][1] > 0, (case, r)
            assert r["loss"] <= 1e-5 and r["logits"] <= 1e-5, (case, r)
            assert r["gate_grad"] <= 1e-5, (case, r)
            if case[0] == "deepseek_v3":  # HF's DeepSeek-V3 has no load-balancing loss
                assert r["aux"] is None and r["aux_none"], (case, r)
            else:
                assert r["aux"] is not None and r["aux"] <= 1e-6, (case, r)
