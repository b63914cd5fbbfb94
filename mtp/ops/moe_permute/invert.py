"""The token-major map of a given ``row_id_map``: what a Triton :func:`~mtp.ops.unpermute`
builds when it is handed no :class:`~mtp.ops.moe_permute.token_map.TokenMap`.

``mtp::moe_invert_row_map`` inverts the row map on the device in one launch
(:func:`mtp.kernels.moe_row_map.invert_row_map`; two when dropless rows need their experts, or
``indices`` are checked): each row inserts itself into its token's slots, kept in ascending row
order, so the sums of the token-major kernels run in the same order as with the map
:func:`~mtp.ops.permute` built. The same launch counts what is wrong with the map (the status
word of the default, device-side check). :func:`token_map_of` makes the token map's three
tensors (views of the packed ``(row << 32) | expert`` slots) and that count of its outputs.
"""

from __future__ import annotations

import torch

from mtp.kernels import moe_row_map as _map_kernels

__all__ = ["invert_impl", "invert_row_map", "token_map_of"]


@torch.library.custom_op("mtp::moe_invert_row_map", mutates_args=())
def _invert_op(
    row_id_map: torch.Tensor,
    routing: torch.Tensor | None,
    num_tokens: int,
    num_experts: int,
    width: int,
    capacity: int,
    experts: bool,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [T, W] int64, count [T + 1] int32)``: token ``t``'s rows ascending as
    ``(row << 32) | expert`` (then int64 max), its row count, and in ``count[T]`` the problems
    found (with ``check``); ``capacity < 0``: dropless."""
    return invert_impl(row_id_map, routing, num_tokens, num_experts, width, capacity, experts,
                       check)  # fmt: skip


def invert_impl(row_id_map, routing, num_tokens, num_experts, width, capacity, experts, check):
    """The body of ``mtp::moe_invert_row_map`` (the custom op's and the eager path's)."""
    device = row_id_map.device
    packed = torch.full((num_tokens, width), _map_kernels.EMPTY_SLOT, dtype=torch.int64,
                        device=device)  # fmt: skip
    count = torch.zeros(num_tokens + 1, dtype=torch.int32, device=device)
    _map_kernels.invert_row_map(
        row_id_map.contiguous(), None if routing is None else routing.contiguous(), packed,
        count, num_experts=num_experts, capacity=capacity if capacity >= 0 else None,
        experts=experts, check=check,
    )  # fmt: skip
    return packed, count


@_invert_op.register_fake
def _(row_id_map, routing, num_tokens, num_experts, width, capacity, experts, check):
    return (
        row_id_map.new_empty((num_tokens, width), dtype=torch.int64),
        row_id_map.new_empty((num_tokens + 1,), dtype=torch.int32),
    )


def token_map_of(packed: torch.Tensor, count: torch.Tensor):
    """``(token_rows, token_experts, token_count, problems)`` of an inversion's outputs: the
    rows and experts are the high and low int32 halves of each packed slot (little-endian),
    ``problems`` a 0-d int32."""
    halves = packed.view(torch.int32)
    num_tokens = packed.shape[0]
    return halves[:, 1::2], halves[:, 0::2], count[:num_tokens], count[num_tokens]


def invert_row_map(row_id_map, routing, num_tokens, num_experts, width, capacity, experts,
                   check):
    """``mtp::moe_invert_row_map`` then :func:`token_map_of` (the traced path)."""
    packed, count = _invert_op(row_id_map, routing, num_tokens, num_experts, width, capacity,
                               experts, check)  # fmt: skip
    return token_map_of(packed, count)
