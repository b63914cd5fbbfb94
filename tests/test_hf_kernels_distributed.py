"""mtp.integrations.hf.apply_kernels under gloo: tp=2 (with and without sequence parallelism;
Mixtral with its aux loss, experts over the tensor-parallel group) and ep=2 at tp=1 (experts over
the data-parallel ranks, each rank its own half of the batch) equal the single-process Hugging
Face model; the loss is mtp's vocab-parallel fused linear cross-entropy on the sharded head, so
targets that differ across tensor-parallel ranks fail."""

from __future__ import annotations

import copy

import pytest
import torch

from mtp.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 96, 32


def _model(family: str, seed: int = 0):
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=48, max_position_embeddings=64,
        attn_implementation="eager", experts_implementation="eager",
    )
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                            router_aux_loss_coef=0.05, **common)
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float().train()


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels = ids.clone()
    labels[3, 5:] = -100
    return ids, labels


def _tp_case(rank, family, sp, calls):
    from mtp.integrations.hf import apply_kernels, hf_state_dict
    from mtp.tensor_parallel import allreduce_sequence_parallel_grads

    ref = _model(family)
    ours = apply_kernels(copy.deepcopy(ref), tp=2, ep=2 if family == "mixtral" else 1,
                         sequence_parallel=sp)
    ids, labels = _batch()
    kw = {"output_router_logits": True} if family == "mixtral" else {}
    out_ref = ref(input_ids=ids, labels=labels, **kw)
    out_ref.loss.backward()
    del calls[:]
    out = ours(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    if sp:
        allreduce_sequence_parallel_grads(ours)
    result = {"loss": _rel(out.loss, out_ref.loss), "logits_none": out.logits is None,
              "ce_group_size": calls[:]}
    if family == "mixtral":
        result["aux"] = _rel(out.aux_loss, out_ref.aux_loss)
        result["router_logits"] = max(
            _rel(a, b) for a, b in zip(out.router_logits, out_ref.router_logits)
        )
    grads = hf_state_dict(ours, grads=True)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    result["grad"] = max(_rel(grads[n], ref_grads[n]) for n in grads)
    # targets that differ between the tensor-parallel ranks: the fused loss refuses them
    bad = labels.clone()
    bad[0, 3] = (bad[0, 3] + 1 + rank) % VOCAB  # (position 0 is never a target)
    try:
        ours(input_ids=ids, labels=bad)
        result["mismatch"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is checked by the caller
        result["mismatch"] = str(e)
    return result


def _tp_worker(rank, world):
    from mtp.integrations import hf_kernels
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    calls = []
    real = hf_kernels.linear_cross_entropy

    def counting(*args, **kwargs):
        group = kwargs["group"]
        calls.append(1 if group is None else torch.distributed.get_world_size(group))
        return real(*args, **kwargs)

    hf_kernels.linear_cross_entropy = counting
    cases = [("llama", False), ("llama", True), ("mixtral", False)]
    results = {f"{f}{'-sp' if sp else ''}": _tp_case(rank, f, sp, calls) for f, sp in cases}
    # the Trainer refuses mtp.parallel expert groups that do not match the model's (here the
    # default expert_tensor_parallel_size = tp): the grad norm would skip rank 1's experts
    import tempfile

    from mtp.integrations.hf import Trainer, apply_kernels

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[])
        try:
            Trainer(model=apply_kernels(_model("mixtral"), tp=2, ep=2), args=args)
            results["trainer_groups"] = "no error"
        except ValueError as e:
            results["trainer_groups"] = str(e)
    return results


def test_apply_kernels_tp2_equals_single_process():
    for rank_result in run_distributed(_tp_worker, 2, timeout=300):
        assert "expert_tensor_parallel_size=1" in rank_result.pop("trainer_groups")
        for case, r in rank_result.items():
            assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, (case, r)
            assert r["logits_none"] and r["ce_group_size"] == [2], (case, r)
            assert "target" in r["mismatch"].lower() or "checksum" in r["mismatch"].lower(), (
                case, r["mismatch"])
            if case == "mixtral":
                assert r["aux"] <= 1e-5 and r["router_logits"] <= 1e-5, (case, r)


def _ep_worker(rank, world):
    """Data parallel over 2 ranks with the experts split between them (ep=2, tp=1): each rank
    runs its half of the batch; summed dense gradients (the data-parallel reduction) and the
    expert gradients equal the single-process model on the whole batch (the loss is a sum over
    the global token count, so the ranks' losses add up)."""
    import torch.distributed as dist

    from mtp.integrations.hf import apply_kernels, hf_state_dict, load_hf_state_dict
    from mtp.moe import MoELayer
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    ref = _model("mixtral")
    ours = apply_kernels(copy.deepcopy(ref), ep=world)
    layers = [m for m in ours.modules() if isinstance(m, MoELayer)]
    local = [list(m.local_expert_indices) for m in layers]
    ids, labels = _batch()
    items = (labels[..., 1:] != -100).sum()
    out_ref = ref(input_ids=ids, labels=labels, num_items_in_batch=items)
    out_ref.loss.backward()
    half = slice(2 * rank, 2 * rank + 2)
    out = ours(input_ids=ids[half], labels=labels[half], num_items_in_batch=items)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    for name, p in ours.named_parameters():
        if getattr(p, "allreduce", True):  # dense: the data-parallel sum
            dist.all_reduce(p.grad)
    grads = hf_state_dict(ours, grads=True)
    ref_grads = dict(ref.named_parameters())
    result = {"local": local, "loss": _rel(loss, out_ref.loss)}
    result["grad"] = max(_rel(grads[n], ref_grads[n].grad) for n in grads)
    # load_hf_state_dict gives each rank its own experts' slice
    other = apply_kernels(_model("mixtral", seed=3), ep=world)
    load_hf_state_dict(other, ref.state_dict())
    full = hf_state_dict(other)
    result["load_exact"] = all(torch.equal(v, ref.state_dict()[k]) for k, v in full.items())
    w = layers[0].experts.weight1
    result["slice_exact"] = torch.equal(
        w, ref.model.layers[0].mlp.experts.gate_up_proj[2 * rank: 2 * rank + 2].transpose(1, 2))
    return result


def test_apply_kernels_ep2_tp1_equals_single_process():
    results = run_distributed(_ep_worker, 2, timeout=240)
    for rank, r in enumerate(results):
        assert r["local"] == [[2 * rank, 2 * rank + 1]] * 2, r
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-5, r
        assert r["load_exact"] and r["slice_exact"], r


def _ep_over_tp_worker(rank, world):
    """tp=2 x dp=2 with the experts over all four ranks (ep=4 > tp): each tensor-parallel pair
    runs its half of the batch, each of its ranks routes a share of those tokens to the four
    experts; data-parallel sums of the dense gradients and the expert gradients as they are
    equal the single-process model on the whole batch."""
    import torch.distributed as dist

    from mtp import parallel
    from mtp.integrations.hf import apply_kernels, hf_state_dict, load_hf_state_dict
    from mtp.moe import MoELayer

    parallel.initialize_model_parallel(tensor_model_parallel_size=2,
                                       expert_model_parallel_size=4,
                                       expert_tensor_parallel_size=1)  # fmt: skip
    ref = _model("mixtral")
    ours = apply_kernels(copy.deepcopy(ref), tp=2, ep=4)
    local = [list(m.local_expert_indices) for m in ours.modules() if isinstance(m, MoELayer)]
    ids, labels = _batch()
    items = (labels[..., 1:] != -100).sum()
    out_ref = ref(input_ids=ids, labels=labels, num_items_in_batch=items)
    out_ref.loss.backward()
    dp_group = parallel.get_data_parallel_group()
    dp = dist.get_rank(dp_group)
    half = slice(2 * dp, 2 * dp + 2)
    out = ours(input_ids=ids[half], labels=labels[half], num_items_in_batch=items)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=dp_group)
    for p in ours.parameters():
        if getattr(p, "allreduce", True):  # dense: the data-parallel sum
            dist.all_reduce(p.grad, group=dp_group)
    grads = hf_state_dict(ours, grads=True)
    ref_grads = dict(ref.named_parameters())
    result = {"local": local, "loss": _rel(loss, out_ref.loss), "names": sorted(grads)}
    result["grad"] = max(_rel(grads[n], ref_grads[n].grad) for n in grads)
    other = apply_kernels(_model("mixtral", seed=3), tp=2, ep=4)
    load_hf_state_dict(other, ref.state_dict())
    result["load_exact"] = all(
        torch.equal(v, ref.state_dict()[k]) for k, v in hf_state_dict(other).items())
    return result


def test_apply_kernels_experts_over_tp_and_dp_ranks_equal_single_process():
    """``ep`` independent of ``tp``: experts over tp and dp ranks equal one process."""
    results = run_distributed(_ep_over_tp_worker, 4, timeout=300)
    for rank, r in enumerate(results):
        assert r["local"] == [[rank]] * 2, r
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-5, r
        assert r["load_exact"], r
        assert any("experts" in n for n in r["names"]), r["names"]


def _ep_bad_sizes_worker(rank, world):
    from mtp import parallel
    from mtp.integrations.hf import apply_kernels

    out = {}
    parallel.initialize_model_parallel(tensor_model_parallel_size=2,
                                       expert_model_parallel_size=2,
                                       expert_tensor_parallel_size=1)  # fmt: skip
    for ep in (3, 4):
        try:
            apply_kernels(_model("mixtral"), tp=2, ep=ep)
            out[ep] = "no error"
        except ValueError as exc:
            out[ep] = str(exc)
    return out


def test_apply_kernels_ep_sizes_that_do_not_fit_raise():
    for r in run_distributed(_ep_bad_sizes_worker, 2, timeout=240):
        assert "multiple" in r[3], r[3]
        assert "expert-parallel group to have 4 ranks" in r[4], r[4]
