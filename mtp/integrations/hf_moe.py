"""Mixture-of-experts blocks of Hugging Face models swapped for :class:`mtp.moe.MoELayer`.

Used by :func:`mtp.integrations.hf.parallelize_hf` for the Mixtral and Qwen3-MoE families: each
``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock`` becomes an :class:`HFMoEBlock` (a
``MoELayer`` with the family's routing: Mixtral and Qwen3-MoE with ``norm_topk_prob`` softmax
over the top-k logits, Qwen3-MoE without it the top-k of the softmax over all experts; SwiGLU
experts) whose experts are split over the expert-parallel group, which is the tensor-parallel
group here (``ep == tp``).

Without sequence parallelism every tensor-parallel rank holds the same tokens; the block keeps
this rank's share of them (split forward, all-gather backward), routes it through the experts
(token all-to-all over the group) and all-gathers the outputs, so each expert sees every token
once. With sequence parallelism the tokens are already distinct sequence chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp.moe import MoELayer
from mtp.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = ["MOE_BLOCKS", "HFMoEBlock", "swap_moe_blocks"]

#: HF block class name -> the config attribute holding each expert's intermediate size.
MOE_BLOCKS = {
    "MixtralSparseMoeBlock": "intermediate_size",
    "Qwen3MoeSparseMoeBlock": "moe_intermediate_size",
}


class HFMoEBlock(MoELayer):
    """``MoELayer`` taking and returning ``[b, s, h]`` like the HF block it replaces.

    ``split_tokens``: the input is replicated over ``tp_group``; each rank routes its share of
    the tokens (padded to a multiple of the group size) and the outputs are all-gathered.
    """

    def __init__(self, *args, tp_group=None, split_tokens: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tp_group, self.split_tokens = tp_group, split_tokens

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.split_tokens:
            return super().forward(hidden_states)
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        world = torch.distributed.get_world_size(self.tp_group)
        pad = -tokens.size(0) % world
        if pad:
            tokens = F.pad(tokens, (0, 0, 0, pad))
        mine = scatter_to_sequence_parallel_region(tokens, self.tp_group, seq_dim=0)
        out = super().forward(mine)
        out = gather_from_sequence_parallel_region(out, False, self.tp_group, seq_dim=0)
        return out[: out.size(0) - pad].view(shape)


def swap_moe_blocks(model: nn.Module, group, *, sequence_parallel: bool) -> dict:
    """Replace every HF sparse MoE block (:data:`MOE_BLOCKS`) in place; returns ``{mtp
    parameter name: (HF name, kind)}`` for the state-dict translation (kind ``"router"`` or
    ``"experts"``)."""
    config = model.config
    renames: dict[str, tuple[str, str]] = {}
    names = [n for n, m in model.named_modules() if n and type(m).__name__ in MOE_BLOCKS]
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    # softmax over all experts then top-k without renormalising = Megatron's pre_softmax
    pre_softmax = not getattr(config, "norm_topk_prob", True)
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
            score_function="softmax",
            pre_softmax=pre_softmax,
            params_dtype=w.dtype,
            device=w.device,
            perform_initialization=False,
            tp_group=group,
            split_tokens=not sequence_parallel,
        )
        local = list(new.local_expert_indices)
        with torch.no_grad():
            new.router.weight.copy_(block.gate.weight)
            new.experts.weight1.copy_(w[local].transpose(1, 2))
            new.experts.weight2.copy_(block.experts.down_proj[local].transpose(1, 2))
        for p in new.experts.parameters():
            p.sequence_parallel = False  # complete gradients: every token of the group reaches them
        new.train(block.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        renames[f"{name}.router.weight"] = (f"{name}.gate.weight", "router")
        renames[f"{name}.experts.weight1"] = (f"{name}.experts.gate_up_proj", "experts")
        renames[f"{name}.experts.weight2"] = (f"{name}.experts.down_proj", "experts")
    return renames
