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
     the routed pairs equal ``N``),
   - optionally ``tokens_per_expert[E]`` (int64): the rows of each expert (``capacity`` each
     when dropping), from the counts the scan already sums.

   A token map narrower than ``E`` (``S`` slots) keeps a token's first ``S`` rows: the MoE
   dispatch sizes it ``topk`` (a token routes to at most ``topk`` experts).

A small routing (at most :data:`FUSE_COUNT` ``[T, E_BLOCK]`` elements) skips the first launch:
each place program counts the whole routing itself (``FUSED``).

Routing is a ``[T, E]`` bool map or ``[T, k]`` top-k expert numbers (turned into the same tile
on the fly). All offsets are int64. :func:`invert_row_map` goes the other way: the token-major
map of a given row map, in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2
from mtp.kernels._launch import Launch, Plans, aligned

__all__ = [
    "MAX_CHUNKS",
    "build_row_map",
    "invert_row_map",
    "map_config",
    "row_map_plan",
    "run_row_map",
]

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
def _chunk_counts(route_ptr, c, T, E, tokens_per_chunk, IS_INDICES: tl.constexpr,
                  K: tl.constexpr, SUB_T: tl.constexpr, E_BLOCK: tl.constexpr):
    """``[E_BLOCK]`` int32: the tokens of chunk ``c`` routed to each expert; column ``E``: the
    chunk's tokens whose ``indices`` are not ``K`` distinct experts in range."""
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
    return tl.where(ex == E, tl.sum(nbad, axis=0), cnt)


@triton.jit
def _count_kernel(route_ptr, counts_ptr, T, E, tokens_per_chunk, IS_INDICES: tl.constexpr,
                  K: tl.constexpr, SUB_T: tl.constexpr, E_BLOCK: tl.constexpr):
    c = tl.program_id(0)
    ex = tl.arange(0, E_BLOCK)
    cnt = _chunk_counts(route_ptr, c, T, E, tokens_per_chunk, IS_INDICES, K, SUB_T, E_BLOCK)
    tl.store(counts_ptr + c * (E + 1) + ex, cnt, mask=ex <= E)


@triton.jit
def _place_kernel(
    route_ptr, probs_ptr, counts_ptr, row_id_ptr, pair_ptr, pprobs_ptr,
    trows_ptr, texp_ptr, tcount_ptr, status_ptr, tpe_ptr,
    T, E, N, capacity, tokens_per_chunk, num_chunks, rows_per_chunk, S,
    IS_INDICES: tl.constexpr, K: tl.constexpr, DROP: tl.constexpr, HAS_PROBS: tl.constexpr,
    WRITE_PAIR: tl.constexpr, SUB_T: tl.constexpr, E_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr, FUSED: tl.constexpr = False, WRITE_COUNTS: tl.constexpr = False,
):
    c = tl.program_id(0)
    ex = tl.arange(0, E_BLOCK)
    emask = ex < E
    # Exclusive scan of the count table: totals per expert and this chunk's head start.
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    before = tl.zeros([E_BLOCK], dtype=tl.int32)
    cc = 0
    while cc < num_chunks:
        if FUSED:  # a small routing: every program counts it itself (no count launch)
            v = _chunk_counts(route_ptr, cc, T, E, tokens_per_chunk, IS_INDICES, K, SUB_T,
                              E_BLOCK)  # fmt: skip
        else:
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
        if WRITE_COUNTS:  # the rows of each expert (tokens_per_expert)
            if DROP:
                tl.store(tpe_ptr + ex, tl.zeros([E_BLOCK], dtype=tl.int64) + capacity, mask=emask)
            else:
                tl.store(tpe_ptr + ex, total.to(tl.int64), mask=emask)

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
        j = tl.cumsum(k32, axis=1) - k32  # the slot of each kept pair among its token's
        slot = tok2 * S + j
        fits = kept & (j < S)  # a map narrower than E holds a token's first S rows
        tl.store(trows_ptr + slot, row.to(tl.int32), mask=fits)
        tl.store(texp_ptr + slot, (ex[None, :] + tl.zeros([SUB_T, E_BLOCK], dtype=tl.int32)),
                 mask=fits)
        tl.store(tcount_ptr + toks, tl.minimum(tl.sum(k32, axis=1), S), mask=tmask)
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


_PLANS = Plans()


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
    tokens_per_expert: torch.Tensor | None = None,
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
        token_rows, token_experts: ``[T, S]`` int32 outputs (``S``: at most the routing's
            width, k for indices or E; a narrower map keeps each token's first ``S`` rows);
        token_count: ``[T]`` int32; status: ``[1]`` bool.
        tokens_per_expert: optional ``[E]`` int64 output, the rows of each expert.
    """
    tpe = tokens_per_expert
    key = (routing.shape, routing.dtype, num_experts, num_out_tokens, capacity,
           token_rows.shape[1], None if probs is None else probs.dtype, pair is None,
           None if permuted_probs is None else permuted_probs.dtype, tpe is None,
           aligned(routing, probs, row_id_map, pair, permuted_probs, token_rows, token_experts,
                   token_count, status, tpe), routing.device)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, row_map_plan(routing, num_experts, num_out_tokens, capacity,
                                            probs, row_id_map, pair, permuted_probs, token_rows,
                                            token_experts, token_count, status, tpe))  # fmt: skip
    run_row_map(plan, routing, probs, row_id_map, pair, permuted_probs, token_rows,
                token_experts, token_count, status, tpe)


def run_row_map(plan, routing, probs, row_id_map, pair, permuted_probs, token_rows, token_experts,
                token_count, status, tokens_per_expert=None) -> None:
    """Run a :func:`row_map_plan` on the arguments it was made for (see :func:`build_row_map`)."""
    count, place, (chunks, columns), count_ints, place_ints = plan
    counts = status  # unused by a place kernel that counts itself
    if count is not None:
        counts = torch.empty(chunks, columns, dtype=torch.int32, device=routing.device)
        count(routing, counts, *count_ints)
    place(
        routing, probs if probs is not None else status, counts, row_id_map,
        pair if pair is not None else status,
        permuted_probs if permuted_probs is not None else status,
        token_rows, token_experts, token_count, status,
        tokens_per_expert if tokens_per_expert is not None else status, *place_ints,
    )  # fmt: skip


def row_map_plan(routing, num_experts, n, capacity, probs, row_id_map, pair, pprobs, token_rows,
                 token_experts, token_count, status, tokens_per_expert=None) -> tuple:
    """The launches of :func:`build_row_map` for arguments like these (same shapes, dtypes,
    alignment, options), for :func:`run_row_map`."""
    num_tokens = routing.shape[0]
    is_indices = routing.dtype != torch.bool
    k = routing.shape[1] if is_indices else 1
    e_block, sub_t, per_chunk, chunks = map_config(num_tokens, num_experts)
    common = dict(IS_INDICES=is_indices, K=k, SUB_T=sub_t, E_BLOCK=e_block, num_warps=NUM_WARPS)
    count_ints = (num_tokens, num_experts, per_chunk)
    count, counts = _count_launch(routing, num_experts, chunks, count_ints, common)
    counts = status if counts is None else counts  # as run_row_map passes it
    place_ints = (num_tokens, num_experts, n, capacity or 0, per_chunk, chunks,
                  triton.cdiv(n, chunks), token_rows.shape[1])
    # status stands for the pointers the flags leave unused
    args = (routing, probs if probs is not None else status, counts, row_id_map,
            pair if pair is not None else status, pprobs if pprobs is not None else status,
            token_rows, token_experts, token_count, status,
            tokens_per_expert if tokens_per_expert is not None else status, *place_ints)
    place = Launch(_place_kernel, (chunks,), args, dict(
        DROP=capacity is not None, HAS_PROBS=probs is not None, WRITE_PAIR=pair is not None,
        ROW_BLOCK=max(1, TILE // e_block), FUSED=count is None,
        WRITE_COUNTS=tokens_per_expert is not None, **common))  # fmt: skip
    return count, place, (chunks, num_experts + 1), count_ints, place_ints


#: A routing of at most this many ``[tokens, E_BLOCK]`` elements is counted by every program
#: that needs its counts (a few tiles each) instead of by a count launch.
FUSE_COUNT = 16384


def _count_launch(routing, num_experts, chunks, count_ints, common):
    """``(count launch, counts table)`` of a routing, or ``(None, None)`` when it is small enough
    for the programs that read the table to count it themselves."""
    if routing.shape[0] * common["E_BLOCK"] <= FUSE_COUNT:
        return None, None
    counts = torch.empty((chunks, num_experts + 1), dtype=torch.int32, device=routing.device)
    return Launch(_count_kernel, (chunks,), (routing, counts, *count_ints), common), counts


# --------------------------------------------------------------------------------------------
# The inverse: the token-major map of a given row map, in one launch
# --------------------------------------------------------------------------------------------

#: The empty slot of the packed ``(row << 32) | expert`` map (int64 max).
EMPTY_SLOT = 2**63 - 1
_EMPTY = tl.constexpr(EMPTY_SLOT)
#: Most programs of the inversion kernel (each reads the ``[chunks, E + 1]`` count table).
MAX_INVERT_PROGRAMS = 256
#: Elements of one ``[rows, E_BLOCK]`` tile of the inversion (the expert of each row).
INVERT_TILE = 4096


@triton.jit
def _invert_kernel(
    row_id_ptr, route_ptr, counts_ptr, packed_ptr, tcount_ptr,
    N, T, E, W, capacity, num_chunks, tokens_per_chunk, rows_per_program,
    ROUTE: tl.constexpr, K: tl.constexpr, EXPERTS: tl.constexpr, COUNTS: tl.constexpr,
    CHECK: tl.constexpr, SUB_R: tl.constexpr, E_BLOCK: tl.constexpr, SUB_T: tl.constexpr = 1,
    FUSED: tl.constexpr = False,
):
    # Each row r holding token t inserts (r << 32) | e into the W slots of t, kept sorted by
    # atomic_min: at slot j the smaller of the two values stays and the larger moves on to
    # j + 1, until an empty slot takes it. Slots only decrease and a value reaches j + 1 only
    # after j held a smaller one, so once every row is in, each token's slots hold its rows
    # in ascending order (whatever order the programs ran in). tcount[t] = filled slots;
    # tcount[T] += the problems found (CHECK).
    pid = tl.program_id(0)
    ex = tl.arange(0, E_BLOCK)
    nbad = tl.zeros([SUB_R], dtype=tl.int32)
    if COUNTS:
        total = tl.zeros([E_BLOCK], dtype=tl.int32)
        cc = 0
        while cc < num_chunks:
            if FUSED:
                total += _chunk_counts(route_ptr, cc, T, E, tokens_per_chunk, ROUTE == 2, K,
                                       SUB_T, E_BLOCK)  # fmt: skip
            else:
                total += tl.load(counts_ptr + cc * (E + 1) + ex, mask=ex <= E, other=0)
            cc += 1
        # expert e's rows end at ends[e] (dropless layout); column E: invalid index rows
        ends = tl.cumsum(tl.where(ex < E, total, 0), axis=0).to(tl.int64)
        ends = tl.where(ex < E, ends, 2**62)
        if CHECK:
            nbad += tl.where((tl.arange(0, SUB_R) == 0) & (pid == 0),
                             tl.sum(tl.where(ex == E, total, 0), axis=0), 0)
    r0 = pid * rows_per_program
    r_end = tl.minimum(r0 + rows_per_program, N)
    while r0 < r_end:
        r = r0 + tl.arange(0, SUB_R)
        rmask = r < r_end
        r64 = r.to(tl.int64)
        t = tl.load(row_id_ptr + r64, mask=rmask, other=-1).to(tl.int64)
        valid = rmask & (t >= 0) & (t < T)
        if CHECK:
            nbad += (rmask & ((t < -1) | (t >= T))).to(tl.int32)
        if EXPERTS == 1:  # drop and pad: capacity slots per expert
            e = r64 // capacity
        elif EXPERTS == 2:  # dropless: the expert whose rows hold r
            e = tl.sum((ends[None, :] <= r64[:, None]).to(tl.int64), axis=1)
            if CHECK:
                nbad += (valid & (e >= E)).to(tl.int32)
            valid = valid & (e < E)
        else:
            e = tl.zeros([SUB_R], dtype=tl.int64)
        ts = tl.where(valid, t, 0)
        if CHECK and EXPERTS != 0:
            if ROUTE == 1:  # [T, E] bool map
                routed = tl.load(route_ptr + ts * E + e, mask=valid, other=1) != 0
            elif ROUTE == 2:  # [T, K] expert numbers
                routed = tl.zeros([SUB_R], dtype=tl.int1)
                for j in tl.static_range(K):
                    idx = tl.load(route_ptr + ts * K + j, mask=valid, other=-1).to(tl.int64)
                    routed = routed | (idx == e)
            else:
                routed = valid
            nbad += (valid & ~routed).to(tl.int32)
        v = tl.where(valid, (r64 << 32) | e, _EMPTY)
        active = valid
        j = 0
        while (j < W) & (tl.max(active.to(tl.int32), axis=0) > 0):
            old = tl.atomic_min(packed_ptr + ts * W + j, v, mask=active)
            tl.atomic_max(tcount_ptr + ts, tl.full([SUB_R], 0, tl.int32) + j + 1,
                          mask=active & (old == _EMPTY))
            v = tl.maximum(old, v)
            active = active & (old != _EMPTY)
            j += 1
        if CHECK:
            nbad += active.to(tl.int32)  # more than W rows for a token
        r0 += SUB_R
    if CHECK:
        tl.atomic_add(tcount_ptr + T, tl.sum(nbad, axis=0))


def invert_row_map(
    row_id_map: torch.Tensor,
    routing: torch.Tensor | None,
    packed: torch.Tensor,
    token_count: torch.Tensor,
    *,
    num_experts: int,
    capacity: int | None,
    experts: bool,
    check: bool,
) -> None:
    """The token-major map of ``row_id_map``: one launch (two when the dropless experts or the
    index check need the per-expert counts of ``routing``).

    Args:
        row_id_map: ``[N]`` int32/int64, the token of each row (``-1``: none).
        routing: ``[T, E]`` bool or ``[T, k]`` expert numbers, or None; read for the experts of
            dropless rows (``experts`` without ``capacity``) and, with ``check``, to see that
            each row's ``(token, expert)`` pair is routed.
        packed: ``[T, W]`` int64 output, filled with :data:`EMPTY_SLOT` beforehand: token
            ``t``'s rows ascending, each as ``(row << 32) | expert`` (expert 0 without
            ``experts``), then empty slots.
        token_count: ``[T + 1]`` int32 output, zero beforehand: the rows of each token, and in
            ``token_count[T]`` (with ``check``) the problems found: a token number outside
            ``[-1, T)``, a row past the routed rows or not routed to its expert, more than
            ``W`` rows for a token, invalid ``indices``.
        num_experts: ``E``.
        capacity: slots per expert with drop and pad (row ``i`` belongs to expert
            ``i // capacity``), or None (dropless: the experts' row counts come from
            ``routing``).
        experts: store each row's expert (what a weighted unpermute needs).
        check: count the problems into ``token_count[T]``.
    """
    route = 0 if routing is None else (1 if routing.dtype == torch.bool else 2)
    key = ("invert", row_id_map.shape[0], row_id_map.dtype, packed.shape, num_experts, capacity,
           None if routing is None else (routing.shape, routing.dtype), experts, check,
           aligned(row_id_map, routing, packed, token_count), row_id_map.device)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _invert_plan(row_id_map, routing, packed, token_count,
                                            num_experts, capacity, experts, check))
    count, invert, chunks, count_ints, invert_ints = plan
    counts = token_count
    if count is not None:
        counts = torch.empty((chunks, num_experts + 1), dtype=torch.int32, device=packed.device)
        count(routing, counts, *count_ints)
    if invert is not None:
        invert(row_id_map, routing if route else row_id_map, counts, packed, token_count,
               *invert_ints)


def _invert_plan(row_id_map, routing, packed, token_count, num_experts, capacity, experts,
                 check):
    n = row_id_map.shape[0]
    num_tokens, width = packed.shape
    route = 0 if routing is None else (1 if routing.dtype == torch.bool else 2)
    mode = 0 if not experts else (1 if capacity is not None else 2)
    if mode == 2 and route == 0:
        raise ValueError("invert_row_map: dropless experts need the routing")
    k = routing.shape[1] if route == 2 else 1
    e_block = next_power_of_2(num_experts + 1)
    count, counts, counted = None, token_count, mode == 2 or (check and route == 2)
    chunks, count_ints, sub_t, per_chunk = 1, (), 1, 1
    if counted:
        _, sub_t, per_chunk, chunks = map_config(num_tokens, num_experts)
        count_ints = (num_tokens, num_experts, per_chunk)
        common = dict(IS_INDICES=route == 2, K=k, SUB_T=sub_t, E_BLOCK=e_block,
                      num_warps=NUM_WARPS)
        count, counts = _count_launch(routing, num_experts, chunks, count_ints, common)
        counts = token_count if counts is None else counts  # as invert_row_map passes it
    sub_r = max(16, INVERT_TILE // e_block) if mode == 2 else 256
    blocks = triton.cdiv(n, sub_r)
    per_program = triton.cdiv(blocks, max(1, min(blocks, MAX_INVERT_PROGRAMS))) * sub_r
    invert = None
    invert_ints = (n, num_tokens, num_experts, width, capacity or 1, chunks, per_chunk,
                   per_program)
    if n:
        args = (row_id_map, routing if route else row_id_map, counts, packed, token_count,
                *invert_ints)
        invert = Launch(_invert_kernel, (triton.cdiv(n, per_program),), args, dict(
            ROUTE=route, K=k, EXPERTS=mode, COUNTS=counted, CHECK=check, SUB_R=sub_r,
            E_BLOCK=e_block, SUB_T=sub_t, FUSED=counted and count is None,
            num_warps=4))  # fmt: skip
    return count, invert, chunks, count_ints, invert_ints
