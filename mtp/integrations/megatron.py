"""mtp's kernels in Megatron-Core models (needs ``megatron-core``).

- :class:`GroupedMLP`: the experts of a Megatron-Core MoE layer on mtp's grouped GEMMs / fused
  expert MLP, usable as ``MoESubmodules(experts=ModuleSpec(module=GroupedMLP))``: Megatron's
  constructor ``(num_local_experts, config, pg_collection)``, its return convention
  ``(output, None)``, its expert-parallel groups, and the parameters and
  ``sharded_state_dict`` of Megatron-Core's own ``GroupedMLP`` (``weight1 [H, L * F1]``,
  ``weight2 [L * F, H]``; the checkpoint is compatible with ``SequentialMLP``'s).
- :func:`fused_vocab_parallel_cross_entropy`: Megatron-Core's
  ``fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group)`` signature on
  :func:`mtp.ops.vocab_parallel_cross_entropy`; ``tp_group=None`` reads Megatron's
  tensor-parallel group (``megatron.core.parallel_state``) when it is initialised, else
  ``mtp.parallel``'s.

::

    from megatron.core.transformer.spec_utils import ModuleSpec
    from mtp.integrations.megatron import GroupedMLP

    spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedMLP)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import experts as _megatron_experts

from mtp.moe.experts import GroupedMLP as _MtpGroupedMLP
from mtp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mtp.utils import qualified_name

__all__ = ["GroupedMLP", "fused_vocab_parallel_cross_entropy"]


def _activation(config) -> str:
    func = config.activation_func
    if config.gated_linear_unit and func is F.silu:
        return "swiglu"
    if not config.gated_linear_unit and func is F.gelu:
        return "gelu"
    raise ValueError(
        "mtp.integrations.megatron.GroupedMLP supports config.gated_linear_unit=True with "
        "activation_func=torch.nn.functional.silu (SwiGLU) or gated_linear_unit=False with "
        f"torch.nn.functional.gelu; got gated_linear_unit={config.gated_linear_unit}, "
        f"activation_func={getattr(func, '__module__', '?')}.{getattr(func, '__name__', func)}"
    )


def _default_pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "mtp.integrations.megatron.GroupedMLP: pg_collection is None and "
            "megatron.core.parallel_state is not initialised; pass the "
            "megatron.core.process_groups_config.ProcessGroupCollection (Megatron-Core's MoELayer "
            "does) or call megatron.core.parallel_state.initialize_model_parallel(...)"
        )
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "expt_dp"])


class GroupedMLP(MegatronModule):
    """Megatron-Core's experts interface on :class:`mtp.moe.GroupedMLP`.

    Args:
        num_local_experts: ``L``, the experts of this expert-parallel rank.
        config: a ``megatron.core.transformer.TransformerConfig``: ``hidden_size``,
            ``moe_ffn_hidden_size``, ``gated_linear_unit`` + ``activation_func`` (SwiGLU or
            GeLU), ``params_dtype``, ``init_method`` / ``output_layer_init_method``,
            ``perform_initialization``, ``moe_apply_probs_on_input``; ``add_bias_linear`` must
            be False (as for Megatron-Core's ``GroupedMLP``).
        pg_collection: Megatron-Core's ``ProcessGroupCollection`` (``ep``, ``expt_tp``,
            ``expt_dp``); None: ``megatron.core.parallel_state``'s groups. Expert tensor
            parallelism (``expt_tp`` > 1) is not supported.

    Parameters ``weight1 [H, L * F1]`` and ``weight2 [L * F, H]`` (Megatron-Core
    ``GroupedMLP``'s, whose memory it reads as ``[L, H, F1]`` / ``[L, F, H]``; ``F1 = 2F`` for
    SwiGLU, gate columns first); the grouped kernels read the same views, no copy.
    ``forward(x [M, H], tokens_per_expert [L], permuted_probs [M]) -> (y [M, H], None)``.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError(
                "mtp.integrations.megatron.GroupedMLP: config.add_bias_linear must be False "
                "(Megatron-Core's GroupedMLP has no expert biases either)"
            )
        activation = _activation(config)
        pg_collection = pg_collection if pg_collection is not None else _default_pg_collection()
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        if self.tp_group is not None and self.tp_group.size() > 1:
            raise NotImplementedError(
                "mtp.integrations.megatron.GroupedMLP: expert tensor parallelism "
                f"(expert_tensor_parallel_size={self.tp_group.size()}) is not supported; set "
                "expert_tensor_parallel_size=1"
            )
        self.num_local_experts = num_local_experts
        ffn = config.moe_ffn_hidden_size
        self._experts = _MtpGroupedMLP(
            num_local_experts, config.hidden_size, ffn, activation=activation,
            params_dtype=config.params_dtype, perform_initialization=False,
        )  # fmt: skip
        h, f1 = config.hidden_size, self._experts.fc1_output_size
        # Megatron's 2-D parameters; mtp's experts read [L, H, F1] / [L, F, H] views of them
        self.weight1 = torch.nn.Parameter(torch.empty(h, num_local_experts * f1,
                                                      dtype=config.params_dtype))  # fmt: skip
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts * ffn, h,
                                                      dtype=config.params_dtype))  # fmt: skip
        del self._experts.weight1, self._experts.weight2
        expert_parallel = self.ep_group is not None and self.ep_group.size() > 1
        for p in (self.weight1, self.weight2):
            p.allreduce = not expert_parallel  # Megatron's marker (mtp.optim reads it too)
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight1)
                config.output_layer_init_method(self.weight2)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        L, h = self.num_local_experts, self.config.hidden_size
        # Megatron-Core's GroupedMLP reads its 2-D parameters' memory as [L, H, F1] / [L, F, H]
        # (its sharded_state_dict maps that to per-expert tensors); contiguous views, no copy
        w1 = self.weight1.view(L, h, -1)
        w2 = self.weight2.view(L, -1, h)
        return w1, w2

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):  # fmt: skip
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = None
        w1, w2 = self._views()
        experts = self._experts
        experts.weight1, experts.weight2 = w1, w2  # plain attributes: the views of this call
        try:
            out = experts(x, tokens_per_expert.to(x.device), probs)
        finally:
            del experts.weight1, experts.weight2
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron-Core ``GroupedMLP``'s distributed-checkpoint layout (its own method, run on
        these parameters and groups: the same keys, shapes and offsets)."""
        return _megatron_experts.GroupedMLP.sharded_state_dict(
            self, prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata
        )


def _megatron_tp_group():
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def fused_vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group=None
) -> torch.Tensor:
    """Megatron-Core's ``fused_vocab_parallel_cross_entropy`` on mtp's fused kernel.

    Args:
        vocab_parallel_logits: ``[s, b, V / tp]`` this rank's vocab shard (fp32/fp16/bf16).
        target: ``[s, b]`` global token ids.
        tp_group: the tensor-parallel group; None: ``megatron.core.parallel_state``'s when it is
            initialised, else ``mtp.parallel``'s (else no split).

    Returns:
        The per-token fp32 loss ``[s, b]`` (no reduction), as Megatron-Core. Label smoothing is
        0; targets out of range or different across the ranks fail (on the device, no sync).
    """
    if tp_group is not None and not isinstance(tp_group, torch.distributed.ProcessGroup):
        raise TypeError(
            "tp_group must be a torch.distributed.ProcessGroup or None, got "
            f"{qualified_name(tp_group)}"
        )
    if tp_group is None:
        tp_group = _megatron_tp_group()
    return vocab_parallel_cross_entropy(vocab_parallel_logits, target, 0.0, tp_group)
