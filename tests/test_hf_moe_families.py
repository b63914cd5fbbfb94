"""Qwen2-MoE and DeepSeek-V3 through mtp.integrations.hf at tp=2, ep=2 (gloo, fp32, tiny random
configs; DeepSeek-V3 with and without ``q_lora_rank``): loss, logits and every gradient equal the unparallelised HF model, the HF state dict
(shared experts' gate/up/down projections, DeepSeek's ``e_score_correction_bias``) round-trips
exactly, and generate() gives the same greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from mtp.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 128, 32


def _config(case: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64,
        attn_implementation="eager",
    )
    if case.startswith("qwen2_moe"):  # layer 0 sparse (shared expert, gated), layer 1 dense
        return transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, mlp_only_layers=[1],
            norm_topk_prob=case.endswith("norm"), **common,
        )
    # layer 0 dense (first_k_dense_replace), layer 1 MoE: 8 experts in 4 groups, 2 groups kept
    common["num_key_value_heads"] = 4  # HF's latent attention expands to every head
    return transformers.DeepseekV3Config(
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
        norm_topk_prob=not case.endswith("nonorm"), routed_scaling_factor=2.5,
        q_lora_rank=None if case.endswith("nonorm") else 16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        **common,
    )


def _model(case: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(case)).float().train()
    with torch.no_grad():  # HF initialises it to 0: a nonzero bias must steer the selection
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.3)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check(rank, case, sp):
    from mtp.integrations.hf import hf_state_dict, load_hf_state_dict, parallelize_hf
    from mtp.moe import MoELayer
    from mtp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from mtp.tensor_parallel import allreduce_sequence_parallel_grads

    ref = _model(case, 0)
    par = parallelize_hf(copy.deepcopy(ref), tp=2, ep=2, sequence_parallel=sp)
    result = {"swapped": sum(isinstance(m, MoELayer) for m in par.modules())}
    # attention split by heads (DeepSeek-V3: q_proj or q_b_proj, kv_b_proj; o_proj row)
    attn = par.model.layers[0].self_attn
    heads = [getattr(attn, n, None) for n in ("q_proj", "q_b_proj", "k_proj", "kv_b_proj")]
    result["attention_split"] = isinstance(attn.o_proj, RowParallelLinear) and all(
        isinstance(m, ColumnParallelLinear) for m in heads if m is not None
    )
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out = par(input_ids=ids, labels=ids)
    out.loss.backward()
    if sp:
        allreduce_sequence_parallel_grads(par)
    result.update(loss=_rel(out.loss, out_ref.loss), logits=_rel(out.logits, out_ref.logits))
    grads = hf_state_dict(par, grads=True)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    result["grad"] = max(_rel(grads[n], ref_grads[n]) for n in grads)
    full, ref_sd = hf_state_dict(par), ref.state_dict()
    assert set(full) == set(ref_sd), set(full) ^ set(ref_sd)
    result["roundtrip_exact"] = all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)
    other = parallelize_hf(_model(case, 7), tp=2, ep=2, sequence_parallel=sp)
    load_hf_state_dict(other, ref_sd)
    result["load_exact"] = all(torch.equal(v, ref_sd[k]) for k, v in hf_state_dict(other).items())
    if not sp:
        with torch.no_grad():
            ref.eval(), par.eval()
            prompt = ids[:, :4]
            kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones_like(prompt))
            result["generate_equal"] = torch.equal(ref.generate(prompt, **kw),
                                                   par.generate(prompt, **kw))
    return result


def _worker(rank, world, cases):
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    return {f"{c}{'-sp' if sp else ''}": _check(rank, c, sp) for c, sp in cases}


CASES = [("qwen2_moe", False), ("qwen2_moe_norm", True), ("deepseek_v3", False),
         ("deepseek_v3_nonorm", True)]


def test_qwen2_moe_and_deepseek_v3_tp2_ep2_equal_unparallelised():
    for rank_result in run_distributed(_worker, 2, CASES, timeout=240):
        for case, r in rank_result.items():
            assert r["swapped"] == 1 and r["attention_split"], (case, r)
            assert r["loss"] <= 1e-5 and r["logits"] <= 1e-5, (case, r)
            assert r["grad"] <= 1e-5, (case, r)
            assert r["roundtrip_exact"] and r["load_exact"], (case, r)
            if "generate_equal" in r:
                assert r["generate_equal"], (case, r)
