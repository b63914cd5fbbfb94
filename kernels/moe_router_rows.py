"""``@triton.jit`` row helpers of the fused router (:mod:`mtp.kernels.moe_router`): reductions
over a ``[BLOCK_T, GP, SP]`` tile's rows, the in-register top-k (NaN largest, ties to the lowest
index), the group-limited selection, softmax pieces and the scaling of the probabilities.

The top-k loops are unrolled (``tl.static_range``): Triton's software pipeliner leaves a loop
with a nested loop alone, and the forward's row loop is to be pipelined."""

from __future__ import annotations

import triton
import triton.language as tl

_BIG = tl.constexpr(1 << 30)
_NAN_FIRST = tl.constexpr(1 << 20)


@triton.jit
def _rmax(x):
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _rmin(x):
    return tl.min(tl.min(x, axis=2), axis=1)


@triton.jit
def _rsum(x):
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _bc(v):
    """``[BLOCK_T]`` -> ``[BLOCK_T, 1, 1]``."""
    return v[:, None, None]


@triton.jit
def _topk(v, rank, free0, K: tl.constexpr):
    """The ``K`` largest of ``v`` over ``free0`` as a bool tile: NaN counts as the largest,
    ties go to the lowest ``rank`` (the padded flat index)."""
    nan = v != v
    key = tl.where(nan, float("inf"), v)
    order = tl.where(nan, rank, rank + _NAN_FIRST)
    chosen = free0 & (rank < 0)
    for _ in tl.static_range(K):
        free = free0 & ~chosen
        best = _rmax(tl.where(free, key, float("-inf")))
        cand = free & (key == _bc(best))
        first = _rmin(tl.where(cand, order, _BIG))
        chosen = chosen | (order == _bc(first))
    return chosen


@triton.jit
def _group_keep(sel, rank, allowed, g, NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr,
                GROUP_M: tl.constexpr):  # fmt: skip
    """``[BLOCK_T, GP, 1]`` bool: the ``GROUP_TOPK`` groups with the largest sum of their
    ``GROUP_M`` best values (summed best first, as ``topk(...).values.sum()``)."""
    nan = sel != sel
    key = tl.where(nan, float("inf"), sel)
    order = tl.where(nan, rank, rank + _NAN_FIRST)
    taken = allowed & (rank < 0)
    score = tl.zeros_like(tl.sum(key, axis=2))
    for _ in tl.static_range(GROUP_M):
        free = allowed & ~taken
        best = tl.max(tl.where(free, key, float("-inf")), axis=2)
        cand = free & (key == best[:, :, None])
        first = tl.min(tl.where(cand, order, _BIG), axis=2)
        pick = order == first[:, :, None]
        taken = taken | pick
        score += tl.sum(tl.where(pick, sel, 0.0), axis=2)
    gscore = tl.where(g < NUM_GROUPS, score[:, :, None], float("-inf"))
    return _topk(gscore, g, (gscore == gscore) | (gscore != gscore), GROUP_TOPK)


@triton.jit
def _scaled(p, SCALE_HI: tl.constexpr, SCALE_LO: tl.constexpr):
    """``p * scale``; ``scale = SCALE_HI + SCALE_LO`` (fp32 constants: the low part keeps an
    fp64 scale exact in fp64 math, and is 0 in fp32)."""
    if SCALE_LO != 0.0:
        return p * SCALE_HI + p * SCALE_LO
    return p * SCALE_HI


@triton.jit
def _columns(NUM_GROUPS: tl.constexpr, S: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr):
    """``[1, GP, SP]``: the expert slots that exist, their column (expert index) and group."""
    g = tl.arange(0, GP)[None, :, None]
    s = tl.arange(0, SP)[None, None, :]
    return (g < NUM_GROUPS) & (s < S), g * S + s, g


@triton.jit
def _chosen_softmax(x, chosen):
    """``softmax(x[chosen])`` spread over the tile (0 elsewhere; 0 on rows with none chosen)."""
    mk = _rmax(tl.where(chosen, x, float("-inf")))
    ek = tl.where(chosen, tl.exp(x - _bc(mk)), 0.0)
    den = _rsum(ek)  # >= 1 on a token's row, 0 on the tile's padding rows
    return ek / _bc(tl.where(den == 0.0, 1.0, den))


@triton.jit
def _softmax_parts(x, allowed):
    """Row max, ``exp(x - max)`` (0 off the experts) and its sum."""
    mx = _rmax(tl.where(allowed, x, float("-inf")))
    ex = tl.where(allowed, tl.exp(x - _bc(mx)), 0.0)
    return mx, ex, _rsum(ex)
