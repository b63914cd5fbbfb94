"""Argument checks of :func:`mtp.ops.moe_router` and of the routing configuration the MoE
layers share (:func:`check_routing_config`): ``TypeError``/``ValueError`` naming the argument."""

from __future__ import annotations

import torch

from mtp.dtypes import FLOATS
from mtp.utils import check_int, check_positive, check_tensor

__all__ = ["SCORE_FUNCTIONS", "DROP_POLICIES", "GROUP_SCORES", "check_routing_config",
           "check_router_inputs"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
GROUP_SCORES = ("topk", "top2")
_SCORE_FUNCTIONS, _DROP_POLICIES, _GROUP_SCORES = SCORE_FUNCTIONS, DROP_POLICIES, GROUP_SCORES


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


def check_router_inputs(logits, expert_bias, padding_mask) -> None:
    """``logits`` ``[T, E]`` float; ``expert_bias`` ``[E]`` float; ``padding_mask`` ``[T]`` bool
    (all on ``logits``' device)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOATS)
    num_tokens, num_experts = logits.shape
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, ndim=1, dtypes=FLOATS, device=logits.device)
        if expert_bias.shape[0] != num_experts:
            raise ValueError(
                f"expert_bias must have shape ({num_experts},) (one value per expert of logits "
                f"{tuple(logits.shape)}), got {tuple(expert_bias.shape)}"
            )
    if padding_mask is not None:
        check_tensor("padding_mask", padding_mask, dtypes=(torch.bool,), device=logits.device)
        if padding_mask.numel() != num_tokens:
            raise ValueError(
                f"padding_mask must hold one bool per token ({num_tokens}, the rows of logits), "
                f"got shape {tuple(padding_mask.shape)}"
            )
