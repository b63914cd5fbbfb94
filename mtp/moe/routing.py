"""Routing functions of the top-k router (Megatron-Core's ``moe_utils`` names): scores, top-k,
group-limited selection, capacity dropping, the auxiliary losses and their autograd scaler, and
the configuration checks. :class:`mtp.moe.TopKRouter` (``mtp.moe.router``) is built on them; see
its module docstring for the maths.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mtp.moe._checks import check_positive
from mtp.utils import check_int

__all__ = [
    "MoEAuxLossAutoScaler",
    "check_routing_config",
    "compute_routing_scores_for_aux_loss",
    "get_capacity",
    "get_updated_expert_bias",
    "switch_load_balancing_loss_func",
    "topk_softmax_with_capacity",
    "z_loss_func",
]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_DROP_POLICIES = ("probs", "position")
_GROUP_SCORES = ("topk", "top2")


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
    aggregated = probs.sum(dim=0)
    if isinstance(total_num_tokens, torch.Tensor):  # a device count (padding mask): no sync
        denom = total_num_tokens.clamp(min=1).to(aggregated.dtype) ** 2
        scale = num_experts * moe_aux_loss_coeff / (topk * denom)
    else:
        scale = num_experts * moe_aux_loss_coeff / (topk * max(total_num_tokens, 1) ** 2)
    return torch.sum(aggregated * tokens_per_expert.to(aggregated.dtype)) * scale


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


def _group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int, group_score: str = "topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best of ``num_groups`` expert groups. A group
    scores the sum of its best ``topk // group_topk`` experts (``group_score="topk"``,
    Megatron-Core) or of its best two (``"top2"``, DeepSeek-V3's ``n_group``/``topk_group``)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    per_group = 2 if group_score == "top2" else topk // group_topk
    group_scores = grouped.topk(min(per_group, experts // num_groups), dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk, group_score="topk"):
    if group_topk:
        return _group_limited_topk(scores, topk, num_groups, group_topk, group_score)
    return torch.topk(scores, k=topk, dim=1)


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
        key = -probs.to(torch.promote_types(probs.dtype, torch.float32))
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
            :func:`_group_limited_topk`.

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
    math_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64
    bias = None if expert_bias is None else expert_bias.to(math_dtype)
    renorm = bool(norm_topk_prob)
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=math_dtype)
            select = scores if bias is None else scores + bias
            _, top_indices = _topk(select, topk, num_groups, group_topk, group_score)
            probs = torch.gather(scores, 1, top_indices)
        else:
            select = logits if bias is None else logits.to(math_dtype) + bias
            _, top_indices = _topk(select, topk, num_groups, group_topk, group_score)
            probs = torch.softmax(torch.gather(logits, 1, top_indices), dim=-1, dtype=math_dtype)
            renorm = False  # already sums to 1
    else:
        scores = torch.sigmoid(logits.to(math_dtype))
        select = scores if bias is None else scores + bias
        _, top_indices = _topk(select, topk, num_groups, group_topk, group_score)
        probs = torch.gather(scores, 1, top_indices)
        renorm = topk > 1 if norm_topk_prob is None else renorm
    if renorm:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is None:
        return routing_probs, routing_map, tokens_per_expert
    capacity = min(get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens)
    keep = _capacity_mask(routing_probs, routing_map, capacity, drop_policy)
    final_map = keep if pad_to_capacity else routing_map & keep
    return routing_probs * final_map, final_map, tokens_per_expert


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores over all experts (fp32 softmax, or sigmoid normalised per token) and the
    ``[T, E]`` map of their (unbiased) top-k, as Megatron-Core feeds the load-balancing loss.

    Returns ``(routing_map, scores)`` (Megatron's order)."""
    if score_function == "softmax":
        math_dtype = torch.promote_types(logits.dtype, torch.float32)
        scores = torch.softmax(logits, dim=-1, dtype=math_dtype)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(
            f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}"
        )
    top_indices = torch.topk(scores, k=topk, dim=1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


def check_routing_config(
    num_experts: int,
    topk: int,
    score_function: str = "softmax",
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    num_groups: int | None = None,
    group_topk: int | None = None,
    *,
    norm_topk_prob: bool | None = None,
    group_score: str = "topk",
    pre_softmax: bool = False,
    scaling_factor: float | None = None,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad routing argument."""
    check_int("num_experts", num_experts, 1)
    check_int("topk", topk, 1)
    if topk > num_experts:
        raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}"
        )
    if drop_policy not in _DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {_DROP_POLICIES}, got {drop_policy!r}")
    check_positive("capacity_factor", capacity_factor)
    if norm_topk_prob not in (None, True, False):
        raise TypeError(f"norm_topk_prob must be None, True or False, got {norm_topk_prob!r}")
    if norm_topk_prob is False and score_function == "softmax" and not pre_softmax:
        raise ValueError(
            "norm_topk_prob=False with score_function='softmax' needs pre_softmax=True (the "
            "softmax of the top-k logits always sums to 1; Qwen2-MoE's norm_topk_prob=False is "
            "pre_softmax=True, norm_topk_prob=False)"
        )
    if group_score not in _GROUP_SCORES:
        raise ValueError(f"group_score must be one of {_GROUP_SCORES}, got {group_score!r}")
    check_positive("scaling_factor", scaling_factor)
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk must be given together (group-limited routing)")
    if num_groups is not None:
        check_int("num_groups", num_groups, 1)
        check_int("group_topk", group_topk, 1)
        if num_experts % num_groups:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by num_groups={num_groups}"
            )
        per_group = num_experts // num_groups
        if group_score == "top2":
            if group_topk > num_groups or topk > group_topk * per_group:
                raise ValueError(
                    f"group_topk={group_topk} must be <= num_groups={num_groups} and the "
                    f"group_topk chosen groups must hold topk={topk} experts"
                )
        elif (
            group_topk > num_groups
            or topk % group_topk
            or topk // group_topk > per_group
        ):
            raise ValueError(
                f"group_topk={group_topk} must divide topk={topk}, be <= num_groups={num_groups}, "
                "and topk // group_topk must fit in one group"
            )


