"""FP8 (e4m3) quantisation with block scales computed on the device.

One kernel, :func:`quantize_kernel`, reads a (batched) matrix ``x[b, r, c]`` tile by tile and
writes any of:

- ``ROW``: blocks of ``1 x GROUP`` along ``c`` (activations for a GEMM reducing over ``c``):
  data ``q[b, r, c]``, one scale per block ``s[b, r, c // GROUP]``;
- ``COL``: blocks of ``GROUP x 1`` along ``r`` (the transposed scaling a weight-gradient GEMM
  reducing over the rows needs): data ``qt[b, r', c]``, scales ``st[b, r' // GROUP, c]``; with
  ``GROUPED`` the rows are an expert-grouped ``[M, C]`` matrix read through the tile map of
  :func:`mtp.kernels.grouped_gemm_details.tiles.tile_map_kernel` for ``GROUP``-row tiles, and
  ``r'`` is the padded row: row tile ``t`` of the expert-major order lands at rows
  ``[t * GROUP, (t + 1) * GROUP)``, so every expert starts on a block and its last block is
  padded with zeros (no alignment asked of the caller);
- ``SQUARE``: ``GROUP x GROUP`` blocks (weights, DeepSeek-V3's 128 x 128): one scale per block
  ``s[b, r // GROUP, c // GROUP]``, the data in ``q`` and, with ``COL``, a second copy in ``qt``
  (another memory layout of the same values: the transposed operand of the data gradient).

Every output is addressed by its logical indices and its own strides, so one launch can write
a transposed layout (the reduction axis contiguous, as the tensor cores read FP8 operands).

Scales, per block of absolute maximum ``amax`` (``+-inf`` read as ``+-FLT_MAX``, NaN ignored
by the maximum and kept in the data): ``s = max(amax / 448, 2^-126)``; ``SCALE = 0`` stores ``s``
(fp32), ``1`` the power of two ``2^ceil(log2 s)`` (fp32), ``2`` the same as an e8m0 byte (the
biased exponent). The data is ``x / scale`` rounded to nearest even and saturated to ``+-448``
(``torch``'s ``.to(float8_e4m3fn)`` of the clamped value), bit for bit. The interpreter's own
fp32 -> e4m3 conversion misrounds (carries lost, subnormals truncated) and its bf16 -> fp32 one
loses subnormals, so under it (``SOFT_CVT``) bf16 is widened by its bits and the rounding is
done in fp32 arithmetic first (the conversion is then exact); on a GPU ``cvt.f32.bf16`` and
``cvt.rn.satfinite`` give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import interpreting
from mtp.kernels._launch import Launch
from mtp.kernels.grouped_gemm_details.tiles import MAP_FIELDS, MAP_HEADER, routing_map

__all__ = ["E4M3_MAX", "SCALE_KINDS", "SCALE_MIN", "QuantizePlan", "quantize_kernel", "tile_shape"]

E4M3_MAX = 448.0
SCALE_MIN = 2.0**-126  # the smallest normal fp32: scales of all-zero or tiny blocks
_FLT_MAX = 3.4028234663852886e38


@triton.jit
def _finite(x):
    """``x`` with ``+-inf`` clamped to ``+-FLT_MAX`` (NaN stays NaN)."""
    big: tl.constexpr = 3.4028234663852886e38
    return tl.where(x > big, big, tl.where(x < -big, -big, x))


@triton.jit
def _scale(amax, SCALE: tl.constexpr):
    """``(scale, stored)`` of blocks whose absolute maximum is ``amax`` (fp32, >= 0)."""
    s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
    stored = s
    if SCALE != 0:
        bits = (s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000  # up to a power of two
        s = bits.to(tl.float32, bitcast=True)
        stored = s
        if SCALE == 2:
            stored = (bits >> 23).to(tl.uint8)
    return s, stored


@triton.jit
def _divide(x, scale, SCALE: tl.constexpr):
    """``x / scale`` correctly rounded (a power-of-two scale: times its exact reciprocal)."""
    if SCALE == 0:
        return tl.math.div_rn(x, scale)
    # 1 / 2^e = 2^-e: the biased exponent 254 - (that of the scale), exactly
    return x * (0x7F000000 - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v, SOFT_CVT: tl.constexpr):
    """fp32 ``v`` saturated to ``+-448`` and rounded to nearest even on the e4m3 grid."""
    v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))
    if SOFT_CVT:
        bits = v.to(tl.int32, bitcast=True)
        # the grid step of v's binade (3 mantissa bits), 2^-9 below the normal range
        step = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True) * 0.125, 0.001953125)
        y = tl.abs(v) / step  # exact: a power of two
        r = ((y + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: rounds to an integer, RNE
        q = tl.where(bits < 0, -r, r).to(tl.float8e4nv)  # the sign of -0.0 too
        nan = tl.full(q.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True)
        q = tl.where(v == v, q, nan)  # NaN: 0x7F, as cvt.rn.satfinite gives it
    else:
        q = v.to(tl.float8e4nv)
    return q


@triton.jit
def _tile_rows(pid_r, map_ptr, R, E, BLOCK_R: tl.constexpr, GROUPED: tl.constexpr):
    """``(rows, keep, dest, dest_keep, live)``: the source rows of row tile ``pid_r``, which of
    them exist, the rows they take in a ``COL`` output and which of those are written (all of
    a grouped tile: its padding gets zeros), and whether the tile exists at all."""
    offs = tl.arange(0, BLOCK_R)
    rows = pid_r * BLOCK_R + offs
    keep = rows < R
    dest = rows
    dest_keep = keep
    live = pid_r >= 0
    if GROUPED:
        tiles = routing_map(map_ptr, E)
        live = pid_r < tl.load(tiles)
        entry = tiles + MAP_HEADER + pid_r * MAP_FIELDS
        row0 = tl.load(entry + 1, mask=live, other=0)
        rows_e = tl.load(entry + 2, mask=live, other=0)
        first = tl.load(entry + 3, mask=live, other=0)
        rows = row0 + (pid_r - first) * BLOCK_R + offs
        # (a bool vector and a bool scalar do not combine under the interpreter: bounds instead)
        keep = rows < tl.where(live, tl.minimum(row0 + rows_e, R), 0)
        dest = pid_r * BLOCK_R + offs
        dest_keep = offs < tl.where(live, BLOCK_R, 0)
    return rows, keep, dest, dest_keep, live


@triton.jit
def _load(x_ptr, b, rows64, keep, cols, C, stride_xb, stride_xr, stride_xc,
          SOFT_CVT: tl.constexpr):  # fmt: skip
    """fp32 ``[rows, cols]`` tile of ``x`` (zeros where masked; ``+-inf`` as ``+-FLT_MAX``).
    ``SOFT_CVT``: bf16 widened by its bits (the interpreter's conversion loses subnormals)."""
    ptrs = x_ptr + b * stride_xb + rows64[:, None] * stride_xr + cols[None, :] * stride_xc
    v = tl.load(ptrs, mask=keep[:, None] & (cols < C)[None, :], other=0.0)
    if SOFT_CVT and v.dtype == tl.bfloat16:
        v = (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return _finite(v.to(tl.float32))


@triton.jit
def _absmax(x, axis: tl.constexpr):
    """The maximum of ``|x|`` along ``axis``, NaN left out."""
    a = tl.abs(x)
    return tl.max(tl.where(a == a, a, 0.0), axis=axis)


@triton.jit
def _emit(x, rscale, b, rows64, keep, dest64, dest_keep, live, pid_r, cols, C,
          q_ptr, qt_ptr, st_ptr, stride_qb, stride_qr, stride_qc, stride_tb, stride_tr, stride_tc,
          stride_ub, stride_ur, stride_uc, ROW: tl.constexpr, COL: tl.constexpr,
          SQUARE: tl.constexpr, GROUPED: tl.constexpr, SCALE: tl.constexpr,
          SOFT_CVT: tl.constexpr):  # fmt: skip
    """The data of one column chunk: the rows' (or the square's) scale ``rscale`` into ``q``
    (and the square's copy into ``qt``); ``COL``: the columns' own scales into ``qt``/``st``."""
    mask_c = cols < C
    if ROW or SQUARE:
        if ROW:
            q = _e4m3(_divide(x, rscale[:, None], SCALE), SOFT_CVT)
        else:
            q = _e4m3(_divide(x, rscale, SCALE), SOFT_CVT)
        mask = keep[:, None] & mask_c[None, :]
        tl.store(q_ptr + b * stride_qb + rows64[:, None] * stride_qr + cols[None, :] * stride_qc,
                 q, mask=mask)
        if SQUARE and COL:
            tl.store(qt_ptr + b * stride_tb + rows64[:, None] * stride_tr
                     + cols[None, :] * stride_tc, q, mask=mask)  # fmt: skip
    if COL and not SQUARE:
        cscale, stored = _scale(_absmax(x, 0), SCALE)
        q = _e4m3(_divide(x, cscale[None, :], SCALE), SOFT_CVT)
        tl.store(qt_ptr + b * stride_tb + dest64[:, None] * stride_tr + cols[None, :] * stride_tc,
                 q, mask=dest_keep[:, None] & mask_c[None, :])
        if GROUPED:
            mask_c = cols < tl.where(live, C, 0)
        tl.store(st_ptr + b * stride_ub + pid_r * stride_ur + cols * stride_uc, stored,
                 mask=mask_c)


@triton.jit
def quantize_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, map_ptr,
    R, C, E,
    stride_xb, stride_xr, stride_xc,
    stride_qb, stride_qr, stride_qc,
    stride_sb, stride_sr, stride_sc,
    stride_tb, stride_tr, stride_tc,
    stride_ub, stride_ur, stride_uc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr, SQUARE: tl.constexpr, GROUPED: tl.constexpr,
    SCALE: tl.constexpr, SOFT_CVT: tl.constexpr,
):
    """Quantise tile ``(program 0: rows, program 1: columns, program 2: batch)`` of ``x``.

    ``x [B, R, C]`` (any strides; ``GROUPED``: ``B = 1`` and the rows grouped by expert, ``E``
    experts, ``map_ptr`` the routing buffer of ``BLOCK_R``-row tiles). ``q``/``s`` take the
    ``ROW`` (or ``SQUARE``) data and scales, ``qt``/``st`` the ``COL`` ones (``SQUARE``: ``qt``
    the second copy, ``st`` unused). ``ROW`` needs ``BLOCK_C == GROUP``, ``COL`` and ``SQUARE``
    ``BLOCK_R == GROUP`` (``SQUARE`` both). The tile is read ``CHUNK`` columns at a time: a
    first pass takes the rows' (square's) maximum, the second quantises (one pass when
    ``CHUNK == BLOCK_C``). Grid: ``(cdiv(R, BLOCK_R), cdiv(C, BLOCK_C), B)``; ``GROUPED``: the
    map's worst-case row tiles.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows, keep, dest, dest_keep, live = _tile_rows(pid_r, map_ptr, R, E, BLOCK_R, GROUPED)
    rows64 = rows.to(tl.int64)
    dest64 = dest.to(tl.int64)
    # columns as int64: a transposed output's column stride is a whole column
    c0 = (pid_c * BLOCK_C).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    x = _load(x_ptr, b, rows64, keep, c0 + offs, C, stride_xb, stride_xr, stride_xc, SOFT_CVT)
    rscale = 0.0
    if ROW or SQUARE:
        amax = _absmax(x, 1)
        for c in tl.static_range(CHUNK, BLOCK_C, CHUNK):
            more = _load(x_ptr, b, rows64, keep, c0 + c + offs, C, stride_xb, stride_xr,
                         stride_xc, SOFT_CVT)  # fmt: skip
            amax = tl.maximum(amax, _absmax(more, 1))
        if SQUARE:
            rscale, stored = _scale(tl.max(amax, axis=0), SCALE)
            tl.store(s_ptr + b * stride_sb + pid_r * stride_sr + pid_c * stride_sc, stored)
        else:
            rscale, stored = _scale(amax, SCALE)
            tl.store(s_ptr + b * stride_sb + rows64 * stride_sr + pid_c * stride_sc, stored,
                     mask=keep)
    for c in tl.static_range(0, BLOCK_C, CHUNK):
        if c > 0:
            x = _load(x_ptr, b, rows64, keep, c0 + c + offs, C, stride_xb, stride_xr, stride_xc,
                      SOFT_CVT)  # fmt: skip
        _emit(x, rscale, b, rows64, keep, dest64, dest_keep, live, pid_r, c0 + c + offs, C,
              q_ptr, qt_ptr, st_ptr, stride_qb, stride_qr, stride_qc, stride_tb, stride_tr,
              stride_tc, stride_ub, stride_ur, stride_uc, ROW, COL, SQUARE, GROUPED, SCALE,
              SOFT_CVT)  # fmt: skip


def programs(rows: int, cols: int, batch: int, block_r: int, block_c: int) -> tuple:
    """The grid of :func:`quantize_kernel` for ``rows`` row positions (grouped: the map's
    worst-case row tiles times ``block_r``)."""
    return (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c), batch)


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------

#: what the ``SCALE`` constexpr means: fp32 exact, fp32 power of two, e8m0 byte
SCALE_KINDS = {"fp32": 0, "pow2": 1, "e8m0": 2}


def tile_shape(group: int, row: bool, col: bool, square: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_R, BLOCK_C, CHUNK, warps)``: a ``ROW`` tile is one block wide, a ``COL`` or
    ``SQUARE`` tile one block high; chunks of at most 4096 elements (32 per thread)."""
    if square:
        return group, group, 32, 4
    if col:  # 128 rows of the row-wise scales next to the chunk: 8 warps
        block_c = group if row else 128
        return group, block_c, min(block_c, 4096 // group), 8 if row and group > 32 else 4
    return 4096 // group, group, group, 4


def _strides(t) -> tuple:
    """A 3-D view's strides; the batch stride 0 when there is one batch (an aligned base for
    every program, as Triton specialises it)."""
    if t is None:
        return (0, 0, 0)
    return (0 if t.shape[0] == 1 else t.stride(0), *t.stride()[1:])


class QuantizePlan:
    """One build of :func:`quantize_kernel` for one key: ``plan(x, q, s, qt, st, map_buf)`` with
    3-D logical views (None for outputs a mode does not write; ``map_buf`` the routing buffer of
    ``GROUP``-row tiles, or None)."""

    __slots__ = ("launch", "ints", "empty")

    def __init__(self, x, q, s, qt, st, *, group: int, row: bool, col: bool, square: bool,
                 experts: int, rows_bound: int, scale: str):  # fmt: skip
        B, R, C = x.shape
        block_r, block_c, chunk, warps = tile_shape(group, row, col, square)
        self.ints = (R, C, experts, *_strides(x), *_strides(q), *_strides(s), *_strides(qt),
                     *_strides(st))  # fmt: skip
        grid = programs(rows_bound, C, B, block_r, block_c)
        self.empty = min(grid) == 0
        # the routing buffer: an int32 stand-in of the same alignment while compiling
        map_buf = torch.empty(4, dtype=torch.int32, device=x.device) if experts else x
        args = (x, *(t if t is not None else x for t in (q, s, qt, st)), map_buf, *self.ints)
        self.launch = Launch(quantize_kernel, grid, args, dict(
            BLOCK_R=block_r, BLOCK_C=block_c, CHUNK=chunk, GROUP=group, ROW=row, COL=col, SQUARE=square,
            GROUPED=experts > 0, SCALE=SCALE_KINDS[scale], SOFT_CVT=interpreting(),
            num_warps=warps))  # fmt: skip

    def __call__(self, x, q, s, qt, st, map_buf) -> None:
        if self.empty:
            return
        self.launch(x, x if q is None else q, x if s is None else s, x if qt is None else qt,
                    x if st is None else st, x if map_buf is None else map_buf, *self.ints)
