"""Plain-PyTorch :func:`mtp.ops.permute` and :func:`mtp.ops.unpermute` with the same
signatures and no checks: :func:`permute_reference` (Megatron-Core's stable-argsort
construction) and :func:`unpermute_reference` (scatter-add in fp32), and
:func:`combine_reference`, the weighted row sum behind ``unpermute``'s reference backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtp.ops.moe_permute.row_map import row_pairs, select_probs

__all__ = ["combine_reference", "permute_reference", "unpermute_reference"]


def permute_reference(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Plain-PyTorch :func:`~mtp.ops.permute` (Megatron's stable-argsort construction; no checks).

    ``num_out_tokens`` must be given without ``drop_and_pad``, ``capacity`` with it.
    """
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.t()
    if drop_and_pad:
        order = by_expert.to(torch.int8).argsort(dim=1, descending=True, stable=True)
        token = order[:, :capacity]
        valid = torch.gather(by_expert, 1, token)
        missing = capacity - token.shape[1]  # fewer tokens than slots
        if missing:
            token = torch.cat([token, token.new_zeros((num_experts, missing))], dim=1)
            valid = torch.cat([valid, valid.new_zeros((num_experts, missing))], dim=1)
        expert = torch.arange(num_experts, device=token.device).unsqueeze(1).expand_as(token)
        token, expert, valid = token.reshape(-1), expert.reshape(-1), valid.reshape(-1)
    else:
        flat = by_expert.reshape(-1)
        order = flat.argsort(descending=True, stable=True)[:num_out_tokens]
        valid = flat[order]
        missing = num_out_tokens - order.shape[0]
        if missing:
            order = torch.cat([order, order.new_zeros(missing)])
            valid = torch.cat([valid, valid.new_zeros(missing)])
        token = order % max(num_tokens, 1)
        expert = order // max(num_tokens, 1)
    row_id_map = torch.where(valid, token, -1)
    if num_tokens:
        gathered = tokens.index_select(0, token)
        permuted = torch.where(valid.unsqueeze(1), gathered, gathered.new_zeros(()))
    else:
        permuted = tokens.new_zeros((row_id_map.shape[0], tokens.shape[1]))
    permuted_probs = None
    if probs is not None:
        pair = torch.where(valid, token * num_experts + expert, num_tokens * num_experts)
        permuted_probs = select_probs(probs, pair)
    return permuted, permuted_probs, row_id_map


def combine_reference(
    permuted: torch.Tensor, row_id_map: torch.Tensor, weight: torch.Tensor | None, num_tokens: int
) -> torch.Tensor:
    """``out[t] = sum_i weight[i] * permuted[i]`` over the rows with ``row_id_map[i] == t`` (rows
    outside ``[0, T)`` skipped), accumulated in fp32 (fp64 for fp64) with ``index_add``."""
    acc_dtype = torch.float64 if permuted.dtype == torch.float64 else torch.float32
    rows = permuted.to(acc_dtype)
    if weight is not None:
        rows = rows * weight.to(acc_dtype).unsqueeze(1)
    index = row_id_map.to(torch.int64)
    valid = (index >= 0) & (index < num_tokens)
    rows = torch.where(valid.unsqueeze(1), rows, rows.new_zeros(()))
    if num_tokens == 0:  # keep the autograd link: an EP rank with no tokens still joins backward
        return rows[:0].to(permuted.dtype)
    out = torch.zeros((num_tokens, permuted.shape[1]), dtype=acc_dtype, device=permuted.device)
    out = out.index_add(0, index.clamp(0, num_tokens - 1), rows)
    return out.to(permuted.dtype)


def unpermute_reference(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    """Plain-PyTorch :func:`~mtp.ops.unpermute` (scatter-add in fp32; no checks)."""
    num_tokens = restore_shape[0]
    weight = None
    if probs is not None:
        pair = row_pairs(row_id_map, num_tokens, probs.shape[1], routing_map, drop_and_pad)
        weight = select_probs(probs, pair)
    return combine_reference(permuted, row_id_map, weight, num_tokens)
