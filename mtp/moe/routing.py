"""Routing functions of the top-k router (Megatron-Core's ``moe_utils`` names): top-k routing
with capacity dropping, the auxiliary losses and their autograd scaler, and the configuration
checks. The scores, the (group-limited) top-k and the loss statistics are the op
:func:`mtp.ops.moe_router` (one fused kernel, or its aten reference); capacity dropping follows
it in aten ops. :class:`mtp.moe.TopKRouter` (``mtp.moe.router``) is built on them; see its
module docstring for the maths.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mtp.ops.moe_router import (
    check_routing_config,
    compute_routing_scores_for_aux_loss,
    moe_router,
)

__all__ = [
    "MoEAuxLossAutoScaler",
    "check_routing_config",
    "compute_routing_scores_for_aux_loss",
    "get_capacity",
    "get_updated_expert_bias",
    "load_balancing_loss_from_sums",
    "switch_load_balancing_loss_func",
    "topk_softmax_with_capacity",
    "z_loss_func",
]


# --------------------------------------------------------------------------------------------
# Auxiliary losses
# --------------------------------------------------------------------------------------------


#: Where ``MoEAuxLossAutoScaler.main_loss_backward_scale`` lives (a module global: torch.compile
#: traces reads of it, which it cannot do for an attribute of an autograd.Function class).
_LOSS_SCALE: list = [None]


class _AuxLossScale(torch.autograd.Function):
    """The autograd function behind :class:`MoEAuxLossAutoScaler` (its ``apply``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        grad_aux = torch.ones_like(aux_loss)  # a fill on the device: no host-to-device copy
        scale = _LOSS_SCALE[0]  # read now: MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is not None:
            grad_aux = grad_aux * scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, grad_aux


class _AuxLossScaleMeta(type):
    """``MoEAuxLossAutoScaler.main_loss_backward_scale`` reads and assigns ``_LOSS_SCALE``: one
    state, whichever way user or Megatron-style code reaches it."""

    @property
    def main_loss_backward_scale(cls) -> torch.Tensor | None:
        return _LOSS_SCALE[0]

    @main_loss_backward_scale.setter
    def main_loss_backward_scale(cls, value: torch.Tensor | None) -> None:
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                "MoEAuxLossAutoScaler.main_loss_backward_scale must be a torch.Tensor or None, "
                f"got {type(value).__name__}"
            )
        _LOSS_SCALE[0] = value


class MoEAuxLossAutoScaler(metaclass=_AuxLossScaleMeta):
    """Identity on ``output`` whose backward also gives ``aux_loss`` the gradient ``scale``.

    ``MoEAuxLossAutoScaler.apply(activation, aux_loss)`` returns ``activation``; when the main
    loss is back-propagated through it, ``aux_loss`` receives the class attribute
    ``MoEAuxLossAutoScaler.main_loss_backward_scale`` (a one-element tensor; None means 1) as
    its gradient, so the auxiliary loss is optimised as if it had been added to the main loss.
    Megatron-Core's name and behaviour: the attribute is the state, read when the backward
    runs, so assigning it (``MoEAuxLossAutoScaler.main_loss_backward_scale =
    torch.tensor(0.125)``), :meth:`set_loss_scale` (after the forward, as Megatron's schedules
    call it) and :meth:`reset_loss_scale` all apply from the next backward on. (``apply`` is
    an ``autograd.Function``'s; the class itself only holds the state, so that torch.compile
    can trace the backward's read of it.)
    """

    apply = _AuxLossScale.apply

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the gradient the auxiliary losses receive (match the main loss's scale, e.g.
        ``loss_scale / num_micro_batches``).

        Args:
            scale: a one-element tensor: becomes ``main_loss_backward_scale`` the first time
                (or after a reset); later calls copy into it (Megatron-Core's behaviour), so a
                captured graph that read it sees the new value.
        """
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
        if scale.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
        current = _LOSS_SCALE[0]
        if current is None:
            _LOSS_SCALE[0] = scale
        else:
            current.copy_(scale.reshape(current.shape))

    @staticmethod
    def reset_loss_scale() -> None:
        """Back to the default gradient 1 for the auxiliary losses
        (``main_loss_backward_scale = None``)."""
        _LOSS_SCALE[0] = None


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, as Megatron-Core computes it.

    ``loss = coeff * E / (topk * T**2) * sum_e(P_e * n_e)`` with ``P_e = sum_t probs[t, e]``.

    Args:
        probs: ``[T, E]`` scores over all experts (softmax, or normalised sigmoid).
        tokens_per_expert: ``[E]`` tokens routed to each expert (any number dtype).
        total_num_tokens: ``T``.
        topk, num_experts, moe_aux_loss_coeff: ``k``, ``E`` and the coefficient.

    Returns:
        A 0-D tensor in ``probs``' dtype (fp32 for the router's scores), on the device.
    """
    return load_balancing_loss_from_sums(
        probs.sum(dim=0), tokens_per_expert, total_num_tokens, topk, num_experts,
        moe_aux_loss_coeff,
    )  # fmt: skip


def load_balancing_loss_from_sums(
    scores_sum: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """:func:`switch_load_balancing_loss_func` from the per-expert score sums ``[E]``
    (``P_e``, e.g. :func:`mtp.ops.moe_router`'s ``scores_sum``): two device ops."""
    if isinstance(total_num_tokens, torch.Tensor):  # a device count (padding mask): no sync
        denom = total_num_tokens.clamp(min=1).to(scores_sum.dtype) ** 2
        scale = num_experts * moe_aux_loss_coeff / (topk * denom)
    else:
        scale = num_experts * moe_aux_loss_coeff / (topk * max(total_num_tokens, 1) ** 2)
    return torch.dot(scores_sum, tokens_per_expert.to(scores_sum.dtype)) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean_t(logsumexp(logits[t])**2)``, a 0-D tensor."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    math_dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.mean(torch.square(torch.logsumexp(logits.to(math_dtype), dim=-1))) * z_loss_coeff


def get_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None
) -> int:
    """Slots per expert: ``ceil(num_tokens / num_experts * capacity_factor)`` (Megatron-Core's
    ``get_capacity``; ``num_tokens`` is ``T * topk`` there), at least ``min_capacity``."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor,
    expert_bias: torch.Tensor,
    expert_bias_update_rate: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3, arXiv:2408.15664): ``bias + rate *
    sign(mean(n) - n)``, ``n`` the token counts summed over ``group`` (all-reduced in place when
    a group is given). Returns the new bias; no host sync."""
    with torch.no_grad():
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(tokens_per_expert, group=group)
        counts = tokens_per_expert.to(torch.float32)
        offset = counts.mean(dim=-1, keepdim=True) - counts
        return expert_bias + torch.sign(offset).to(expert_bias.dtype) * expert_bias_update_rate


# --------------------------------------------------------------------------------------------
# Top-k selection and capacity
# --------------------------------------------------------------------------------------------


def _capacity_mask(
    probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, drop_policy: str
) -> torch.Tensor:
    """``[T, E]`` bool: the (at most) ``capacity`` tokens each expert keeps."""
    if drop_policy == "position":
        # Routed tokens first, in token order, then the unrouted ones (padding): exactly
        # ``capacity`` rows per expert, of which the routed ones are its first routed tokens.
        key = (~routing_map).to(torch.int8)
    else:
        # "probs": highest probabilities first, ties to the lower token (stable sort).
        key = -probs.to(torch.float64 if probs.dtype == torch.float64 else torch.float32)
    order = torch.sort(key, dim=0, stable=True).indices[:capacity]
    return torch.zeros_like(routing_map).scatter(0, order, True)


def topk_softmax_with_capacity(
    logits: torch.Tensor,
    topk: int,
    capacity_factor: float | None = None,
    pad_to_capacity: bool = False,
    drop_policy: str = "probs",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    deterministic_mode: bool = False,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    norm_topk_prob: bool | None = None,
    group_score: str = "topk",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with optional capacity (Megatron-Core's function of the same name).

    Args:
        logits: ``[T, E]`` router logits.
        topk: experts per token.
        capacity_factor: drop tokens beyond ``get_capacity(T * topk, E, capacity_factor)``
            (at most ``T``) per expert, by ``drop_policy`` (see the module docstring).
        pad_to_capacity: Megatron's padded map: ``routing_map`` marks exactly ``capacity``
            tokens per expert (unrouted ones with probability 0). mtp's layers leave it False
            and pad with empty slots instead (``permute(..., drop_and_pad=True)``).
        drop_policy: ``"probs"`` or ``"position"``.
        use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias:
            see the module docstring. ``deterministic_mode`` is accepted for compatibility
            (the computation is always deterministic).
        norm_topk_prob: renormalise the chosen probabilities to sum 1 per token (before
            ``scaling_factor``). None: Megatron's rule (sigmoid renormalised when ``topk > 1``,
            softmax never: without ``use_pre_softmax`` the top-k softmax already sums to 1).
            False with ``"softmax"`` needs ``use_pre_softmax=True``.
        group_score: ``"topk"`` (Megatron) or ``"top2"`` (DeepSeek-V3), see
            :func:`mtp.ops.moe_router`.
        backend: of :func:`mtp.ops.moe_router` (``"auto"``: the fused kernel on CUDA, aten
            ops elsewhere; ``"triton"``; ``"reference"``).

    Returns:
        ``(probs [T, E] in logits' dtype (0 off the routing), routing_map [T, E] bool,
        tokens_per_expert [E] int64 before dropping)``. Static shapes, no host sync.
    """
    del deterministic_mode
    num_tokens, num_experts = logits.shape
    check_routing_config(
        num_experts, topk, score_function, capacity_factor, drop_policy, num_groups, group_topk,
        norm_topk_prob=norm_topk_prob, group_score=group_score, pre_softmax=use_pre_softmax,
    )
    routing_probs, routing_map = moe_router(
        logits, topk, score_function=score_function, pre_softmax=use_pre_softmax,
        norm_topk_prob=norm_topk_prob, num_groups=num_groups, group_topk=group_topk,
        group_score=group_score, scaling_factor=scaling_factor, expert_bias=expert_bias,
        backend=backend,
    )[:2]  # fmt: skip
    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is None:
        return routing_probs, routing_map, tokens_per_expert
    final_map = drop_to_capacity(routing_probs, routing_map, topk, capacity_factor, drop_policy,
                                 pad_to_capacity)  # fmt: skip
    return routing_probs * final_map, final_map, tokens_per_expert


def drop_to_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> torch.Tensor:
    """The ``[T, E]`` map after capacity dropping (aten ops after the router's kernel):
    ``min(get_capacity(T * topk, E, capacity_factor), T)`` tokens per expert at most, chosen by
    ``drop_policy``; ``pad_to_capacity``: exactly that many (unrouted ones included)."""
    num_tokens, num_experts = routing_map.shape
    capacity = min(get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens)
    keep = _capacity_mask(probs, routing_map, capacity, drop_policy)
    return keep if pad_to_capacity else routing_map & keep
