"""MoE permutation row map built on the device: count per expert, then place (Triton).

Megatron-Core's order (rows grouped by expert, ascending token within an expert; with
``drop_and_pad`` expert ``e`` owns slots ``[e * C, (e + 1) * C)`` and keeps its first ``C``
tokens) without a sort, in two launches:

1. :func:`_count_kernel`, one program per chunk of tokens: ``counts[c, e]``, the tokens of chunk
   ``c`` routed to expert ``e`` (column ``E``: tokens of the chunk whose ``indices`` are not
   ``k`` distinct experts in ``[0, E)``).
2. :func:`_place_kernel`, one program per chunk: the exclusive scan of the counts over
   ``(expert, chunk)`` (each program scans the small ``[chunks, E]`` table itself, so no third
   launch is needed), then for every routed ``(t, e)`` of the chunk its row: the expert's first
   row plus the tokens of earlier chunks plus the rank inside the chunk (a cumulative sum along
   the tokens of a tile). It writes

   - ``row_id_map[N]`` (int64, the token of each row; ``-1`` for a row that holds none),
   - optionally ``pair[N]`` (``t * E + e``; ``T * E`` for an empty row) and
     ``permuted_probs[N]`` (``probs[t, e]``; 0 for an empty row),
   - the token-major map shared by the data kernels of :mod:`mtp.kernels.moe_permute`:
     ``token_count[T]`` and, for ``j < token_count[t]``, ``token_rows[t, j]`` /
     ``token_experts[t, j]``: the rows of token ``t`` in ascending order and their experts,
   - ``status[1]`` (bool): the routing is valid (``indices`` distinct and in range; dropless:
     the routed pairs equal ``N``).

Routing is a ``[T, E]`` bool map or ``[T, k]`` top-k expert numbers (turned into the same tile
on the fly). All offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2

__all__ = ["build_row_map", "map_config", "MAX_CHUNKS"]

#: Most chunks (programs) of the two kernels: each place program reads the whole
#: ``[chunks, E + 1]`` count table, so the table is kept small.
MAX_CHUNKS = 64
#: Elements of one ``[tokens, experts]`` tile, and the warps of the two kernels.
TILE = 2048
NUM_WARPS = 8


def map_config(num_tokens: int, num_experts: int) -> tuple[int, int, int, int]:
    """``(E_BLOCK, SUB_T, tokens_per_chunk, chunks)`` of the row-map kernels."""
    e_block = next_power_of_2(num_experts + 1)
    sub_t = max(1, min(TILE // e_block, next_power_of_2(max(num_tokens, 1))))
    tiles = triton.cdiv(max(num_tokens, 1), sub_t)
    per_chunk = triton.cdiv(tiles, min(tiles, MAX_CHUNKS)) * sub_t
    return e_block, sub_t, per_chunk, triton.cdiv(max(num_tokens, 1), per_chunk)


@triton.jit
def _routing_tile(route_ptr, t0, t_end, E, IS_INDICES: tl.constexpr, K: tl.constexpr,
                  SUB_T: tl.constexpr, E_BLOCK: tl.constexpr):
    """int32 ``[SUB_T, E_BLOCK]`` 0/1 tile of tokens ``t0 + i`` (< ``t_end``), the tokens, their
    mask and (indices) which tokens do not name ``K`` distinct experts in range."""
    toks = t0 + tl.arange(0, SUB_T)
    tmask = toks < t_end
    toks64 = toks.to(tl.int64)
    ex = tl.arange(0, E_BLOCK)
    emask = ex < E
    if IS_INDICES:
        hit = tl.zeros([SUB_T, E_BLOCK], dtype=tl.int32)
        for j in tl.static_range(K):
            idx = tl.load(route_ptr + toks64 * K + j, mask=tmask, other=-1).to(tl.int32)
            hit = tl.where((idx[:, None] == ex[None, :]) & emask[None, :], 1, hit)
        bad = tmask & (tl.sum(hit, axis=1) != K)
    else:
        m = tmask[:, None] & emask[None, :]
        hit = tl.load(route_ptr + toks64[:, None] * E + ex[None, :], mask=m, other=0)
        hit = (hit != 0).to(tl.int32)
        bad = toks < 0  # all False
    return hit, toks64, tmask, bad


@triton.jit
def _count_kernel(route_ptr, counts_ptr, T, E, tokens_per_chunk, IS_INDICES: tl.constexpr,
                  K: tl.constexpr, SUB_T: tl.constexpr, E_BLOCK: tl.constexpr):
    c = tl.program_id(0)
    ex = tl.arange(0, E_BLOCK)
    cnt = tl.zeros([E_BLOCK], dtype=tl.int32)
    nbad = tl.zeros([SUB_T], dtype=tl.int32)
    t0 = c * tokens_per_chunk
    t_end = tl.minimum(t0 + tokens_per_chunk, T)
    while t0 < t_end:
        hit, _, _, bad = _routing_tile(route_ptr, t0, t_end, E, IS_INDICES, K, SUB_T, E_BLOCK)
        cnt += tl.sum(hit, axis=0)
        nbad += bad.to(tl.int32)
        t0 += SUB_T
    # Column E carries the chunk's invalid tokens.
    cnt = tl.where(ex == E, tl.sum(nbad, axis=0), cnt)
    tl.store(counts_ptr + c * (E + 1) + ex, cnt, mask=ex <= E)


@triton.jit
def _place_kernel(
    route_ptr, probs_ptr, counts_ptr, row_id_ptr, pair_ptr, pprobs_ptr,
    trows_ptr, texp_ptr, tcount_ptr, status_ptr,
    T, E, N, capacity, tokens_per_chunk, num_chunks, rows_per_chunk, S,
    IS_INDICES: tl.constexpr, K: tl.constexpr, DROP: tl.constexpr, HAS_PROBS: tl.constexpr,
    WRITE_PAIR: tl.constexpr, SUB_T: tl.constexpr, E_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    ex = tl.arange(0, E_BLOCK)
    emask = ex < E
    # Exclusive scan of the count table: totals per expert and this chunk's head start.
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    before = tl.zeros([E_BLOCK], dtype=tl.int32)
    cc = 0
    while cc < num_chunks:
        v = tl.load(counts_ptr + cc * (E + 1) + ex, mask=ex <= E, other=0)
        total += v
        before += tl.where(cc < c, v, 0)
        cc += 1
    nbad = tl.sum(tl.where(ex == E, total, 0), axis=0)
    total = tl.where(emask, total, 0)
    routed = tl.sum(total, axis=0)
    if DROP:
        base = ex.to(tl.int64) * capacity + before
        ok = nbad == 0
    else:
        base = (tl.cumsum(total, axis=0) - total + before).to(tl.int64)
        ok = (nbad == 0) & (routed == N)
    if c == 0:
        tl.store(status_ptr, ok)

    run = tl.zeros([E_BLOCK], dtype=tl.int32)
    t0 = c * tokens_per_chunk
    t_end = tl.minimum(t0 + tokens_per_chunk, T)
    while t0 < t_end:
        hit, toks, tmask, _ = _routing_tile(route_ptr, t0, t_end, E, IS_INDICES, K, SUB_T, E_BLOCK)
        rank = tl.cumsum(hit, axis=0) - hit + run[None, :]
        row = base[None, :] + rank
        if DROP:
            kept = (hit != 0) & ((before[None, :] + rank) < capacity)
        else:
            kept = (hit != 0) & (row < N)
        run += tl.sum(hit, axis=0)
        tok2 = toks[:, None] + tl.zeros([SUB_T, E_BLOCK], dtype=tl.int64)
        tl.store(row_id_ptr + row, tok2, mask=kept)
        if WRITE_PAIR:
            tl.store(pair_ptr + row, tok2 * E + ex[None, :], mask=kept)
        if HAS_PROBS:
            p = tl.load(probs_ptr + tok2 * E + ex[None, :], mask=kept, other=0.0)
            tl.store(pprobs_ptr + row, p, mask=kept)
        k32 = kept.to(tl.int32)
        slot = tok2 * S + (tl.cumsum(k32, axis=1) - k32)
        tl.store(trows_ptr + slot, row.to(tl.int32), mask=kept)
        tl.store(texp_ptr + slot, (ex[None, :] + tl.zeros([SUB_T, E_BLOCK], dtype=tl.int32)),
                 mask=kept)
        tl.store(tcount_ptr + toks, tl.sum(k32, axis=1), mask=tmask)
        t0 += SUB_T

    # Rows that hold no token, in this chunk's share of the rows.
    r0 = c * rows_per_chunk
    r_end = tl.minimum(r0 + rows_per_chunk, N)
    while r0 < r_end:
        rows = r0 + tl.arange(0, ROW_BLOCK)
        rmask = rows < r_end
        if DROP:
            e_of = rows // capacity
            held = tl.sum(tl.where(e_of[:, None] == ex[None, :], total[None, :], 0), axis=1)
            empty = rmask & ((rows - e_of * capacity) >= held)
        else:
            empty = rmask & (rows >= routed)
        rows64 = rows.to(tl.int64)
        tl.store(row_id_ptr + rows64, tl.full([ROW_BLOCK], -1, tl.int64), mask=empty)
        if WRITE_PAIR:
            tl.store(pair_ptr + rows64, tl.full([ROW_BLOCK], 0, tl.int64) + T * E, mask=empty)
        if HAS_PROBS:
            tl.store(pprobs_ptr + rows64, tl.zeros([ROW_BLOCK], dtype=tl.float32), mask=empty)
        r0 += ROW_BLOCK


def build_row_map(
    routing: torch.Tensor,
    num_experts: int,
    num_out_tokens: int,
    *,
    capacity: int | None,
    probs: torch.Tensor | None,
    row_id_map: torch.Tensor,
    pair: torch.Tensor | None,
    permuted_probs: torch.Tensor | None,
    token_rows: torch.Tensor,
    token_experts: torch.Tensor,
    token_count: torch.Tensor,
    status: torch.Tensor,
) -> None:
    """Launch the two row-map kernels (see the module doc).

    Args:
        routing: ``[T, E]`` bool routing map, or ``[T, k]`` int32/int64 expert numbers.
        num_experts: ``E``.
        num_out_tokens: ``N`` rows (``E * capacity`` with a capacity).
        capacity: slots per expert (drop and pad), or None (dropless).
        probs: optional contiguous ``[T, E]`` probabilities (gathered into ``permuted_probs``).
        row_id_map: ``[N]`` int64 output; pair: optional ``[N]`` int64 output;
        permuted_probs: ``[N]`` output in probs' dtype (with ``probs``).
        token_rows, token_experts: ``[T, S]`` int32 outputs (``S`` = k for indices, else E);
        token_count: ``[T]`` int32; status: ``[1]`` bool.
    """
    num_tokens = routing.shape[0]
    is_indices = routing.dtype != torch.bool
    k = routing.shape[1] if is_indices else 1
    e_block, sub_t, per_chunk, chunks = map_config(num_tokens, num_experts)
    counts = torch.empty((chunks, num_experts + 1), dtype=torch.int32, device=routing.device)
    common = dict(IS_INDICES=is_indices, K=k, SUB_T=sub_t, E_BLOCK=e_block)
    _count_kernel[(chunks,)](routing, counts, num_tokens, num_experts, per_chunk, **common,
                             num_warps=NUM_WARPS)
    rows_per_chunk = triton.cdiv(num_out_tokens, chunks)
    _place_kernel[(chunks,)](
        routing, probs if probs is not None else counts, counts, row_id_map,
        pair if pair is not None else row_id_map,
        permuted_probs if permuted_probs is not None else counts,
        token_rows, token_experts, token_count, status,
        num_tokens, num_experts, num_out_tokens, capacity or 0, per_chunk, chunks,
        rows_per_chunk, token_rows.shape[1],
        DROP=capacity is not None, HAS_PROBS=probs is not None, WRITE_PAIR=pair is not None,
        ROW_BLOCK=max(1, TILE // e_block), num_warps=NUM_WARPS, **common,
    )  # fmt: skip
