"""Mixture-of-experts blocks of Hugging Face models swapped for :class:`mtp.moe.MoELayer`.

Used by :func:`mtp.integrations.hf.parallelize_hf` for the Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 families: each ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` /
``Qwen3MoeSparseMoeBlock`` / ``DeepseekV3MoE`` becomes an :class:`HFMoEBlock` (a ``MoELayer``
with the family's routing, SwiGLU experts) whose experts are split over the expert-parallel
group: the tensor-parallel group (``ep == tp``) or a larger group of whole tensor-parallel
groups (``ep`` a multiple of ``tp``: experts over tensor- and data-parallel ranks):

- Mixtral, Qwen2/3-MoE with ``norm_topk_prob``: softmax over the top-k logits; without it the
  top-k of the softmax over all experts (``pre_softmax``).
- Qwen2-MoE's ``shared_expert`` (``gate_proj``/``up_proj``/``down_proj``) becomes the layer's
  :class:`~mtp.moe.SharedExpertMLP` (``linear_fc1`` = gate rows then up rows) with
  ``shared_expert_gate`` as its sigmoid gate.
- DeepSeek-V3: sigmoid scores, ``e_score_correction_bias`` -> the router's ``expert_bias``
  buffer (selection only), ``n_group``/``topk_group`` groups scored by their best two
  (``group_score="top2"``, whatever ``num_experts_per_tok / topk_group``), ``norm_topk_prob``,
  ``routed_scaling_factor``, logits in float32 (``router_dtype``) as HF computes them in any
  model dtype; ``shared_experts`` as Qwen2-MoE's, ungated.

The router's weight keeps the dtype of HF's gate weight (DeepSeek-V3's stays float32 in a bf16
model, ``_keep_in_fp32_modules_strict``), so the same experts are chosen.

Router logits: while HF's output capture collects ``router_logits`` (``output_router_logits``
in the call or the config), each block appends its logits in HF's ``[batch * seq, E]`` layout
(gathered over the tensor-parallel group when the ranks route shares of the tokens), as HF's
router would; HF's own forward then returns them and adds its load-balancing loss.

Without sequence parallelism every tensor-parallel rank holds the same tokens; the block keeps
this rank's share of them (split forward, all-gather backward), routes it through the experts
(token all-to-all over the expert-parallel group) and all-gathers the outputs over the
tensor-parallel group, so each expert sees every token of its group once. With sequence
parallelism the tokens are already distinct sequence chunks.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

try:  # transformers 5: the per-forward collector of capture_outputs (output_router_logits)
    from transformers.utils import output_capturing as _hf_capture
except ImportError:  # pragma: no cover - older transformers
    _hf_capture = None

from mtp.moe import MoELayer
from mtp.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = ["MOE_BLOCKS", "HFMoEBlock", "swap_moe_blocks"]

logger = logging.getLogger("mtp")

#: HF block class name -> the config attribute holding each expert's intermediate size.
MOE_BLOCKS = {
    "MixtralSparseMoeBlock": "intermediate_size",
    "Qwen2MoeSparseMoeBlock": "moe_intermediate_size",
    "Qwen3MoeSparseMoeBlock": "moe_intermediate_size",
    "DeepseekV3MoE": "moe_intermediate_size",
}


def _router_logits_sink() -> list | None:
    """The list in which Hugging Face's output capture collects the running forward's router
    logits (transformers 5's ``capture_outputs``), or None when it is not collecting them."""
    collector = getattr(_hf_capture, "_active_collector", None)
    collected = None if collector is None else collector.get()
    if not collected or "router_logits" not in collected:
        return None
    return collected["router_logits"]


class HFMoEBlock(MoELayer):
    """``MoELayer`` taking and returning ``[b, s, h]`` like the HF block it replaces, and
    handing HF its router logits (see the module docstring).

    ``split_tokens``: the input is replicated over ``tp_group``; each rank routes its share of
    the tokens (padded to a multiple of the group size) and the outputs are all-gathered.
    """

    def __init__(self, *args, tp_group=None, split_tokens: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tp_group, self.split_tokens = tp_group, split_tokens

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        sink = _router_logits_sink()
        if not self.split_tokens:
            if sink is not None:
                sink.append(self._router_logits(hidden_states, hidden_states.shape[0]))
            return super().forward(hidden_states)
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        world = torch.distributed.get_world_size(self.tp_group)
        pad = -tokens.size(0) % world
        if pad:
            tokens = F.pad(tokens, (0, 0, 0, pad))
        mine = scatter_to_sequence_parallel_region(tokens, self.tp_group, seq_dim=0)
        if sink is not None:
            sink.append(self._router_logits(mine, tokens.size(0) - pad))
        out = super().forward(mine)
        out = gather_from_sequence_parallel_region(out, False, self.tp_group, seq_dim=0)
        return out[: out.size(0) - pad].view(shape)

    def _router_logits(self, router_in: torch.Tensor, size: int) -> torch.Tensor:
        """``[batch * seq, E]`` logits of the whole input (differentiable) from this rank's
        router input: its share of the tokens (``split_tokens``; ``size`` = the unpadded token
        count), a ``[b, s / tp, h]`` sequence chunk (``size`` = ``b``), or all of them."""
        logits = self.router.gating(router_in)
        experts = logits.shape[-1]
        if self.split_tokens:
            full = gather_from_sequence_parallel_region(logits, False, self.tp_group, seq_dim=0)
            return full[:size]
        if self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1:
            logits = gather_from_sequence_parallel_region(
                logits.view(size, -1, experts), False, self.tp_group, seq_dim=1
            )
        return logits.reshape(-1, experts)


def _routing_kwargs(block, config) -> dict:
    """The ``MoELayer`` routing and shared-expert arguments of an HF block (see the module
    docstring)."""
    kind = type(block).__name__
    if kind == "DeepseekV3MoE":
        groups = config.n_group if config.n_group and config.n_group > 1 else None
        return dict(
            score_function="sigmoid",
            expert_bias=True,
            num_groups=groups,
            group_topk=config.topk_group if groups else None,
            group_score="top2",
            norm_topk_prob=bool(config.norm_topk_prob),
            scaling_factor=config.routed_scaling_factor,
            router_dtype=torch.float32,
            shared_expert_intermediate_size=config.n_shared_experts * config.moe_intermediate_size,
        )
    # softmax over all experts then top-k without renormalising = Megatron's pre_softmax
    kwargs = dict(score_function="softmax", pre_softmax=not getattr(config, "norm_topk_prob", True))
    if kind == "Qwen2MoeSparseMoeBlock":
        kwargs.update(
            shared_expert_intermediate_size=config.shared_expert_intermediate_size,
            shared_expert_gate=True,
        )
    return kwargs


def _shared_expert(block):
    """``(HF attribute name, module)`` of a block's shared expert, or None."""
    for attr in ("shared_expert", "shared_experts"):
        if getattr(block, attr, None) is not None:
            return attr, getattr(block, attr)
    return None


def _copy_weights(new: HFMoEBlock, block, name: str, renames: dict) -> None:
    """Copy the HF block's weights into ``new`` and record the state-dict names: kinds
    ``"router"``, ``"experts"`` (split over the group), ``"shared"`` (replicated),
    ``"fc1"`` (one mtp tensor = two HF tensors stacked on dim 0) and ``"buffer"``."""
    local = list(new.local_expert_indices)
    w = block.experts.gate_up_proj
    if new.router.weight.dtype != block.gate.weight.dtype:
        new.router.to(block.gate.weight.dtype)  # e.g. DeepSeek-V3's float32 gate in bf16
    with torch.no_grad():
        new.router.weight.copy_(block.gate.weight)
        new.experts.weight1.copy_(w[local].transpose(1, 2))
        new.experts.weight2.copy_(block.experts.down_proj[local].transpose(1, 2))
    renames[f"{name}.router.weight"] = (f"{name}.gate.weight", "router")
    renames[f"{name}.experts.weight1"] = (f"{name}.experts.gate_up_proj", "experts")
    renames[f"{name}.experts.weight2"] = (f"{name}.experts.down_proj", "experts")
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        with torch.no_grad():
            new.router.expert_bias.copy_(bias)
        renames[f"{name}.router.expert_bias"] = (f"{name}.gate.e_score_correction_bias", "buffer")
    shared = _shared_expert(block)
    if shared is None:
        return
    attr, mlp = shared
    ours = new.shared_experts
    with torch.no_grad():
        ours.linear_fc1.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0))
        ours.linear_fc2.weight.copy_(mlp.down_proj.weight)
    hf = f"{name}.{attr}"
    renames[f"{name}.shared_experts.linear_fc1.weight"] = (
        (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), "fc1",
    )
    renames[f"{name}.shared_experts.linear_fc2.weight"] = (f"{hf}.down_proj.weight", "shared")
    gate = getattr(block, "shared_expert_gate", None)
    if gate is not None:
        with torch.no_grad():
            ours.gate_weight.copy_(gate.weight)
        hf_gate = f"{name}.shared_expert_gate.weight"
        renames[f"{name}.shared_experts.gate_weight"] = (hf_gate, "shared")


def swap_moe_blocks(
    model: nn.Module, group, *, sequence_parallel: bool, split_tokens: bool | None = None,
    tp_group=None,
) -> dict:
    """Replace every HF sparse MoE block (:data:`MOE_BLOCKS`) in place; returns ``{mtp
    tensor name: (HF name, kind)}`` for the state-dict translation (kinds: see
    ``_copy_weights``; an ``"fc1"`` entry's HF name is a ``(gate, up)`` pair).

    ``group``: the expert-parallel group (None: one process holds every expert).
    ``tp_group``: the tensor-parallel group when the model is split (default: ``group``); it
    may be part of a larger ``group`` (experts over tensor- and data-parallel ranks).
    ``split_tokens``: the ranks of ``tp_group`` hold the same tokens and each routes a share;
    default: ``tp_group is not None and not sequence_parallel``. False: the ranks hold
    different tokens (experts over data-parallel ranks only, or sequence parallelism)."""
    tp_group = group if tp_group is None else tp_group
    if split_tokens is None:
        split_tokens = tp_group is not None and not sequence_parallel
    config = model.config
    renames: dict[str, tuple] = {}
    names = [n for n, m in model.named_modules() if n and type(m).__name__ in MOE_BLOCKS]
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    if names and not hasattr(_hf_capture, "_active_collector"):
        logger.warning(
            "this transformers release has no output capture (transformers.utils."
            "output_capturing): the swapped MoE blocks cannot return router logits, so call "
            "the model with output_router_logits=False"
        )
    for name in names:
        block = model.get_submodule(name)
        w = block.experts.gate_up_proj
        new = HFMoEBlock(
            config.hidden_size,
            getattr(config, MOE_BLOCKS[type(block).__name__]),
            experts,
            config.num_experts_per_tok,
            ep_group=group,
            activation="swiglu",
            params_dtype=w.dtype,
            device=w.device,
            perform_initialization=False,
            tp_group=tp_group if split_tokens or sequence_parallel else None,
            split_tokens=split_tokens,
            **_routing_kwargs(block, config),
        )
        _copy_weights(new, block, name, renames)
        for p in new.experts.parameters():
            p.sequence_parallel = False  # complete gradients: every token of the group reaches them
        new.train(block.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return renames
