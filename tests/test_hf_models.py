"""Hugging Face models through mtp.integrations.hf at tp=2 (gloo; Mixtral also at ep=2): loss
and gradients equal the unparallelised model, the HF state-dict round trip is exact, generate()
gives the same tokens."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from mtp.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, LAYERS, INTER = 128, 32, 4, 2, 64


def _config(family: str):
    common = dict(vocab_size=VOCAB, attn_implementation="eager")
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=64, n_inner=INTER,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )
    if family == "mixtral":
        common.update(num_local_experts=4, num_experts_per_tok=2)
    if family.startswith("qwen3_moe"):  # layer 1 dense (mlp_only_layers), layer 0 sparse
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      mlp_only_layers=[1], norm_topk_prob=family.endswith("norm"))
        family = "qwen3_moe"
    cls = {
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    return cls(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
        num_hidden_layers=LAYERS, intermediate_size=INTER, max_position_embeddings=64,
        tie_word_embeddings=family == "qwen2", **common,
    )


def _model(family: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    return model.float().train()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_family(rank, family, sp):
    from mtp.integrations.hf import hf_state_dict, load_hf_state_dict, parallelize_hf
    from mtp.tensor_parallel import allreduce_sequence_parallel_grads

    ref = _model(family, 0)
    ep = 2 if family in ("mixtral", "qwen3_moe", "qwen3_moe_norm") else None
    par = parallelize_hf(copy.deepcopy(ref), tp=2, ep=ep, sequence_parallel=sp)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out = par(input_ids=ids, labels=ids)
    out.loss.backward()
    if sp:
        allreduce_sequence_parallel_grads(par)
    result = {"loss": _rel(out.loss, out_ref.loss), "logits": _rel(out.logits, out_ref.logits)}
    grads = hf_state_dict(par, grads=True)
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    result["grad"] = max(_rel(grads[n], ref_grads[n]) for n in grads)
    # state dict round trip: exact, and loading the full dict into a differently seeded model
    full = hf_state_dict(par)
    ref_sd = ref.state_dict()
    assert set(full) == set(ref_sd)
    result["roundtrip_exact"] = all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)
    other = parallelize_hf(_model(family, 7), tp=2, ep=ep, sequence_parallel=sp)
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


def _check_errors():
    """Bad configurations fail at once, naming what to change."""
    from mtp.integrations.hf import parallelize_hf

    bad = [
        (dict(tp=4), ValueError, "tp=4"),
        (dict(tp=2, ep=2), ValueError, "ep=2"),
    ]
    for kwargs, error, words in bad:
        with pytest.raises(error, match=words):
            parallelize_hf(_model("llama", 0), **kwargs)
    config = _config("llama")
    config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="num_key_value_heads"):
        parallelize_hf(transformers.AutoModelForCausalLM.from_config(config), tp=2)
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        parallelize_hf(_model("gpt2", 0), tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="not supported"):
        parallelize_hf(transformers.BertModel(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
            intermediate_size=INTER)), tp=2)
    model = parallelize_hf(_model("llama", 0), tp=2)
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_hf(model, tp=2)


def _worker(rank, world, cases, tmp):
    from mtp.integrations.hf import load_hf_state_dict, hf_state_dict, parallelize_hf
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    _check_errors()
    results = {f"{f}{'-sp' if sp else ''}": _check_family(rank, f, sp) for f, sp in cases}
    # safetensors: each rank reads only its slices from a file
    from safetensors.torch import save_file

    ref = _model("llama", 0)
    path = os.path.join(tmp, "model.safetensors")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    torch.distributed.barrier()
    par = parallelize_hf(_model("llama", 3), tp=world)
    load_hf_state_dict(par, path)
    full = hf_state_dict(par)
    results["safetensors_exact"] = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    return results


CASES = [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False),
         ("qwen3", False), ("gpt2", False), ("mixtral", False), ("mixtral", True),
         ("qwen3_moe", False), ("qwen3_moe_norm", True)]


def test_hf_families_tp2_equal_unparallelised():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_worker, 2, CASES, tmp, timeout=300)
    for rank_result in results:
        assert rank_result.pop("safetensors_exact") is True
        for case, r in rank_result.items():
            assert r["loss"] <= 1e-5, (case, r)
            assert r["logits"] <= 1e-5, (case, r)
            assert r["grad"] <= 1e-5, (case, r)
            assert r["roundtrip_exact"] and r["load_exact"], (case, r)
            if "generate_equal" in r:
                assert r["generate_equal"], (case, r)


def _count_worker(rank, world):
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    return {sp: _count_layer(world, sp) for sp in (False, True)}


def _count_layer(world, sp):
    from mtp.integrations.hf import parallelize_hf
    from mtp.testing import count_collectives

    model = parallelize_hf(_model("llama", 0), tp=world, sequence_parallel=sp)
    layer = model.model.layers[1]
    seq = 8
    x = torch.randn(2, seq // world if sp else seq, HIDDEN, requires_grad=True)
    pos = torch.arange(seq)[None].expand(2, -1)
    cos_sin = model.model.rotary_emb(x, pos)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    with count_collectives() as fwd:
        out = layer(x, attention_mask=mask, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
    with count_collectives() as bwd:
        out.sum().backward()
    return fwd.names(), bwd.names()


def test_llama_layer_costs_two_collectives_forward_and_two_backward():
    """Fused siblings: q/k/v and gate/up share one entry into the tensor-parallel region (each
    collective whose shape nothing checked before follows an agreement row)."""
    sp_names = ["all_gather_single"] * 2 + ["reduce_scatter_single"] * 2
    for by_sp in run_distributed(_count_worker, 2, timeout=120):
        fwd, bwd = by_sp[False]
        assert fwd == ["agreement", "all_reduce"] * 2, fwd
        assert bwd == ["agreement", "all_reduce"] * 2, bwd
        # sequence parallel: all-gather into attention / MLP, reduce-scatter out of them
        fwd, bwd = by_sp[True]
        assert sorted(fwd) == ["agreement"] * 4 + sp_names, fwd
        assert sorted(bwd) == sp_names, bwd
