"""The shared expert of Qwen2-MoE / DeepSeek-style layers: :class:`SharedExpertMLP`.

Every token goes through it (no routing); its output is added to the routed experts' sum,
optionally scaled by a learnt per-token gate ``sigmoid(x @ gate_weight.T)`` (Qwen2-MoE's
``shared_expert_gate``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.moe.experts import ACTIVATIONS, activation_function
from mtp.parallel.params import mark_tensor_parallel_grad_reduced
from mtp.utils import check_int

__all__ = ["SharedExpertMLP"]


class SharedExpertMLP(nn.Module):
    """A dense MLP every token goes through (Megatron-Core ``SharedExpertMLP`` names).

    Args:
        hidden_size: ``H``.
        ffn_hidden_size: ``F`` (Qwen2-MoE's ``shared_expert_intermediate_size``; DeepSeek's
            ``n_shared_experts * moe_intermediate_size``).
        activation: as :class:`~mtp.moe.GroupedMLP` (``"swiglu"``: gate in the first half of
            ``linear_fc1``'s output).
        gate: a learnt gate ``gate_weight [1, H]``: output ``* sigmoid(x @ gate_weight.T)``.
        bias: biases in the two linears.
        tp_group: the group over which the tokens are split (sequence parallel); the weights are
            replicated there and their gradients summed over it in the backward.
        params_dtype, device: of the parameters.

    Parameters: ``linear_fc1`` (``nn.Linear(H, F1)``), ``linear_fc2`` (``nn.Linear(F, H)``),
    ``gate_weight``. ``forward(x [..., H]) -> [..., H]``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        gate: bool = False,
        bias: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        check_int("shared_expert_intermediate_size", ffn_hidden_size, 1)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        gated = activation in ("swiglu", "clamped_swiglu")
        kw = dict(dtype=params_dtype, device=device)
        self.activation = activation
        fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
        self.linear_fc1 = nn.Linear(hidden_size, fc1_out, bias=bias, **kw)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias, **kw)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, hidden_size, **kw))
            nn.init.normal_(self.gate_weight, 0.0, 0.02)
        else:
            self.register_parameter("gate_weight", None)
        self.tp_group = tp_group
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            for p in self.parameters():  # _weights() sums their gradients over tp_group
                mark_tensor_parallel_grad_reduced(p)

    def _weights(self):
        params = [
            self.linear_fc1.weight, self.linear_fc1.bias,
            self.linear_fc2.weight, self.linear_fc2.bias, self.gate_weight,
        ]
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return params
        from mtp.parallel.mappings import copy_to_tensor_model_parallel_region

        return [
            None if p is None else copy_to_tensor_model_parallel_region(p, self.tp_group)
            for p in params
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2, gate = self._weights()
        dtype = x.dtype
        h = F.linear(x, w1.to(dtype), None if b1 is None else b1.to(dtype))
        h = activation_function(h, self.activation, "auto")
        y = F.linear(h, w2.to(dtype), None if b2 is None else b2.to(dtype))
        if gate is not None:
            y = y * torch.sigmoid(F.linear(x, gate.to(dtype)))
        return y
