"""``parallelize_hf``: a Hugging Face causal LM split over ``mtp.parallel``'s tensor-parallel
group in place (the plans per family; the public entry is :mod:`mtp.integrations.hf`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtp.tensor_parallel.parallelize import parallelize
from mtp.tensor_parallel.utils import (
    group_rank_and_size,
    mark_sequence_parallel_parameters,
    pad_vocab_size,
)

from .hf_state import _INFO, _num_experts, attach_hf_state

__all__ = ["SUPPORTED_FAMILIES", "parallelize_hf"]

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
SUPPORTED_FAMILIES = (*_LLAMA_LIKE, "deepseek_v3", "gpt2")


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------


def _llama_plan(model: nn.Module, sp: bool, mla: bool = False) -> dict:
    """``mla`` (DeepSeek-V3's multi-head latent attention): the per-head projections
    (``q_proj`` or ``q_b_proj``, ``kv_b_proj``) are column-parallel, ``o_proj`` row-parallel;
    the latent down-projections and their norms stay replicated (see :func:`_mla_params`)."""
    lin = {"sequence_parallel": sp, "seq_dim": 1}
    hook = {"style": "shared_input", "sequence_parallel": sp, "seq_dim": 1}
    column = ("q_proj", "k_proj", "v_proj")
    if mla:
        names = {n.rpartition(".")[2] for n, _ in model.named_modules()}
        column = tuple(c for c in ("q_proj", "q_b_proj", "kv_b_proj") if c in names)
    plan = {"*.embed_tokens": "vocab", "*.self_attn": hook}
    for c in column:
        plan[f"*.self_attn.{c}"] = {"style": "column", **lin}
    plan["*.self_attn.o_proj"] = {"style": "row", **lin}
    # dense MLPs only (an MoE model may have some, e.g. Qwen3-MoE's mlp_only_layers)
    mlps = [
        n for n, m in model.named_modules() if isinstance(getattr(m, "gate_proj", None), nn.Linear)
    ]
    for name in mlps:
        plan[name] = hook
        plan[f"{name}.gate_proj"] = {"style": "column", **lin}
        plan[f"{name}.up_proj"] = {"style": "column", **lin}
        plan[f"{name}.down_proj"] = {"style": "row", **lin}
    if sp:
        # The embedding's output stays full length (HF builds the mask and positions from it);
        # the first block enters the sequence-parallel region.
        plan["*.layers.0"] = {"style": "scatter_sequence", "seq_dim": 1}
    _add_lm_head(model, plan, sp)
    return plan


def _gpt2_plan(model: nn.Module, sp: bool) -> dict:
    if sp:
        raise NotImplementedError(
            "parallelize_hf: sequence_parallel=True is not supported for GPT-2 (its model "
            "reshapes the final hidden states with the full sequence length); use "
            "sequence_parallel=False"
        )
    hook = {"style": "shared_input"}
    plan = {
        "*.wte": "vocab",
        "*.attn": hook,
        "*.attn.c_attn": {"style": "column", "stride": 3},
        "*.attn.c_proj": "row",
        "*.mlp": hook,
        "*.mlp.c_fc": "column",
        "*.mlp.c_proj": "row",
    }
    _add_lm_head(model, plan, sp)
    return plan


def _add_lm_head(model: nn.Module, plan: dict, sp: bool) -> None:
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan["lm_head"] = [
            {"style": "column", "gather_output": True},
            {"style": "shared_input", "sequence_parallel": sp, "seq_dim": 1},
        ]


# --------------------------------------------------------------------------------------------
# Preparation and patches
# --------------------------------------------------------------------------------------------


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _convert_conv1d(model: nn.Module) -> list[str]:
    """Replace every transformers ``Conv1D`` (weight ``[in, out]``) by an ``nn.Linear``."""
    names = [n for n, m in model.named_modules() if n and _is_conv1d(m)]
    for name in names:
        conv = model.get_submodule(name)
        w = conv.weight
        linear = nn.Linear(conv.nx, conv.nf, bias=conv.bias is not None)
        linear = linear.to(dtype=w.dtype, device=w.device)
        with torch.no_grad():
            linear.weight.copy_(w.t())
            if conv.bias is not None:
                linear.bias.copy_(conv.bias)
        linear.weight.requires_grad_(w.requires_grad)
        linear.train(conv.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
    return names


def _check_sizes(config, tp: int, moe: bool) -> None:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    kv = getattr(config, "num_key_value_heads", None) or heads
    sizes = {"num_attention_heads": heads, "vocab_size": config.vocab_size}
    if config.model_type != "deepseek_v3":  # latent attention: the kv latent is not split
        sizes["num_key_value_heads"] = kv
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    if moe:
        sizes["experts"] = getattr(config, "num_local_experts", None) or config.num_experts
    elif inter:
        sizes["intermediate_size"] = inter
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(
                f"parallelize_hf: config.{name} ({value}) must be divisible by tp ({tp}); "
                + _size_hint(name, value, tp)
            )


def _size_hint(name: str, value: int, tp: int) -> str:
    """What to change when ``config.<name>`` does not divide by ``tp``."""
    if name == "vocab_size":
        padded = pad_vocab_size(value, tp)
        return (
            f"pad the vocabulary first, e.g. to mtp.tensor_parallel.pad_vocab_size({value}, "
            f"{tp}) = {padded} rows: model.resize_token_embeddings({padded}) (the extra ids "
            "are never targets), then call parallelize_hf"
        )
    if name == "num_key_value_heads":
        return "choose a tp that divides it (key/value heads are not replicated)"
    return "choose a tp that divides it"


def _patch_gpt2_attention(model: nn.Module, tp: int) -> None:
    for module in model.modules():
        if hasattr(module, "split_size") and hasattr(module, "c_attn"):
            module.split_size //= tp
            module.num_heads //= tp
            module.embed_dim //= tp


def _patch_llama_attention(model: nn.Module, tp: int) -> None:
    """Per-rank head counts on attention modules that keep them (older transformers releases
    reshape with ``self.num_heads``; 5.x reads ``-1`` from the tensors and has none of these)."""
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            for name in ("num_heads", "num_key_value_heads", "hidden_size"):
                if isinstance(getattr(module, name, None), int):
                    setattr(module, name, getattr(module, name) // tp)


def _sum_grads_over_group(params, group) -> None:
    """Replicated parameters that see only part of the work on each rank (Qwen3's per-head
    q_norm / k_norm, a router that sees this rank's share of the tokens): a gradient hook sums
    their gradients over the group."""

    def reduce(grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=group)
        return grad

    for p in params:
        p.sequence_parallel = False  # not a sequence-parallel parameter: reduced here
        if p.requires_grad:
            p.register_hook(reduce)


def _head_norm_params(model: nn.Module):
    for name, module in model.named_modules():
        if name.endswith(("self_attn.q_norm", "self_attn.k_norm")):
            yield from module.parameters(recurse=False)


_MLA_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


def _mla_params(model: nn.Module):
    """DeepSeek-V3's replicated latent projections and norms: each rank back-propagates only
    its heads' share into them (their gradients are summed over tp; the attention input's
    gradient by the shared entry's all-reduce)."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in _MLA_REPLICATED and ".self_attn." in f".{name}":
            yield from module.parameters(recurse=False)


def _refuse_ddp_over_tp_peers(model: nn.Module, args) -> None:
    """Forward pre-hook of a parallelized model: fail when ``torch.nn.parallel
    .DistributedDataParallel`` runs it over a group holding tensor-parallel peers (what a plain
    ``transformers.Trainer`` / ``accelerate`` does under torchrun: its first broadcast
    overwrote the other ranks' shards, and it would average shards of different weights and
    feed each tensor-parallel rank different data). Costs no collective."""
    ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    group = getattr(model, _INFO)["group"]
    if ddp is None or group is None or dist.get_world_size(group) == 1:
        return
    if ddp.module is not model and not any(m is model for m in ddp.module.modules()):
        return
    ddp_ranks = set(dist.get_process_group_ranks(ddp.process_group or dist.group.WORLD))
    peers = ddp_ranks & set(dist.get_process_group_ranks(group))
    if len(peers) > 1:
        raise RuntimeError(
            "this model was tensor-parallelized by mtp (parallelize_hf / apply_kernels) but is run "
            "by torch.nn.parallel.DistributedDataParallel over a group that holds its "
            f"tensor-parallel peers (ranks {sorted(peers)}): the weight shards were overwritten "
            "by rank 0's and every rank would get different data. Use "
            "mtp.integrations.hf.Trainer instead of transformers.Trainer (it data-parallelizes "
            "over the data-parallel group only), or mtp.optim.DistributedDataParallel"
        )


# --------------------------------------------------------------------------------------------
# parallelize_hf
# --------------------------------------------------------------------------------------------


def expert_group(ep: int, caller: str, tp_group=None):
    """``mtp.parallel``'s expert-parallel group, which must have ``ep`` ranks; with
    ``tp_group`` (experts over whole tensor-parallel groups) it must also hold ``tp_group`` and
    have no expert tensor parallelism. ``caller`` starts the error messages."""
    from mtp import parallel

    etp_arg = "" if tp_group is None else ", expert_tensor_parallel_size=1"
    if not parallel.model_parallel_is_initialized():
        raise ValueError(
            f"{caller}: ep={ep} needs mtp.parallel.initialize_model_parallel("
            f"expert_model_parallel_size={ep}{etp_arg}) first (the experts are split over its "
            "expert-parallel group)"
        )
    group = parallel.get_expert_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    if tp_group is None:
        if len(ranks) != ep:
            raise ValueError(
                f"{caller}: ep={ep} but mtp.parallel's expert-parallel group has {len(ranks)} "
                "ranks (initialize_model_parallel(expert_model_parallel_size=...))"
            )
        return group
    tp_ranks = dist.get_process_group_ranks(tp_group)
    etp = parallel.get_expert_tensor_parallel_world_size()
    if len(ranks) != ep or etp != 1 or not set(tp_ranks) <= set(ranks):
        raise ValueError(
            f"{caller}: ep={ep} needs mtp.parallel's expert-parallel group to have {ep} "
            f"ranks, hold the tensor-parallel group {tp_ranks} and no expert tensor "
            f"parallelism; it is {ranks} with expert tensor parallel size {etp} "
            f"(initialize_model_parallel(expert_model_parallel_size={ep}{etp_arg}))"
        )
    return group


def parallelize_hf(
    model: nn.Module,
    tp: int | None = None,
    *,
    group=None,
    sequence_parallel: bool = False,
    ep: int | None = None,
) -> nn.Module:
    """Tensor-parallelise a ``transformers`` model in place and return it.

    Args:
        model: a ``PreTrainedModel`` of a supported family (:data:`SUPPORTED_FAMILIES`), with
            the same weights on every rank (same seed, or load a checkpoint afterwards with
            :func:`load_hf_state_dict`). fp32/fp16/bf16.
        tp: the expected tensor-parallel size (checked against the group); None: the group's.
        group: the tensor-parallel group, a 1-D ``DeviceMesh`` or ``mesh["tp"]`` (default:
            :func:`mtp.parallel.initialize_model_parallel`'s).
        sequence_parallel: Megatron sequence parallelism between the blocks (Llama-like
            families; the sequence length must divide by tp; not for ``generate()``).
        ep: expert parallelism, for MoE families (Mixtral, Qwen2/3-MoE, DeepSeek-V3). None or
            tp: the experts are split over the tensor-parallel group. A multiple of tp: over
            ``mtp.parallel``'s expert-parallel group of that size (tensor- and data-parallel
            ranks; ``initialize_model_parallel(expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1)`` first), each tensor-parallel group routing its
            share of the tokens to every expert of the group.

    Raises:
        ValueError: an unsupported family, sizes that do not divide by tp, ``tp`` different
            from the group size.
        NotImplementedError: ``sequence_parallel=True`` for ``gpt2``.
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"parallelize_hf: model_type {family!r} is not supported; supported: "
            f"{SUPPORTED_FAMILIES} (other models: mtp.tensor_parallel.parallelize with a plan)"
        )
    moe = family in _MOE
    if ep not in (None, 1) and not moe:
        raise ValueError(
            f"parallelize_hf: ep={ep} needs a mixture-of-experts family; {family!r} is dense"
        )
    group, _, world = group_rank_and_size(group)
    if moe and ep not in (None, world) and (not isinstance(ep, int) or ep % world):
        raise ValueError(
            f"parallelize_hf: {family!r} splits its experts over whole tensor-parallel groups: "
            f"ep must be None, tp ({world}) or a multiple of it, got {ep}"
        )
    if tp is not None and tp != world:
        raise ValueError(f"parallelize_hf: tp={tp} but the tensor-parallel group has {world} ranks")
    if hasattr(model, _INFO):
        raise ValueError("parallelize_hf: this model is already parallelized")
    _check_sizes(config, world, moe)
    if family == "gpt2":  # before any change to the model: it raises for sequence parallel
        plan = _gpt2_plan(model, sequence_parallel)
    conv1d = _convert_conv1d(model) if family == "gpt2" else []
    renames = {}
    if moe:  # before the plan: the shared experts' gate_proj must not be taken for dense MLPs
        from .hf_moe import swap_moe_blocks

        ep_group = group if ep in (None, world) else expert_group(ep, "parallelize_hf", group)
        renames = swap_moe_blocks(model, ep_group, sequence_parallel=sequence_parallel,
                                  tp_group=group)  # fmt: skip
        if not sequence_parallel:  # router and shared expert see this rank's share of tokens
            replicated = [
                model.get_parameter(n)
                for n, (_, k) in renames.items()
                if k in ("router", "shared", "fc1")
            ]
            _sum_grads_over_group(replicated, group)
    if family != "gpt2":
        plan = _llama_plan(model, sequence_parallel, mla=family == "deepseek_v3")
    parallelize(model, plan, group)
    if family == "gpt2":
        _patch_gpt2_attention(model, world)
    elif family != "deepseek_v3":  # (DeepSeek-V3 reshapes with -1 heads)
        _patch_llama_attention(model, world)
    _sum_grads_over_group(list(_head_norm_params(model)), group)  # Qwen3's per-head norms
    _sum_grads_over_group(list(_mla_params(model)), group)  # DeepSeek-V3's latent projections
    if sequence_parallel:
        mark_sequence_parallel_parameters(
            p for p in model.parameters() if getattr(p, "sequence_parallel", None) is None
        )
    info = {"group": group, "family": family, "conv1d": set(conv1d), "renames": renames}
    info["num_experts"] = _num_experts(config)
    info["ep_group"] = ep_group if moe else None
    attach_hf_state(model, info)  # the model's state dict speaks HF's names and layouts
    model.register_forward_pre_hook(_refuse_ddp_over_tp_peers, with_kwargs=False)
    return model

