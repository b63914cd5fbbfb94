"""The router's plain-PyTorch path (aten ops, autograd by PyTorch): Megatron-Core's routing
maths (``moe_utils.topk_softmax_with_capacity`` without the capacity,
``compute_routing_scores_for_aux_loss``) and the statistics :func:`mtp.ops.moe_router` returns.
It is the op's ``"reference"`` backend and what the tests compare the kernels with."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "RouterOutput",
    "compute_routing_scores_for_aux_loss",
    "group_limited_topk",
    "math_dtype",
    "moe_router_reference",
    "renormalises",
    "route",
    "topk_indices",
]


class RouterOutput(NamedTuple):
    """What :func:`mtp.ops.moe_router` returns (statistics are None unless asked for).

    - ``probs``: ``[T, E]`` in the logits' dtype, the routing probabilities, 0 off the routing.
    - ``routing_map``: ``[T, E]`` bool, the chosen experts of each token.
    - ``scores_sum``: ``[E]``, the aux-loss scores summed over the valid tokens
      (``aux_statistics``; differentiable).
    - ``aux_tokens_per_expert``: ``[E]``, the valid tokens whose top-k of the aux-loss scores
      holds each expert (``aux_statistics``).
    - ``tokens_per_expert``: ``[E]``, the valid tokens routed to each expert
      (``routed_counts``).
    - ``lse_sq_sum``: ``[]``, ``sum(logsumexp(logits[t])**2)`` over the valid tokens
      (``z_statistics``; differentiable).

    Statistics are in the math dtype (float32; float64 for float64 logits); counts are exact
    integers there.
    """

    probs: torch.Tensor
    routing_map: torch.Tensor
    scores_sum: torch.Tensor | None = None
    aux_tokens_per_expert: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None
    lse_sq_sum: torch.Tensor | None = None


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the router computes in: float64 for float64 logits, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def renormalises(score_function: str, pre_softmax: bool, topk: int,
                 norm_topk_prob: bool | None) -> bool:  # fmt: skip
    """Whether the chosen probabilities are divided by their sum (Megatron's rule when
    ``norm_topk_prob`` is None: sigmoid with ``topk > 1``; the softmax of the top-k logits
    already sums to 1)."""
    if score_function == "softmax":
        return bool(norm_topk_prob) and pre_softmax
    return topk > 1 if norm_topk_prob is None else bool(norm_topk_prob)


def group_limited_topk(
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


def topk_indices(scores, topk, num_groups, group_topk, group_score="topk") -> torch.Tensor:
    """``[T, topk]`` indices of the chosen experts (group-limited when ``group_topk``)."""
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk, group_score)[1]
    return torch.topk(scores, k=topk, dim=1).indices


def route(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    norm_topk_prob: bool | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score: str = "topk",
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [T, E] in logits' dtype, routing_map [T, E] bool)``: Megatron-Core's top-k
    routing (see :func:`mtp.ops.moe_router` for the variants)."""
    math = math_dtype(logits.dtype)
    bias = None if expert_bias is None else expert_bias.to(math)
    renorm = renormalises(score_function, pre_softmax, topk, norm_topk_prob)
    if score_function == "softmax" and not pre_softmax:
        select = logits if bias is None else logits.to(math) + bias
        top = topk_indices(select, topk, num_groups, group_topk, group_score)
        probs = torch.softmax(torch.gather(logits, 1, top), dim=-1, dtype=math)
    else:
        if score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=math)
        else:
            scores = torch.sigmoid(logits.to(math))
        select = scores if bias is None else scores + bias
        top = topk_indices(select, topk, num_groups, group_topk, group_score)
        probs = torch.gather(scores, 1, top)
    if renorm:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores over all experts (fp32 softmax, or sigmoid normalised per token) and the
    ``[T, E]`` map of their (unbiased) top-k, as Megatron-Core feeds the load-balancing loss.

    Returns ``(routing_map, scores)`` (Megatron's order)."""
    math = math_dtype(logits.dtype)
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=math)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(math))
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(
            f"score_function must be one of ('softmax', 'sigmoid'), got {score_function!r}"
        )
    top_indices = torch.topk(scores, k=topk, dim=1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


def moe_router_reference(
    logits: torch.Tensor,
    topk: int,
    *,
    padding_mask: torch.Tensor | None = None,
    aux_statistics: bool = False,
    z_statistics: bool = False,
    routed_counts: bool = False,
    **routing,
) -> RouterOutput:
    """:func:`mtp.ops.moe_router` in aten ops (differentiable by PyTorch's autograd); the
    routing arguments (``**routing``) are :func:`route`'s."""
    probs, routing_map = route(logits, topk, **routing)
    math = math_dtype(logits.dtype)
    valid = None if padding_mask is None else ~padding_mask.reshape(-1, 1)
    out = RouterOutput(probs, routing_map)
    if aux_statistics:
        aux_map, scores = compute_routing_scores_for_aux_loss(
            logits, topk, routing.get("score_function", "softmax")
        )
        if valid is not None:
            scores, aux_map = scores * valid.to(math), aux_map & valid
        out = out._replace(scores_sum=scores.sum(0), aux_tokens_per_expert=aux_map.sum(0).to(math))
    if routed_counts:
        counted = routing_map if valid is None else routing_map & valid
        out = out._replace(tokens_per_expert=counted.sum(0).to(math))
    if z_statistics:
        lse = torch.logsumexp(logits.to(math), dim=-1)
        sq = lse * lse if valid is None else lse * lse * valid[:, 0].to(math)
        out = out._replace(lse_sq_sum=sq.sum())
    return out
