"""The row map of :func:`mtp.ops.permute` on its own, for the MoE dispatchers that permute in
pieces: :func:`moe_permute_row_map` (on the device, static shapes, no host sync; the Triton
backend also builds the :class:`~mtp.ops.moe_permute.token_map.TokenMap`, returned in a
:class:`RowMap`), the flat ``(token, expert)`` pair of each row of a given ``row_id_map``
(:func:`row_pairs`, what :func:`mtp.ops.unpermute` weights rows by) and :func:`select_probs`;
the custom op ``mtp::moe_row_map`` (two launches of :mod:`mtp.kernels.moe_row_map`, no checks),
called directly on the eager path.
"""

from __future__ import annotations

import dataclasses

import torch

from mtp import settings
from mtp.kernels import moe_row_map as _map_kernels
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import eager
from mtp.ops.moe_permute.token_map import TokenMap, poisoned_empty

__all__ = ["PERMUTE_BACKENDS", "RowMap", "moe_permute_row_map", "row_pairs", "select_probs"]

PERMUTE_BACKENDS = ("triton", "reference")


@dataclasses.dataclass(frozen=True, eq=False)
class RowMap:
    """:func:`moe_permute_row_map` with ``token_map=True``: ``row_id_map`` and ``pair`` (int64
    ``[N]``; None with ``pair=False``), the :class:`TokenMap` built with them (None on the
    reference backend) and ``tokens_per_expert`` (int64 ``[E]``: the rows of each expert,
    counted by the same launch on the Triton backend)."""

    row_id_map: torch.Tensor
    pair: torch.Tensor | None
    token_map: TokenMap | None
    tokens_per_expert: torch.Tensor | None = None


def moe_permute_row_map(
    routing_map: torch.Tensor,
    num_out_tokens: int,
    drop_and_pad: bool = False,
    capacity: int | None = None,
    *,
    backend: str = "auto",
    token_map: bool = False,
    width: int | None = None,
    pair: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | RowMap:
    """The row map of :func:`~mtp.ops.permute`, computed on the device without a host sync.

    Args:
        routing_map: ``[T, E]`` bool.
        num_out_tokens: ``N``, the number of permuted rows (``E * capacity`` when dropping).
        drop_and_pad: keep the first ``capacity`` tokens (token order) of each expert, in slots
            ``[e * capacity, (e + 1) * capacity)``.
        capacity: slots per expert (with ``drop_and_pad``).
        backend: ``"triton"`` (two launches, no sort; it also builds the token-major map that
            lets :func:`~mtp.ops.unpermute` run in one launch), ``"reference"`` (cumulative sums and
            ``searchsorted``) or ``"auto"``.
        token_map: return a :class:`RowMap` (with the :class:`TokenMap`, None on the
            reference backend, and ``tokens_per_expert``) instead of the pair.
        width: the token map's slots per token (default ``E``): the most experts a token routes
            to (a narrower map keeps a token's first ``width`` rows). The MoE dispatch passes
            ``topk``.
        pair: with ``token_map=True``, False skips the pair (``RowMap.pair`` is None).

    Returns:
        ``(row_id_map, pair)``, both int64 ``[N]``: the token of each row (``-1``: no token) and
        its flat ``(token, expert)`` index ``t * E + e`` (``T * E`` for an empty row); a
        :class:`RowMap` of them and the token map with ``token_map=True``.
    """
    if resolve_backend("permute", backend, routing_map.device, PERMUTE_BACKENDS) == "triton":
        cap = capacity if drop_and_pad else None
        want_pair = pair or not token_map
        args = (routing_map, num_out_tokens, -1 if cap is None else cap,
                -1 if width is None else width, want_pair)  # fmt: skip
        if eager(routing_map) and routing_map.device.type != "meta":
            row_id_map, pairs, rows, experts_, count, tpe = row_map_impl(*args)
        else:
            row_id_map, pairs, rows, experts_, count, tpe = torch.ops.mtp.moe_row_map(*args)
        if not token_map:
            return row_id_map, pairs
        tm = TokenMap(rows, experts_, count, routing_map.shape[1], drop_and_pad)
        return RowMap(row_id_map, pairs if want_pair else None, tm, tpe)
    row_id_map, pairs = _reference_row_map(routing_map, num_out_tokens, drop_and_pad, capacity)
    if not token_map:
        return row_id_map, pairs
    return RowMap(row_id_map, pairs, None, _reference_counts(routing_map, drop_and_pad, capacity))


def _reference_counts(routing_map, drop_and_pad, capacity):
    if drop_and_pad:
        return torch.full((routing_map.shape[1],), capacity, dtype=torch.int64,
                          device=routing_map.device)  # fmt: skip
    return routing_map.sum(dim=0, dtype=torch.int64)


@torch.library.custom_op("mtp::moe_row_map", mutates_args=())
def _row_map_op(
    routing_map: torch.Tensor, num_out_tokens: int, capacity: int, width: int = -1,
    pair: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_id_map, pair ([0] without it), token_rows, token_experts, token_count,
    tokens_per_expert)`` of a ``[T, E]`` bool routing map (``capacity < 0``: dropless; ``width
    < 0``: ``E`` slots per token); two launches, no checks."""
    return row_map_impl(routing_map, num_out_tokens, capacity, width, pair)


def row_map_impl(routing_map, num_out_tokens, capacity, width=-1, pair=True):
    """The body of ``mtp::moe_row_map``."""
    device, (num_tokens, num_experts), n = routing_map.device, routing_map.shape, num_out_tokens
    slots = num_experts if width < 0 else min(width, num_experts)
    new = poisoned_empty if settings.current().poison_outputs else torch.empty
    row_id_map = new(n, dtype=torch.int64, device=device)
    pairs = new(n if pair else 0, dtype=torch.int64, device=device)
    rows = new(num_tokens, slots, dtype=torch.int32, device=device)
    experts = new(num_tokens, slots, dtype=torch.int32, device=device)
    count = new(num_tokens, dtype=torch.int32, device=device)
    ok = new((), dtype=torch.bool, device=device)
    tpe = new(num_experts, dtype=torch.int64, device=device)
    _map_kernels.build_row_map(
        routing_map.contiguous(), num_experts, n, capacity=capacity if capacity >= 0 else None,
        probs=None, row_id_map=row_id_map, pair=pairs if pair else None, permuted_probs=None,
        token_rows=rows, token_experts=experts, token_count=count, status=ok,
        tokens_per_expert=tpe,
    )  # fmt: skip
    return row_id_map, pairs, rows, experts, count, tpe


@_row_map_op.register_fake
def _(routing_map, num_out_tokens, capacity, width=-1, pair=True):
    (num_tokens, num_experts), n = routing_map.shape, num_out_tokens
    slots = num_experts if width < 0 else min(width, num_experts)
    i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
    return (
        routing_map.new_empty((n,), **i64),
        routing_map.new_empty((n if pair else 0,), **i64),
        routing_map.new_empty((num_tokens, slots), **i32),
        routing_map.new_empty((num_tokens, slots), **i32),
        routing_map.new_empty((num_tokens,), **i32),
        routing_map.new_empty((num_experts,), **i64),
    )


def _reference_row_map(routing_map, num_out_tokens, drop_and_pad, capacity):
    tokens, experts = routing_map.shape
    device = routing_map.device
    if drop_and_pad:
        # Position of each token among the tokens of its expert, then the (s+1)-th one per slot.
        ranks = torch.cumsum(routing_map.t(), dim=1, dtype=torch.int32)  # [E, T]
        want = torch.arange(1, capacity + 1, device=device, dtype=torch.int32)
        token = torch.searchsorted(ranks, want.expand(experts, capacity).contiguous())  # [E, C]
        valid = token < tokens
        expert = torch.arange(experts, device=device, dtype=torch.int64).unsqueeze(1)
        pair = torch.where(valid, token * experts + expert, tokens * experts)
        row_id_map = torch.where(valid, token, -1)
        return row_id_map.reshape(-1), pair.reshape(-1)
    if tokens * experts == 0:
        none = torch.full((num_out_tokens,), -1, device=device, dtype=torch.int64)
        return none, torch.full_like(none, tokens * experts)
    # Cumulative count over the expert-major flattening (e * T + t): row i is the pair where the
    # count first reaches i + 1 (Megatron's stable argsort of routing_map.T, without the sort).
    count_dtype = torch.int32 if tokens * experts < 2**31 else torch.int64
    counts = torch.cumsum(routing_map.t().reshape(-1), dim=0, dtype=count_dtype)
    want = torch.arange(1, num_out_tokens + 1, device=device, dtype=count_dtype)
    flat = torch.searchsorted(counts, want)
    valid = flat < tokens * experts
    flat = torch.where(valid, flat, 0)
    token, expert = flat % tokens, flat // tokens
    row_id_map = torch.where(valid, token, -1)
    pair = torch.where(valid, token * experts + expert, tokens * experts)
    return row_id_map, pair


def row_pairs(
    row_id_map: torch.Tensor,
    num_tokens: int,
    num_experts: int,
    routing_map: torch.Tensor | None,
    drop_and_pad: bool,
) -> torch.Tensor:
    """Flat ``(token, expert)`` index of each permuted row (``T * E`` where it has none), from
    ``row_id_map`` and the expert layout: ``capacity`` slots per expert, or the per-expert
    counts of ``routing_map``."""
    n = row_id_map.shape[0]
    device = row_id_map.device
    rows = torch.arange(n, device=device, dtype=torch.int64)
    if drop_and_pad:
        expert = rows // max(n // max(num_experts, 1), 1)
    else:
        ends = torch.cumsum(routing_map.sum(dim=0, dtype=torch.int64), dim=0)
        expert = torch.searchsorted(ends, rows, right=True)
    token = row_id_map.to(torch.int64)
    valid = (token >= 0) & (token < num_tokens) & (expert < num_experts)
    return torch.where(valid, token * num_experts + expert, num_tokens * num_experts)


def select_probs(probs: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """The probability of each permuted row: ``probs.flatten()[pair]``, ``0`` where
    ``pair == T * E`` (an empty slot). Differentiable; ``pair`` as built with the row map."""
    flat = torch.cat([probs.reshape(-1), probs.new_zeros(1)])
    return flat.index_select(0, pair)
