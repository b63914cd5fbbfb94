"""The state dict of a Hugging Face model after mtp.integrations.hf swaps its modules is the HF
one: ``model.state_dict()`` has the HF model's keys, full shapes and values (tp=1, and tp=2 /
ep=2 under gloo, where the shards are gathered), ``save_pretrained`` -> ``from_pretrained``
loads with an empty load report and the same logits, and ``load_state_dict`` takes an HF state
dict or the saved file (each rank keeps its slices); ``accelerate``'s save_state / load_state
and a ``transformers.Trainer`` resume restore the weights and optimizer state. Dense (Llama; Qwen2 with tied embeddings) and MoE (Mixtral,
Qwen2-MoE with its shared expert, DeepSeek-V3 with ``e_score_correction_bias``), through
``apply_kernels`` and ``parallelize_hf``."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from mtp.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _config(family: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=32, max_position_embeddings=32,
        attn_implementation="eager",
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if family == "qwen2_moe":  # layer 0 sparse with a gated shared expert, layer 1 dense
        return transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, mlp_only_layers=[1], **common,
        )  # fmt: skip
    common["num_key_value_heads"] = 4  # layer 0 dense, layer 1 MoE in 2 groups of 2 experts
    return transformers.DeepseekV3Config(
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common,
    )  # fmt: skip


def _model(family: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).float().eval()
    with torch.no_grad():  # HF initialises it to 0: make it a value worth saving
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape))
    return model


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _swap(model, how: str, tp: int):
    from mtp.integrations.hf import apply_kernels, parallelize_hf

    if how == "parallelize_hf":
        return parallelize_hf(model, tp=tp)
    return apply_kernels(model, tp=tp)


def _round_trip(family: str, how: str, tp: int, folder: str) -> dict:
    """Every check on one family; returns what failed (empty: all good)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    ref = _model(family, 0)
    ours = _swap(_model(family, 0), how, tp)
    want = ref.state_dict()
    got = ours.state_dict()
    bad = {}
    if {k: tuple(v.shape) for k, v in got.items()} != {k: tuple(v.shape) for k, v in want.items()}:
        bad["keys"] = sorted(set(got) ^ set(want)) or "shapes"
    elif not all(torch.equal(got[k], want[k]) for k in want):
        bad["values"] = [k for k in want if not torch.equal(got[k], want[k])]
    ours.save_pretrained(folder)  # every rank: the state dict is collective at tp > 1
    if dist.is_initialized():
        dist.barrier()
    loaded, report = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager"
    )
    report = {k: v for k, v in report.items() if v}
    if report:
        bad["load_report"] = report
    if not torch.equal(_logits(loaded.float().eval()), _logits(ref)):
        bad["logits"] = float((_logits(loaded) - _logits(ref)).abs().max())
    # load_state_dict: the HF state dict, and the saved file (the original per-expert format
    # for MoE models) as transformers.Trainer resumes from it
    saved = load_file(os.path.join(folder, "model.safetensors"))
    for name, source in (("load_state_dict", want), ("load_saved_file", saved)):
        other = _swap(_model(family, 7), how, tp)
        result = other.load_state_dict(source, strict=False)
        tied = {"lm_head.weight"} if other.config.tie_word_embeddings else set()
        if result.unexpected_keys or not set(result.missing_keys) <= tied:
            bad[f"{name}_keys"] = result
        reloaded = other.state_dict()
        if not all(torch.equal(reloaded[k], want[k]) for k in want):
            bad[name] = [k for k in want if not torch.equal(reloaded[k], want[k])]
    if not torch.allclose(_logits(other), _logits(ref), rtol=1e-4, atol=1e-5):
        bad["loaded_logits"] = float((_logits(other) - _logits(ref)).abs().max())
    return bad


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_apply_kernels_tp1_state_dict_is_hf_and_round_trips(family, tmp_path):
    assert _round_trip(family, "apply_kernels", 1, str(tmp_path)) == {}


def test_tp1_load_state_dict_reports_missing_keys_under_hf_names():
    from mtp.integrations.hf import apply_kernels

    ours = apply_kernels(_model("qwen2_moe", 0))
    partial = {k: v for k, v in _model("qwen2_moe", 3).state_dict().items() if "layers.0" not in k}
    result = ours.load_state_dict(partial, strict=False)
    assert not result.unexpected_keys, result
    want = {k for k in _model("qwen2_moe", 0).state_dict() if "layers.0" in k}
    assert set(result.missing_keys) == want, set(result.missing_keys) ^ want


def test_tp1_keep_vars_and_safetensors(tmp_path):
    """``keep_vars=True`` gives the live parameters (mtp's names); a safetensors file of the
    state dict loads back with ``load_state_dict``."""
    from safetensors.torch import load_file, save_file

    from mtp.integrations.hf import apply_kernels

    ours = apply_kernels(_model("mixtral", 0))
    live = ours.state_dict(keep_vars=True)
    params = dict(ours.named_parameters())
    assert all(live[n] is p for n, p in params.items())
    path = str(tmp_path / "model.safetensors")
    save_file(ours.state_dict(), path)
    other = apply_kernels(_model("mixtral", 5))
    other.load_state_dict(load_file(path))
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), ours.parameters()))


def _tp2_worker(rank, world, folder):
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    cases = [("llama", "parallelize_hf"), ("qwen2", "apply_kernels"),
             ("mixtral", "apply_kernels"), ("qwen2_moe", "parallelize_hf"),
             ("deepseek_v3", "apply_kernels")]  # fmt: skip
    return {
        f"{family}-{how}": _round_trip(family, how, world, os.path.join(folder, family))
        for family, how in cases
    }


def test_tp2_state_dict_is_full_hf_and_round_trips():
    """At tp=2 (experts over the two ranks) each rank's ``state_dict()`` is the full HF one,
    ``save_pretrained`` from every rank writes a checkpoint ``from_pretrained`` loads, and
    ``load_state_dict`` of a full HF state dict gives each rank its slices."""
    with tempfile.TemporaryDirectory() as folder:
        results = run_distributed(_tp2_worker, 2, folder, timeout=240)
    for rank, result in enumerate(results):
        assert all(not bad for bad in result.values()), (rank, result)


def _trainer(model, out: str):
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
        save_steps=1, save_strategy="steps", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, train_sampling_strategy="sequential", logging_steps=1,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    batch = torch.randint(0, VOCAB, (4, 6), generator=g)
    rows = [{"input_ids": ids, "labels": ids} for ids in batch]
    return transformers.Trainer(model=model, args=args, train_dataset=rows)


def test_tp1_transformers_trainer_checkpoint_resumes_moe(tmp_path):
    """A plain ``transformers.Trainer`` on an ``apply_kernels`` Mixtral: its checkpoint (the
    original per-expert format) resumes into a fresh swapped model with the same weights and
    optimizer state (the run resumed from step 1 ends where the uninterrupted run ends)."""
    from mtp.integrations.hf import apply_kernels

    full = _trainer(apply_kernels(_model("mixtral", 0).train()), str(tmp_path / "a"))
    full.train()
    resumed = _trainer(apply_kernels(_model("mixtral", 4).train()), str(tmp_path / "a"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    want, got = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])
    ]


def test_tp1_accelerate_save_state_load_state_moe(tmp_path):
    """``accelerate``'s ``save_state`` / ``load_state`` on an ``apply_kernels`` Mixtral restore
    the weights (HF names in the file) and the optimizer state."""
    import copy

    accelerate = pytest.importorskip("accelerate")
    from safetensors import safe_open

    from mtp.integrations.hf import apply_kernels

    acc = accelerate.Accelerator(cpu=True)
    model = apply_kernels(_model("mixtral", 0).train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))

    def step():
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()

    step()
    acc.save_state(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(_model("mixtral", 0).state_dict())
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    step()
    acc.load_state(str(tmp_path))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(opt.state_dict()["state"][i]["exp_avg"], s["exp_avg"])
               for i, s in state["state"].items())  # fmt: skip
