"""Fused MoE router: scores, (group-limited) top-k, probabilities and the auxiliary-loss
statistics of ``[T, E]`` router logits in one launch, and the logits' gradient in one launch.

Notation per token (row) ``x`` of ``E`` logits, math in fp32 (fp64 for fp64 logits):
``soft = softmax(x)``, ``sig = sigmoid(x)``. Score functions (``SCORE``):

- ``0`` softmax after the top-k: experts chosen on ``x (+ bias)``, ``probs = softmax(x[chosen])``;
- ``1`` softmax before the top-k: chosen on ``soft (+ bias)``, ``probs = soft[chosen]``;
- ``2`` sigmoid: chosen on ``sig (+ bias)``, ``probs = sig[chosen]``.

With ``RENORM`` the chosen probabilities are divided by their sum ``+ 1e-20``; with a scale they
are multiplied by it. The bias (aux-loss-free balancing) moves the choice only. Group-limited
routing (``NUM_GROUPS`` groups of ``S`` experts) first scores each group by the sum of its
``GROUP_M`` best selection values, keeps the ``GROUP_TOPK`` best groups and masks the others'
values with ``-inf``. Every top-k takes NaN as the largest value and breaks ties by the lowest
expert index (``torch.topk`` leaves ties to its algorithm).

Each tile is ``[BLOCK_T, GP, SP]``: rows x groups x experts of a group (``GP``, ``SP`` the
group count and size rounded up to powers of two; one group without group-limited routing),
so a row's ``E`` values sit in registers and a group is an axis.

Kernels:

- ``_router_fwd_kernel``: grid ``cdiv(T, rows_per_program)``; each program walks its rows in
  tiles (a software-pipelined loop: the next tiles' logits load while one is routed) and
  writes ``probs`` and the routing map. With statistics it also accumulates, over its
  valid rows (not padding), the aux-loss scores (``soft``, or ``sig / (sum(sig) + 1e-20)`` for
  sigmoid), the tokens whose top-k of those scores holds each expert, the routed tokens per
  expert and ``sum(logsumexp(x)**2)``, writes them as one fp row of partials and takes a ticket;
  the last program to finish sums the partials in program order (deterministic) into the
  outputs and resets the ticket counter.
- ``_router_bwd_kernel``: grid ``cdiv(T, BLOCK_T)``; re-reads the logits and the map and writes
  ``dlogits`` from the gradients of ``probs``, of the score sums and of the z statistic.

The ``@triton.jit`` row helpers (reductions, top-k, group selection) are in
:mod:`mtp.kernels.moe_router_rows`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mtp.kernels._common import next_power_of_2
from mtp.kernels._launch import Launch, Plans, aligned
from mtp.kernels.moe_router_rows import (
    _bc,
    _chosen_softmax,
    _columns,
    _group_keep,
    _rmax,
    _rsum,
    _scaled,
    _softmax_parts,
    _topk,
)

#: score function -> the ``SCORE`` constexpr.
SCORES = {("softmax", False): 0, ("softmax", True): 1, ("sigmoid", False): 2, ("sigmoid", True): 2}
#: Elements of one ``[BLOCK_T, GP, SP]`` tile (fp32 math; fp64 math, a correctness path whose
#: divisions are subroutine calls, takes an eighth), and the warps that process it.
TILE_ELEMENTS = 1024
NUM_WARPS = 4
#: Largest padded expert count (``GP * SP``) the kernels take.
MAX_EXPERTS = 1024
#: With statistics: fewest rows per program (the partial row of ``3 E + 1`` values each program
#: writes and the last one reads stays a few percent of the bytes), most programs, and most
#: partial values in all (the last program reads every partial row).
MIN_STAT_ROWS = 128
MAX_STAT_PROGRAMS = 128
MAX_STAT_PARTIALS = 16384
#: Elements of the tile of partial rows the last program sums per step.
FINISH_ELEMENTS = 4096
#: Loads in flight in the row loops (software pipelining of ``tl.range``).
STAGES = tl.constexpr(3)


@triton.jit
def _router_fwd_kernel(
    logits_ptr, bias_ptr, pad_ptr, probs_ptr, map_ptr, part_ptr, counter_ptr,
    score_ptr, count_ptr, z_ptr, T, stride_lt, stride_pt, stride_mt, rows_per_program,
    E: tl.constexpr, NUM_GROUPS: tl.constexpr, S: tl.constexpr, GP: tl.constexpr,
    SP: tl.constexpr, TOPK: tl.constexpr, SCORE: tl.constexpr, RENORM: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_HI: tl.constexpr, SCALE_LO: tl.constexpr,
    GROUP_TOPK: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_PAD: tl.constexpr, AUX: tl.constexpr, ZLOSS: tl.constexpr, COUNTS: tl.constexpr,
    BLOCK_T: tl.constexpr, MATH: tl.constexpr, W_BLOCK: tl.constexpr,
    FINISH_ROWS: tl.constexpr, CONTIG: tl.constexpr,
):  # fmt: skip
    if CONTIG:  # contiguous rows: a constant row stride makes the loads and stores vectors
        stride_lt = E
        stride_pt = E
        stride_mt = E
    pid = tl.program_id(0)
    allowed, col, g = _columns(NUM_GROUPS, S, GP, SP)
    rank = g * SP + col - g * S
    t_idx = tl.arange(0, BLOCK_T)[:, None, None]
    full_cols = allowed & (t_idx >= 0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + col, mask=allowed, other=0.0).to(MATH)
    STATS: tl.constexpr = AUX or ZLOSS or COUNTS
    NEED_SOFT: tl.constexpr = SCORE == 1 or (AUX and SCORE != 2) or ZLOSS
    acc_s = tl.zeros([GP, SP], MATH)
    acc_a = tl.zeros([GP, SP], MATH)
    acc_r = tl.zeros([GP, SP], MATH)
    acc_z = tl.zeros([BLOCK_T], MATH)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, T)
    for r0 in tl.range(row_start, row_end, BLOCK_T, num_stages=STAGES):
        rows = r0 + t_idx
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        mask = row_ok & allowed
        x = tl.load(logits_ptr + rows64 * stride_lt + col, mask=mask, other=0.0).to(MATH)
        if NEED_SOFT:
            mx, ex, den = _softmax_parts(x, allowed)
            soft = ex / _bc(den)
        if SCORE == 2:
            sig = tl.where(allowed, tl.sigmoid(x), 0.0)
            sel = sig
        elif SCORE == 1:
            sel = soft
        else:
            sel = x
        if HAS_BIAS:
            sel = sel + bias
        if GROUP_TOPK > 0:
            keep = _group_keep(sel, rank, full_cols, g, NUM_GROUPS, GROUP_TOPK, GROUP_M)
            sel = tl.where(keep, sel, float("-inf"))
        chosen = _topk(sel, rank, full_cols, TOPK)
        if SCORE == 0:
            p = _chosen_softmax(x, chosen)
        else:
            if SCORE == 2:
                p = tl.where(chosen, sig, 0.0)
            else:
                p = tl.where(chosen, soft, 0.0)
            if RENORM:
                p = p / _bc(_rsum(p) + 1e-20)
        if HAS_SCALE:
            p = _scaled(p, SCALE_HI, SCALE_LO)
        tl.store(probs_ptr + rows64 * stride_pt + col, p.to(probs_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(map_ptr + rows64 * stride_mt + col, chosen.to(tl.int8), mask=mask)
        if STATS:
            valid = row_ok
            if HAS_PAD:
                valid = valid & (tl.load(pad_ptr + rows, mask=row_ok, other=1) == 0)
            if AUX:
                if SCORE == 2:
                    a = sig / _bc(_rsum(sig) + 1e-20)
                else:
                    a = soft
                if SCORE == 1 and not HAS_BIAS and GROUP_TOPK == 0:
                    amap = chosen
                else:
                    amap = _topk(a, rank, full_cols, TOPK)
                acc_s += tl.sum(tl.where(valid, a, 0.0), axis=0)
                acc_a += tl.sum(tl.where(valid & amap, 1.0, 0.0), axis=0)
            if COUNTS:
                acc_r += tl.sum(tl.where(valid & chosen, 1.0, 0.0), axis=0)
            if ZLOSS:
                lse = mx + tl.log(den)
                acc_z += tl.where(_rmax(valid.to(tl.int32)) > 0, lse * lse, 0.0)
    if STATS:
        _stats_epilogue(part_ptr, counter_ptr, score_ptr, count_ptr, z_ptr, pid, acc_s, acc_a,
                        acc_r, tl.sum(acc_z, axis=0), E, NUM_GROUPS, S, GP, SP, W_BLOCK,
                        FINISH_ROWS)


@triton.jit
def _stats_epilogue(part_ptr, counter_ptr, score_ptr, count_ptr, z_ptr, pid, acc_s, acc_a,
                    acc_r, z, E: tl.constexpr, NUM_GROUPS: tl.constexpr, S: tl.constexpr,
                    GP: tl.constexpr, SP: tl.constexpr, W_BLOCK: tl.constexpr,
                    FINISH_ROWS: tl.constexpr):  # fmt: skip
    """Write this program's partial row ``[scores | aux counts | routed counts | z]`` (``3 E +
    1`` values); the last program to take a ticket sums every row in program order."""
    W: tl.constexpr = 3 * E + 1
    g = tl.arange(0, GP)[:, None]
    s = tl.arange(0, SP)[None, :]
    allowed = (g < NUM_GROUPS) & (s < S)
    col = g * S + s
    part = part_ptr + pid.to(tl.int64) * W
    tl.store(part + col, acc_s, mask=allowed)
    tl.store(part + E + col, acc_a, mask=allowed)
    tl.store(part + 2 * E + col, acc_r, mask=allowed)
    tl.store(part + 3 * E, z)
    tl.debug_barrier()  # every thread's partials before the ticket (released with it)
    n_programs = tl.num_programs(0)
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == n_programs - 1:
        w = tl.arange(0, W_BLOCK)
        for w0 in range(0, W, W_BLOCK):
            cols = w0 + w
            cmask = cols < W
            total = tl.zeros([W_BLOCK], part_ptr.dtype.element_ty)
            for r0 in range(0, n_programs, FINISH_ROWS):  # volatile loads: not pipelined
                r = r0 + tl.arange(0, FINISH_ROWS)
                m = (r < n_programs)[:, None] & cmask[None, :]
                tile = tl.load(part_ptr + r.to(tl.int64)[:, None] * W + cols[None, :], mask=m,
                               other=0.0, volatile=True)
                total += tl.sum(tile, axis=0)
            tl.store(score_ptr + cols, total, mask=cols < E)
            tl.store(count_ptr + cols - E, total, mask=(cols >= E) & (cols < 3 * E))
            tl.store(z_ptr + cols * 0, total, mask=cols == 3 * E)
        tl.atomic_xchg(counter_ptr, 0, sem="acq_rel")


@triton.jit
def _router_bwd_kernel(
    logits_ptr, map_ptr, dprobs_ptr, dscore_ptr, dz_ptr, pad_ptr, dlogits_ptr, T,
    stride_lt, stride_mt, stride_gt, stride_ge, stride_ds, stride_dt,
    NUM_GROUPS: tl.constexpr, S: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr,
    SCORE: tl.constexpr, RENORM: tl.constexpr, HAS_SCALE: tl.constexpr,
    SCALE_HI: tl.constexpr, SCALE_LO: tl.constexpr, HAS_DPROBS: tl.constexpr,
    HAS_DAUX: tl.constexpr, HAS_DZ: tl.constexpr, HAS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, MATH: tl.constexpr, CONTIG: tl.constexpr,
    GRAD_CONTIG: tl.constexpr,
):  # fmt: skip
    if CONTIG:  # logits, map and dlogits
        stride_lt = NUM_GROUPS * S
        stride_mt = NUM_GROUPS * S
        stride_dt = NUM_GROUPS * S
    if GRAD_CONTIG:
        stride_gt = NUM_GROUPS * S
        stride_ge = 1
    pid = tl.program_id(0)
    allowed, col, _ = _columns(NUM_GROUPS, S, GP, SP)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    mask = row_ok & allowed
    x = tl.load(logits_ptr + rows64 * stride_lt + col, mask=mask, other=0.0).to(MATH)
    NEED_SOFT: tl.constexpr = SCORE == 1 or (HAS_DAUX and SCORE != 2) or HAS_DZ
    if NEED_SOFT:
        mx, ex, den = _softmax_parts(x, allowed)
        soft = ex / _bc(den)
    if SCORE == 2:
        sig = tl.where(allowed, tl.sigmoid(x), 0.0)
    dx = tl.zeros([BLOCK_T, GP, SP], MATH)
    valid = row_ok
    if HAS_PAD:
        valid = valid & (tl.load(pad_ptr + rows, mask=row_ok, other=1) == 0)
    if HAS_DPROBS:
        chosen = tl.load(map_ptr + rows64 * stride_mt + col, mask=mask, other=0) != 0
        gr = tl.load(dprobs_ptr + rows64 * stride_gt + col.to(tl.int64) * stride_ge, mask=mask,
                     other=0.0).to(MATH)
        if HAS_SCALE:
            gr = _scaled(gr, SCALE_HI, SCALE_LO)
        if SCORE == 0:  # probs = softmax(x[chosen])
            q = _chosen_softmax(x, chosen)
            dot = _rsum(tl.where(chosen, q * gr, 0.0))
            dx += tl.where(chosen, q * (gr - _bc(dot)), 0.0)
        else:
            if SCORE == 2:
                r = tl.where(chosen, sig, 0.0)
            else:
                r = tl.where(chosen, soft, 0.0)
            if RENORM:  # probs = r / (sum(r) + 1e-20)
                d = _bc(_rsum(r) + 1e-20)
                u = tl.where(chosen, (gr - _bc(_rsum(tl.where(chosen, gr * r, 0.0))) / d) / d,
                             0.0)
            else:
                u = tl.where(chosen, gr, 0.0)
            if SCORE == 2:
                dx += u * sig * (1.0 - sig)
            else:
                dx += soft * (u - _bc(_rsum(soft * u)))
    if HAS_DAUX:
        da = tl.load(dscore_ptr + col * stride_ds, mask=allowed, other=0.0).to(MATH)
        if SCORE == 2:  # aux scores sig / (sum(sig) + 1e-20)
            tot = _bc(_rsum(sig) + 1e-20)
            dsig = (da - _bc(_rsum(da * sig)) / tot) / tot
            dx += tl.where(valid, dsig * sig * (1.0 - sig), 0.0)
        else:
            dx += tl.where(valid, soft * (da - _bc(_rsum(soft * da))), 0.0)
    if HAS_DZ:
        dz = tl.load(dz_ptr).to(MATH)
        lse = _bc(mx + tl.log(den))
        dx += tl.where(valid, (2.0 * dz) * lse * soft, 0.0)
    tl.store(dlogits_ptr + rows64 * stride_dt + col, dx.to(dlogits_ptr.dtype.element_ty),
             mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def tile_config(num_experts: int, num_groups: int,
                dtype: torch.dtype = torch.float32) -> tuple[int, int, int]:  # fmt: skip
    """``(BLOCK_T, GP, SP)``: the padded group count and size and the rows of a tile."""
    gp = next_power_of_2(num_groups)
    sp = next_power_of_2(num_experts // num_groups)
    elements = TILE_ELEMENTS // 8 if dtype == torch.float64 else TILE_ELEMENTS
    return max(1, elements // (gp * sp)), gp, sp


def padded_experts(num_experts: int, num_groups: int) -> int:
    """``GP * SP``: the register width of a row (at most :data:`MAX_EXPERTS`)."""
    return next_power_of_2(num_groups) * next_power_of_2(num_experts // num_groups)


def rows_per_program(num_tokens: int, num_experts: int, block_t: int, stats: bool) -> int:
    """Rows of one forward program: one tile without statistics; with them at least
    ``MIN_STAT_ROWS``, and at most ``MAX_STAT_PROGRAMS`` programs of ``3 E + 1`` partials, at
    most ``MAX_STAT_PARTIALS`` partials in all (a multiple of the tile)."""
    if not stats:
        return block_t
    programs = max(1, min(MAX_STAT_PROGRAMS, MAX_STAT_PARTIALS // (3 * num_experts + 1)))
    rows = max(MIN_STAT_ROWS, triton.cdiv(num_tokens, programs))
    return triton.cdiv(rows, block_t) * block_t


_COUNTERS: dict = {}


def ticket_counter(device: torch.device) -> torch.Tensor:
    """The int32 ticket counter of the statistics' last-program sum on ``device`` (zero between
    launches: the last program resets it). Calls on concurrent streams must not overlap."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros((), dtype=torch.int32, device=device)
    return counter


def _dense(*tensors: torch.Tensor) -> bool:
    """Every ``[T, E]`` tensor has rows of ``E`` contiguous elements, back to back."""
    return all(t.stride(1) == 1 and t.stride(0) == t.shape[1] for t in tensors)


def _math(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _scale_parts(scaling_factor: float | None, dtype: torch.dtype) -> tuple[bool, float, float]:
    if not scaling_factor:
        return False, 1.0, 0.0
    hi = float(torch.tensor(scaling_factor, dtype=torch.float32))
    lo = float(scaling_factor) - hi if dtype == torch.float64 else 0.0
    return True, hi, lo


_PLANS = Plans()


def router_forward(
    logits: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    topk: int,
    score: int,
    renorm: bool,
    scaling_factor: float | None,
    num_groups: int,
    group_topk: int,
    group_m: int,
    expert_bias: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    aux: bool,
    zloss: bool,
    counts: bool,
) -> None:
    """One launch. ``logits`` ``[T, E]`` (last dim contiguous); ``probs`` ``[T, E]`` and
    ``routing_map`` ``[T, E]`` (uint8 view of the bool map) written; ``expert_bias`` ``[E]``;
    ``padding_mask`` ``[T]`` uint8 (1 = ignored token); ``stats``: ``(scores [E], counts
    [2, E], z [])`` in the math dtype, written when one of ``aux``/``zloss``/``counts``
    (the others' entries are 0). The launch is planned once per key (shapes, strides, dtypes,
    options, alignment, device)."""
    T, E = logits.shape
    want = stats is not None and (aux or zloss or counts)
    if T == 0:
        for t in stats if want else ():
            t.zero_()
        return
    dummy = logits
    s0, s1, s2 = stats if want else (dummy, dummy, dummy)
    bias = expert_bias if expert_bias is not None else dummy
    pad = padding_mask if padding_mask is not None else dummy
    key = ("fwd", T, E, logits.stride(0), probs.stride(0), routing_map.stride(0),
           _dense(logits, probs, routing_map), logits.dtype, probs.dtype, bias.dtype, s0.dtype,
           expert_bias is None, padding_mask is None, topk, score, renorm, scaling_factor,
           num_groups, group_topk, group_m, want and aux, want and zloss, want and counts,
           aligned(logits, bias, pad, probs, routing_map, s0, s1, s2), logits.device)
    plan = _PLANS.get(key)
    rows = programs = None
    if plan is not None:
        launch, rows, programs = plan
    else:
        block_t = tile_config(E, num_groups, logits.dtype)[0]
        rows = rows_per_program(T, E, block_t, want)
        programs = triton.cdiv(T, rows)
    part = counter = dummy
    if want:
        part = torch.empty((programs, 3 * E + 1), dtype=s0.dtype, device=logits.device)
        counter = ticket_counter(logits.device)
    args = (logits, bias, pad, probs, routing_map, part, counter, s0, s1, s2, T,
            logits.stride(0), probs.stride(0), routing_map.stride(0), rows)
    if plan is None:
        launch = Launch(_router_fwd_kernel, (programs,), args, _forward_options(
            logits, probs, routing_map, topk, score, renorm, scaling_factor, num_groups,
            group_topk, group_m, expert_bias, padding_mask, want and aux, want and zloss,
            want and counts))  # fmt: skip
        _PLANS.add(key, (launch, rows, programs))
    launch(*args)


def _forward_options(logits, probs, routing_map, topk, score, renorm, scaling_factor, num_groups,
                     group_topk, group_m, expert_bias, padding_mask, aux, zloss, counts) -> dict:
    E = logits.shape[1]
    block_t, gp, sp = tile_config(E, num_groups, logits.dtype)
    has_scale, hi, lo = _scale_parts(scaling_factor, logits.dtype)
    w_block = min(next_power_of_2(3 * E + 1), 1024)
    return dict(
        E=E, NUM_GROUPS=num_groups, S=E // num_groups, GP=gp, SP=sp, TOPK=topk, SCORE=score,
        RENORM=renorm, HAS_SCALE=has_scale, SCALE_HI=hi, SCALE_LO=lo, GROUP_TOPK=group_topk,
        GROUP_M=group_m, HAS_BIAS=expert_bias is not None, HAS_PAD=padding_mask is not None,
        AUX=aux, ZLOSS=zloss, COUNTS=counts, BLOCK_T=block_t, MATH=_math(logits.dtype),
        W_BLOCK=w_block, FINISH_ROWS=max(1, FINISH_ELEMENTS // w_block),
        CONTIG=_dense(logits, probs, routing_map), num_warps=NUM_WARPS,
    )  # fmt: skip


def router_backward(
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    dprobs: torch.Tensor | None,
    dscores: torch.Tensor | None,
    dz: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    dlogits: torch.Tensor,
    *,
    score: int,
    renorm: bool,
    scaling_factor: float | None,
    num_groups: int,
) -> None:
    """One launch: ``dlogits`` ``[T, E]`` from ``dprobs`` ``[T, E]`` and ``dscores`` ``[E]`` (any
    strides, 0 included: the gradient of a sum) and ``dz`` ``[]`` (each None when it has no
    gradient). Planned once per key."""
    T, E = logits.shape
    if T == 0:
        return
    dummy = logits
    dp = dprobs if dprobs is not None else dummy
    ds = dscores if dscores is not None else dummy
    dzz = dz if dz is not None else dummy
    pad = padding_mask if padding_mask is not None else dummy
    args = (logits, routing_map, dp, ds, dzz, pad, dlogits, T, logits.stride(0),
            routing_map.stride(0), dprobs.stride(0) if dprobs is not None else 0,
            dprobs.stride(1) if dprobs is not None else 0,
            dscores.stride(0) if dscores is not None else 0, dlogits.stride(0))
    key = ("bwd", *args[7:], E, logits.dtype, dp.dtype, ds.dtype, dzz.dtype, dlogits.dtype,
           dprobs is None, dscores is None, dz is None, padding_mask is None, score, renorm,
           scaling_factor, num_groups, _dense(logits, routing_map, dlogits),
           dprobs is not None and _dense(dprobs),
           aligned(logits, routing_map, dp, ds, dzz, pad, dlogits), logits.device)
    launch = _PLANS.get(key)
    if launch is None:
        block_t, gp, sp = tile_config(E, num_groups, logits.dtype)
        has_scale, hi, lo = _scale_parts(scaling_factor, logits.dtype)
        launch = _PLANS.add(key, Launch(_router_bwd_kernel, (triton.cdiv(T, block_t),), args, dict(
            NUM_GROUPS=num_groups, S=E // num_groups, GP=gp, SP=sp, SCORE=score, RENORM=renorm,
            HAS_SCALE=has_scale, SCALE_HI=hi, SCALE_LO=lo, HAS_DPROBS=dprobs is not None,
            HAS_DAUX=dscores is not None, HAS_DZ=dz is not None,
            HAS_PAD=padding_mask is not None, BLOCK_T=block_t, MATH=_math(logits.dtype),
            CONTIG=_dense(logits, routing_map, dlogits),
            GRAD_CONTIG=dprobs is not None and _dense(dprobs), num_warps=NUM_WARPS,
        )))  # fmt: skip
    launch(*args)


__all__ = [
    "MAX_EXPERTS",
    "SCORES",
    "padded_experts",
    "router_backward",
    "router_forward",
    "rows_per_program",
    "ticket_counter",
    "tile_config",
]
