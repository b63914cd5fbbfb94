"""Fused bias + activation: GeLU (exact erf or tanh approximation) and SwiGLU.

Kernels (all compute in fp32 and round the result to the output dtype):

- ``_bias_act_fwd_kernel``: ``y = act(x + bias)``. Grid ``(column blocks, row programs)``: each
  program owns one ``BLOCK_N``-wide column block, loads its bias slice once and walks the rows
  in ``[BLOCK_M, BLOCK_N]`` tiles with a stride of ``row programs`` tiles (a persistent grid
  sized to the device: :func:`row_programs`). For the gated activation (SwiGLU) ``x`` has
  ``2 * N`` columns: ``y = silu(a) * g`` with ``a`` the first and ``g`` the second half
  (Megatron's ``torch.chunk(x, 2, -1)`` convention).
- ``_bias_act_bwd_kernel``: same grid; recomputes ``x + bias`` from the saved inputs, writes
  ``dx`` and (when asked) accumulates ``dx`` in a 2-D fp32 tile that is reduced over its rows
  once, at the end: one fp32 partial column sum per program, stage one of the ``dbias``
  reduction. The programs' rows depend only on the shape and the grid, so the result is
  deterministic (bitwise reproducible on a given device).
- ``_column_sum_kernel``: stage two, sums the partials over the row programs in a fixed order
  and writes ``dbias`` in the bias dtype.

Non-finite inputs: ``gelu(+inf) = +inf``, ``gelu(-inf) = 0``, ``silu(+inf) = +inf``,
``silu(-inf) = 0``, with finite derivatives (1 and 0); NaN propagates.

Launchers take 2-D views whose last dimension is contiguous (any row stride, including 0 for an
expanded ``dy``) and preallocated outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import gpu_like, interpreting, next_power_of_2
from mtp.kernels._launch import Launch, Plans, aligned

#: activation name -> the ``ACT`` constexpr of the kernels.
ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "swiglu": 2}

#: Elements per ``[BLOCK_M, BLOCK_N]`` tile (forward; the backward holds two fp32 dbias
#: accumulator tiles as well and uses half) and the warps that process it.
TILE_ELEMENTS = 4096
BWD_TILE_ELEMENTS = 2048
NUM_WARPS = 8
#: Largest tile width; wider rows take several column blocks.
MAX_BLOCK_N = 1024
#: Programs in flight without a GPU (Triton interpreter): a small fixed grid.
CPU_PROGRAMS = 8
#: Columns per program of the second reduction stage.
COLSUM_BLOCK = 1024
#: Fewest rows a program walks: each program re-reads its bias slice and (backward) writes and
#: re-reads one fp32 partial row, so at 32 rows or more that costs at most ~5 % of the floor
#: (bf16 backward: 10 bytes per column against 6 per row and column) whatever the device size.
MIN_ROWS_PER_PROGRAM = 32
#: Beyond these the activations are linear or zero in fp32; the maths runs on clamped values
#: so that +-inf gives +inf / 0 (and finite derivatives) instead of ``inf * 0 = NaN``.
GELU_LIMIT = 20.0
SILU_HIGH = 20.0
SILU_LOW = -200.0


@triton.jit
def _clamp(u, low, high):
    """``u`` clamped to ``[low, high]``; NaN stays NaN (comparisons with NaN are false)."""
    return tl.where(u > high, high, tl.where(u < low, low, u))


@triton.jit
def _gelu_and_grad(u, APPROX_TANH: tl.constexpr, NEED_GRAD: tl.constexpr):
    """``gelu(u)`` and, when ``NEED_GRAD``, ``gelu'(u)`` (else 0), in fp32."""
    big = u > 20.0  # GELU_LIMIT: gelu(u) == u and gelu'(u) == 1 in fp32
    c = _clamp(u, -20.0, 20.0)
    if APPROX_TANH:
        # 0.5 * c * (1 + tanh(z)) == c * sigmoid(2 z),  z = sqrt(2/pi) * (c + 0.044715 c^3)
        z2 = 1.5957691216057308 * (c + 0.044715 * c * c * c)
        sig = tl.sigmoid(z2)
        y = c * sig
        if NEED_GRAD:
            dz2 = 1.5957691216057308 * (1.0 + 0.134145 * c * c)
            dy = sig + c * sig * (1.0 - sig) * dz2
        else:
            dy = 0.0
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(c * 0.7071067811865476))
        y = c * cdf
        if NEED_GRAD:
            dy = cdf + c * 0.3989422804014327 * tl.exp(-0.5 * c * c)
        else:
            dy = 0.0
    return tl.where(big, u, y), dy


@triton.jit
def _silu_and_sigmoid(a):
    """``silu(a)`` and ``sigmoid`` of the clamped ``a`` (fp32; +-inf safe), and the clamped a."""
    c = _clamp(a, -200.0, 20.0)  # SILU_LOW, SILU_HIGH
    sig = tl.sigmoid(c)
    return tl.where(a > 20.0, a, c * sig), sig, c


@triton.jit
def _tile(row0, cols, cmask, M, stride, BLOCK_M: tl.constexpr):
    """Mask of the ``[BLOCK_M, BLOCK_N]`` tile at ``row0`` and its element offsets (int64)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & cmask[None, :]
    return mask, rows.to(tl.int64)[:, None] * stride + cols[None, :]


@triton.jit
def _bias_act_fwd_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    # The bias slice of this column block, loaded once for all the program's rows.
    if HAS_BIAS:
        b_a = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if ACT == 2:
            b_g = tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    row0 = tl.program_id(1) * BLOCK_M
    step = tl.num_programs(1) * BLOCK_M
    while row0 < M:
        mask, xoff = _tile(row0, cols, cmask, M, stride_xm, BLOCK_M)
        _, yoff = _tile(row0, cols, cmask, M, stride_ym, BLOCK_M)
        u = tl.load(x_ptr + xoff, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u = u + b_a
        if ACT == 2:
            g = tl.load(x_ptr + xoff + N, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                g = g + b_g
            silu, _, _ = _silu_and_sigmoid(u)
            y = silu * g
        else:
            y, _ = _gelu_and_grad(u, ACT == 1, False)
        tl.store(y_ptr + yoff, y.to(y_ptr.dtype.element_ty), mask=mask)
        row0 += step


@triton.jit
def _bias_act_bwd_kernel(
    dy_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    part_ptr,
    M,
    N,
    stride_dym,
    stride_xm,
    stride_dxm,
    HAS_BIAS: tl.constexpr,
    COMPUTE_DBIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_BIAS:
        b_a = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if ACT == 2:
            b_g = tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    # dbias: per-thread fp32 running sums in a 2-D tile, reduced over rows once at the end.
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row0 = pid_m * BLOCK_M
    step = tl.num_programs(1) * BLOCK_M
    while row0 < M:
        mask, xoff = _tile(row0, cols, cmask, M, stride_xm, BLOCK_M)
        _, dxoff = _tile(row0, cols, cmask, M, stride_dxm, BLOCK_M)
        _, dyoff = _tile(row0, cols, cmask, M, stride_dym, BLOCK_M)
        dy = tl.load(dy_ptr + dyoff, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + xoff, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u = u + b_a
        if ACT == 2:
            g = tl.load(x_ptr + xoff + N, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                g = g + b_g
            silu, sig, c = _silu_and_sigmoid(u)
            du = tl.where(mask, dy * g * (sig + c * sig * (1.0 - sig)), 0.0)
            dg = tl.where(mask, dy * silu, 0.0)
            tl.store(dx_ptr + dxoff + N, dg.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DBIAS:
                acc_g += dg
        else:
            _, grad = _gelu_and_grad(u, ACT == 1, True)
            du = tl.where(mask, dy * grad, 0.0)
        tl.store(dx_ptr + dxoff, du.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DBIAS:
            acc_a += du
        row0 += step
    if COMPUTE_DBIAS:
        width = 2 * N if ACT == 2 else N
        part = part_ptr + pid_m.to(tl.int64) * width
        tl.store(part + cols, tl.sum(acc_a, axis=0), mask=cmask)
        if ACT == 2:
            tl.store(part + N + cols, tl.sum(acc_g, axis=0), mask=cmask)


@triton.jit
def _column_sum_kernel(part_ptr, out_ptr, G, W, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    g = 0
    while g < G:
        acc += tl.load(part_ptr + g * W + cols, mask=mask, other=0.0)
        g += 1
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tile_shape(n_cols: int, elements: int = TILE_ELEMENTS) -> tuple[int, int]:
    """Default ``(BLOCK_M, BLOCK_N)`` for an output of ``n_cols`` columns."""
    block_n = min(next_power_of_2(max(n_cols, 1)), MAX_BLOCK_N)
    return max(1, elements // block_n), block_n


_RESIDENT: dict = {}


def resident_programs(kernel, args: tuple, kwargs: dict, device: torch.device) -> int:
    """Programs that fit on ``device`` at once for this kernel build: ``SMs * blocks per SM``,
    the blocks per SM limited by the kernel's registers and threads. ``CPU_PROGRAMS`` without a
    GPU. Cached per device and build (so the grid, hence ``dbias``, is the same every call)."""
    if not gpu_like(device) or interpreting():
        return CPU_PROGRAMS
    num_warps = kwargs.get("num_warps", 4)
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), device.index,
           tuple(sorted(kwargs.items())), tuple(getattr(a, "dtype", None) for a in args))
    if key not in _RESIDENT:
        props = torch.cuda.get_device_properties(device)
        threads = 32 * num_warps
        per_sm = max(1, props.max_threads_per_multi_processor // threads)
        try:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            compiled._init_handles()
            regs = max(int(compiled.n_regs), 1)
            per_sm = max(1, min(per_sm, 65536 // (regs * threads)))
        except Exception:  # an older/newer Triton without warmup: threads bound only
            pass
        _RESIDENT[key] = props.multi_processor_count * per_sm
    return _RESIDENT[key]


def row_programs(n_rows: int, n_cols: int, programs: int, elements: int = TILE_ELEMENTS) -> int:
    """Row programs per column block so that the grid is about ``programs`` programs (at least
    one per column block, at most one per ``MIN_ROWS_PER_PROGRAM`` rows and per row tile of
    ``elements``: the bias re-reads and dbias partials stay a few percent of the bytes)."""
    block_m, block_n = tile_shape(n_cols, elements)
    col_blocks = triton.cdiv(n_cols, block_n)
    most = min(triton.cdiv(n_rows, block_m), triton.cdiv(n_rows, MIN_ROWS_PER_PROGRAM))
    return max(1, min(most, programs // col_blocks))


def _check_act(act: str) -> int:
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {list(ACTIVATIONS)}, got {act!r}")
    return ACTIVATIONS[act]


_PLANS = Plans()


def bias_act_forward(x: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, act: str) -> None:
    """``y = act(x + bias)``: one launch.

    Args:
        x: ``[M, W]`` with ``x.stride(1) == 1``; ``W = N`` (GeLU) or ``2 * N`` (SwiGLU).
        bias: ``[W]`` contiguous, or None.
        y: ``[M, N]`` output with ``y.stride(1) == 1``.
        act: ``"gelu"``, ``"gelu_tanh"`` or ``"swiglu"``.
    """
    M, N = y.shape
    if M == 0 or N == 0:
        _check_act(act)
        return
    sx, sy = x.stride(0), y.stride(0)
    b = bias if bias is not None else x
    key = ("fwd", M, N, sx, sy, x.dtype, y.dtype, b.dtype, bias is None, act, aligned(x, b, y),
           y.device)
    launch = _PLANS.get(key)
    if launch is None:
        launch = _PLANS.add(key, _forward_launch(x, bias, y, act))
    launch(x, b, y, M, N, sx, sy)


def _forward_launch(x, bias, y, act) -> Launch:
    M, N = y.shape
    block_m, block_n = tile_shape(N)
    args = (x, bias if bias is not None else x, y, M, N, x.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=bias is not None, ACT=_check_act(act), BLOCK_M=block_m,
                  BLOCK_N=block_n, num_warps=NUM_WARPS)
    programs = resident_programs(_bias_act_fwd_kernel, args, kwargs, y.device)
    grid = (triton.cdiv(N, block_n), row_programs(M, N, programs))
    return Launch(_bias_act_fwd_kernel, grid, args, kwargs)


def bias_act_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    dx: torch.Tensor,
    dbias: torch.Tensor | None,
    act: str,
) -> None:
    """``dx = dy * act'(x + bias)`` and ``dbias = dx.sum(0)`` (fp32 two-stage reduction): one
    launch, two with ``dbias``.

    Args:
        dy: ``[M, N]`` with ``dy.stride(1) == 1`` (row stride may be 0).
        x: ``[M, W]`` as in :func:`bias_act_forward`.
        bias: ``[W]`` or None.
        dx: ``[M, W]`` output with ``dx.stride(1) == 1``.
        dbias: ``[W]`` contiguous output, or None to skip the bias gradient.
        act: as in :func:`bias_act_forward`.
    """
    M, N = dy.shape
    if M == 0 or N == 0:
        _check_act(act)
        if dbias is not None:
            dbias.zero_()
        return
    strides = (dy.stride(0), x.stride(0), dx.stride(0))
    b = bias if bias is not None else x
    key = ("bwd", M, N, x.shape[1], *strides, dy.dtype, x.dtype, b.dtype, dx.dtype,
           bias is None, None if dbias is None else dbias.dtype, act, aligned(dy, x, b, dx, dbias),
           dx.device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _backward_launches(dy, x, bias, dx, dbias, act))
    main, colsum, groups = plan
    width = x.shape[1]
    part = dx if colsum is None else torch.empty((groups, width), dtype=torch.float32,
                                                 device=dx.device)
    main(dy, x, b, dx, part, M, N, *strides)
    if colsum is not None:
        colsum(part, dbias, groups, width)


def _backward_launches(dy, x, bias, dx, dbias, act):
    """``(main, column sum or None, row programs)`` for these arguments. The partial-sum
    workspace is allocated per call; its address is always 16-byte aligned (the allocator's)."""
    M, N = dy.shape
    block_m, block_n = tile_shape(N, BWD_TILE_ELEMENTS)
    width = x.shape[1]
    kwargs = dict(HAS_BIAS=bias is not None, COMPUTE_DBIAS=dbias is not None, ACT=_check_act(act),
                  BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS)
    part = torch.empty((1,), dtype=torch.float32, device=dy.device) if dbias is not None else dx
    args = [dy, x, bias if bias is not None else x, dx, part, M, N, dy.stride(0), x.stride(0),
            dx.stride(0)]
    programs = resident_programs(_bias_act_bwd_kernel, tuple(args), kwargs, dy.device)
    groups = row_programs(M, N, programs, BWD_TILE_ELEMENTS)
    colsum = None
    if dbias is not None:
        args[4] = torch.empty((groups, width), dtype=torch.float32, device=dy.device)
        colsum = Launch(_column_sum_kernel, (triton.cdiv(width, COLSUM_BLOCK),),
                        (args[4], dbias, groups, width),
                        dict(BLOCK=COLSUM_BLOCK, num_warps=NUM_WARPS))
    main = Launch(_bias_act_bwd_kernel, (triton.cdiv(N, block_n), groups), tuple(args), kwargs)
    return main, colsum, groups
