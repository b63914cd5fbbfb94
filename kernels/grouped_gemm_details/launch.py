"""Launchers of the grouped GEMM kernels: tensors, preallocated outputs and a config in, kernels
launched; they choose nothing (:func:`mtp.ops.grouped_gemm.config.make_config` does).

A config is any object with the fields of ``mtp.ops.grouped_gemm.config.GroupedGemmConfig``
(``kernel`` = ``"tma"`` or ``"pointer"``, the tiles, warps, stages, ``persistent``,
``programs``, ``warp_specialize``, ``flatten``, ``split``). Counts are ``[E]`` int32/int64 on
the operands' device and are never read on the host.

- :func:`forward`: ``out[rows of e] = a[rows of e] @ b[e] (+ bias[e])``, zeros past the routed
  rows (TMA: the tile map, then the GEMM: two launches; pointer: one).
- :func:`wgrad`: ``out[e] (+)= a_e^T @ b_e`` (TMA: expert rows, the GEMM, the split's
  reduction when ``split > 1``; pointer: one launch).
- :func:`forward_act` / :func:`dgrad_act`: the activation epilogue and its backward
  (``dgrad_act(..., y=)``: the forward's ``act(h) * p`` written again, for the next weight
  gradient).
- :func:`fp8_forward_plan` / :func:`fp8_wgrad_plan`: FP8 operands with block scales.

Row gather / scatter: :func:`forward_act` and :func:`wgrad` take ``gather`` (``[M]``
int32/int64, row ``r`` reads ``a[gather[r]]``, ``-1`` a zero row), :func:`forward_plan`
``scatter`` (row ``r`` stored at ``out[scatter[r]]``); pointer configs only (a TMA descriptor
moves a box of consecutive rows).

Each is a plan builder (``forward_plan``, ...: the config's launches compiled once, bound to
their grids and constexprs, :class:`mtp.kernels._launch.Launch`) called once. The op layer keeps
the plans per key and calls them with the tensors and a :class:`Routing`, which holds the tile
maps and expert rows of one counts tensor (TMA kernels read them; one tile-map launch per op
call, shared by its GEMMs). The pointer kernels derive their tiles from the counts themselves.
"""

from __future__ import annotations

import torch
import triton

from mtp.kernels._common import dot_upcast, fp32_dot_precision, next_power_of_2
from mtp.kernels._launch import Launch
from mtp.kernels.grouped_gemm_details import fp8, pointer, tma
from mtp.kernels.grouped_gemm_details.epilogue import ACTIVATIONS
from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.kernels.grouped_gemm_details.tiles import head_size

__all__ = [
    "Routing",
    "act_plan",
    "act_tensors",
    "dact_tensors",
    "dgrad_act",
    "dgrad_act_plan",
    "forward",
    "forward_act",
    "forward_act_plan",
    "forward_plan",
    "fp8_forward_plan",
    "fp8_wgrad_plan",
    "num_row_tiles_bound",
    "part_rows",
    "tma_aligned",
    "wgrad",
    "wgrad_plan",
]


def tma_aligned(t: torch.Tensor, unit_dim: int) -> bool:
    """Whether TMA can read ``t``: fp16/bf16, 16-byte aligned base, unit stride in ``unit_dim``,
    16-byte aligned other strides."""
    if t.dtype not in (torch.float16, torch.bfloat16):
        return False
    es = t.element_size()
    return (
        t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0
        and all((s * es) % 16 == 0 for d, s in enumerate(t.stride()) if d != unit_dim)
    )


def _require_tma(ok: bool) -> None:
    if not ok:
        raise ValueError("a TMA config: tma=True needs fp16/bf16 operands with a unit last "
                         "stride, 16-byte aligned pointers and other strides, no row scatter")


def num_row_tiles_bound(M: int, E: int, block_m: int) -> int:
    """Worst-case row tiles of a forward kernel: ``cdiv(M, BM) + E`` (``E - 1`` for the
    experts' partial tiles, one for the zero tail)."""
    return triton.cdiv(M, block_m) + E


def _dot_flags(dtype: torch.dtype) -> dict:
    return {
        "UPCAST_DOT": dot_upcast(dtype),
        "DOT_PRECISION": fp32_dot_precision() if dtype == torch.float32 else "ieee",
    }



def _check_counts(counts: torch.Tensor, E: int, device: torch.device) -> None:
    if counts.dtype not in (torch.int32, torch.int64) or counts.shape != (E,):
        raise ValueError(f"counts must be int32/int64 of shape ({E},), got {counts.dtype} "
                         f"{tuple(counts.shape)}")  # fmt: skip
    if counts.device != device or not counts.is_contiguous():
        raise ValueError(f"counts must be contiguous on {device}, got {counts.device}")


def _torch_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _allocator_missing(err: RuntimeError) -> None:
    """Kernels that create tensor descriptors on the device take a little global scratch from
    Triton's allocator. Where none is set (Triton raises before launching), a torch one is
    installed with the public ``triton.set_allocator`` and the caller retries; an allocator the
    user set is never replaced. Re-raises any other error."""
    if "allocator" not in str(err).lower():
        raise err
    triton.set_allocator(_torch_allocator)


def _grid(config, M: int, N: int, E: int) -> tuple[int]:
    """Worst-case tiles, or one wave of ``config.programs`` programs when persistent."""
    tiles = num_row_tiles_bound(M, E, config.block_m) * triton.cdiv(N, config.block_n)
    persistent = config.persistent and config.programs > 0
    return (min(tiles, config.programs) if persistent else tiles,)


class _TileGemm:
    """A forward-type launch: ``launch(*tensors, counts or the tile map, *ints)``; TMA kernels
    (``block_m`` set) read the tile map of ``block_m``-row tiles and take the first ``take``
    tensors (the pointer kernels' gather operands are not theirs)."""

    __slots__ = ("launch", "block_m", "ints", "take")

    def __init__(self, launch: Launch, block_m: int, ints: tuple, take: int = 64):
        self.launch, self.block_m, self.ints, self.take = launch, block_m, ints, take

    def __call__(self, tensors: tuple, counts: torch.Tensor, routing: Routing) -> None:
        if not self.block_m:
            self.launch(*tensors, counts, *self.ints)
            return
        block_m = self.block_m
        args = (*tensors[: self.take],
                routing.head if routing.block == block_m else routing.tile_map(block_m),
                *self.ints)  # fmt: skip
        try:
            self.launch(*args)
        except RuntimeError as err:
            _allocator_missing(err)
            self.launch(*args)


def _nothing(*args) -> None:
    return None


def _map_example(device) -> torch.Tensor:
    """An int32 stand-in for the tile map while compiling (same dtype and alignment)."""
    return torch.empty(4, dtype=torch.int32, device=device)


def forward_plan(a, b, counts, out, config, *, bias=None, scatter=None):
    """The launch of :func:`forward` for these arguments' key: ``plan((a, b, out, bias or out,
    scatter or counts), counts, routing)``; ``scatter`` (``[M]``, pointer configs only): row
    ``r`` is stored at ``out[scatter[r]]``."""
    M, K = a.shape
    E, _, N = b.shape
    if M == 0 or N == 0:
        return _nothing
    tensors = (a, b, out, out if bias is None else bias, counts if scatter is None else scatter)
    grid = _grid(config, M, N, E)
    if config.kernel == "tma":
        _require_tma(tma_aligned(a, 1) and (tma_aligned(b, 2) or tma_aligned(b, 1))
                     and out.stride(1) == 1 and scatter is None)  # fmt: skip
        trans_b = not (b.stride(2) == 1 and tma_aligned(b, 2))
        ints = (M, N, K, E, a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0))
        launch = Launch(tma.grouped_gemm_tma_kernel, grid,
                        (*tensors[:4], _map_example(a.device), *ints), dict(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, TRANS_B=trans_b, FLATTEN=config.flatten,
            UPCAST_DOT=dot_upcast(a.dtype), HAS_BIAS=bias is not None,
            WARP_SPECIALIZE=config.warp_specialize, MAP_OFF=head_size(E),
            num_warps=config.num_warps, num_stages=config.num_stages,
        ))  # fmt: skip
        return _TileGemm(launch, config.block_m, ints, take=4)
    ints = (M, N, K, E, *a.stride(), *b.stride(), *out.stride())
    launch = Launch(pointer.grouped_gemm_kernel, grid, (*tensors, counts, *ints), dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=next_power_of_2(E), GROUP_M=config.group_m, PERSISTENT=config.persistent,
        HAS_BIAS=bias is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        SCATTER=scatter is not None, **_dot_flags(a.dtype),
    ))  # fmt: skip
    return _TileGemm(launch, 0, ints)


def forward(a, b, counts, out, config, *, bias=None, routing=None) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e] (+ bias[e])``, zeros past ``sum(counts)``.

    Args:
        a: ``[M, K]``, rows grouped by expert; b: ``[E, K, N]`` (``w.transpose(1, 2)`` for an
            ``[E, N, K]`` weight); both any strides for the pointer kernel, TMA-aligned for TMA.
        counts: ``[E]`` int32/int64 on ``a``'s device. out: ``[M, N]``, every element written.
        config: see the module doc. bias: contiguous ``[E, N]`` (any float dtype) or None.
        routing: the :class:`Routing` of ``counts`` for ``M`` rows (a new one when None).
    """
    M, E, N = a.shape[0], b.shape[0], b.shape[2]
    _check_counts(counts, E, a.device)
    if bias is not None and (bias.shape != (E, N) or not bias.is_contiguous()
                             or bias.device != a.device):  # fmt: skip
        raise ValueError(f"bias must be contiguous [{E}, {N}] on {a.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")  # fmt: skip
    plan = forward_plan(a, b, counts, out, config, bias=bias)
    plan((a, b, out, out if bias is None else bias, counts), counts,
         routing or Routing(counts, M, E))
    return out


class _Wgrad:
    """The weight-gradient launches: the GEMM (and the split's fixed-order sum)."""

    __slots__ = ("launch", "tma", "ints", "split", "reduce")

    def __init__(self, launch, tma_rows: bool, ints, split=None, reduce=None):
        self.launch, self.tma, self.ints, self.split, self.reduce = (
            launch, tma_rows, ints, split, reduce)

    def __call__(self, a, b, counts, out, routing: Routing, gather=None) -> None:
        if not self.tma:
            self.launch(a, b, out, counts, counts if gather is None else gather, *self.ints)
            return
        target = out
        if self.split is not None:  # (shape of the fp32 partials, ints of the reduction)
            target = torch.empty(self.split[0], dtype=torch.float32, device=out.device)
        args = (a, b, target, routing.rows(), *self.ints)
        try:
            self.launch(*args)
        except RuntimeError as err:
            _allocator_missing(err)
            self.launch(*args)
        if self.reduce is not None:
            self.reduce(target, out, *self.split[1])


def wgrad_plan(a, b, counts, out, config, *, accumulate: bool = False, gather=None):
    """The launches of :func:`wgrad` for these arguments' key: ``plan(a, b, counts, out,
    routing, gather)``."""
    P, (M, Q), E = a.shape[1], b.shape, out.shape[0]
    if E == 0 or P == 0 or Q == 0:
        return _nothing
    grid = (config.split * E * triton.cdiv(P, config.block_m) * triton.cdiv(Q, config.block_n),)
    if config.kernel == "pointer":
        ints = (M, P, Q, E, *a.stride(), *b.stride(), *out.stride())
        args = (a, b, out, counts, counts if gather is None else gather, *ints)
        launch = Launch(pointer.grouped_wgrad_kernel, grid, args, dict(
            BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k,
            BLOCK_E=next_power_of_2(E), GROUP_P=config.group_m, ACCUMULATE=accumulate,
            GATHER_A=gather is not None, num_warps=config.num_warps,
            num_stages=config.num_stages, **_dot_flags(a.dtype),
        ))  # fmt: skip
        return _Wgrad(launch, False, ints)
    if gather is not None:
        raise ValueError("a gathered weight gradient needs the pointer kernel (kernel='pointer')")
    _require_tma(tma_aligned(a, 1) and tma_aligned(b, 1) and out.stride(2) == 1)
    split = config.split
    target = out if split == 1 else torch.empty((split, E, P, Q), dtype=torch.float32,
                                                device=out.device)  # fmt: skip
    strides = (out.stride(0), out.stride(1), 0) if split == 1 else (
        target.stride(1), target.stride(2), target.stride(0))
    ints = (M, P, Q, E, a.stride(0), b.stride(0), *strides)
    launch = Launch(tma.grouped_wgrad_tma_kernel, grid, (a, b, target, _map_example(a.device),
                                                          *ints), dict(
        BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k,
        GROUP_P=config.group_m, SPLIT=split, WARP_SPECIALIZE=config.warp_specialize,
        UPCAST_DOT=dot_upcast(a.dtype), ACCUMULATE=accumulate and split == 1,
        num_warps=config.num_warps, num_stages=config.num_stages,
    ))  # fmt: skip
    if split == 1:
        return _Wgrad(launch, True, ints)
    numel, block = E * P * Q, 1024
    sums = (numel, P * Q, Q, *out.stride())
    reduce = Launch(tma.split_reduce_kernel, (triton.cdiv(numel, block),), (target, out, *sums),
                    dict(SPLIT=split, BLOCK=block, ACCUMULATE=accumulate))
    return _Wgrad(launch, True, ints, ((split, E, P, Q), sums), reduce)


def wgrad(a, b, counts, out, config, *, accumulate: bool = False, routing=None,
          gather=None) -> torch.Tensor:  # fmt: skip
    """``out[e] = a[rows of e]^T @ b[rows of e]``, exact zeros for empty experts;
    ``accumulate=True``: ``out[e] += ...`` in fp32 in the epilogue (empty experts leave
    ``out[e]`` as it was).

    Args:
        a: ``[M, P]``, b: ``[M, Q]`` (same dtype), rows grouped by expert. out: ``[E, P, Q]``.
        config: tiles ``block_m`` x ``block_n`` of ``out[e]``, ``block_k`` rows per step; TMA:
            ``split`` row chunks per expert through an fp32 workspace and a fixed-order sum.
        routing: the :class:`Routing` of ``counts`` for ``M`` rows (a new one when None).
        gather: ``[M]`` int32/int64 row index: row ``r`` of ``a`` is ``a[gather[r]]`` (``a``
            then has any number of rows; ``-1``: a zero row). Pointer configs only.
    """
    E, M = out.shape[0], b.shape[0]
    _check_counts(counts, E, a.device)
    plan = wgrad_plan(a, b, counts, out, config, accumulate=accumulate, gather=gather)
    plan(a, b, counts, out, routing or Routing(counts, M, E), gather)
    return out


def act_plan(pointer_kernel, tma_kernel, a, b, b_unit_dim, counts, M, F, K, act, limit, alpha,
             config, tensors, pointer_strides, tma_strides, flags, tma_take=64,
             pointer_flags=None) -> _TileGemm:  # fmt: skip
    """The activation kernels: ``config.kernel`` picks the pointer or the TMA version (which
    reads ``b`` with its unit stride in ``b_unit_dim`` and takes the first ``tma_take`` of
    ``tensors``); ``pointer_flags``: constexprs of the pointer kernel only."""
    E = b.shape[0]
    flags = dict(flags, ACT=ACTIVATIONS[act])
    if act == "clamped_swiglu":  # constexprs: other activations keep one build
        flags.update(LIMIT=float(limit), ALPHA=float(alpha))
    grid = _grid(config, M, F, E)
    tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 GROUP_M=config.group_m, num_warps=config.num_warps,
                 num_stages=config.num_stages)  # fmt: skip
    if config.kernel == "tma":
        _require_tma(tma_aligned(a, 1) and tma_aligned(b, b_unit_dim))
        ints = (M, F, K, E, *tma_strides)
        launch = Launch(tma_kernel, grid, (*tensors[:tma_take], _map_example(a.device), *ints),
                        dict(tiles, FLATTEN=config.flatten, UPCAST_DOT=dot_upcast(a.dtype),
                             MAP_OFF=head_size(E), **flags))  # fmt: skip
        return _TileGemm(launch, config.block_m, ints, tma_take)
    ints = (M, F, K, E, *pointer_strides)
    launch = Launch(pointer_kernel, grid, (*tensors, counts, *ints), dict(
        tiles, BLOCK_E=next_power_of_2(E), PERSISTENT=config.persistent, **flags,
        **(pointer_flags or {}), **_dot_flags(a.dtype)))
    return _TileGemm(launch, 0, ints)


def act_tensors(a, b, h, y, bias, probs, gather=None, row_probs=None) -> tuple:
    """The tensors a :func:`forward_act_plan` plan takes (unused slots hold ``h``)."""
    return (a, b, h, y, h if bias is None else bias, h if probs is None else probs,
            h if gather is None else gather, h if row_probs is None else row_probs)


def forward_act_plan(a, b, counts, h, y, config, act, *, bias=None, probs=None, limit=7.0,
                     alpha=1.702, gather=None, row_probs=None, probs_strides=(1, 0)):
    """The launch of :func:`forward_act` for these arguments' key: ``plan(act_tensors(...),
    counts, routing)``."""
    K, (M, F) = a.shape[1], y.shape
    if M == 0 or F == 0:
        return _nothing
    if gather is not None and config.kernel == "tma":
        raise ValueError("a gathered forward needs the pointer kernel (kernel='pointer')")
    return act_plan(
        pointer.grouped_gemm_act_kernel, tma.grouped_gemm_act_tma_kernel, a, b, 2, counts, M, F,
        K, act, limit, alpha, config, act_tensors(a, b, h, y, bias, probs, gather, row_probs),
        (a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), h.stride(0),
         y.stride(0), *probs_strides),
        (a.stride(0), b.stride(0), b.stride(1), h.stride(0), y.stride(0)),
        dict(HAS_BIAS=bias is not None, HAS_PROB=probs is not None), tma_take=6,
        pointer_flags=dict(GATHER=gather is not None, ROW_PROBS=row_probs is not None),
    )  # fmt: skip


def forward_act(a, b, counts, h, y, config, act: str, *, bias=None, probs=None,
                limit: float = 7.0, alpha: float = 1.702, routing=None, gather=None,
                row_probs=None, probs_strides=(1, 0)) -> None:  # fmt: skip
    """``h = a_e @ b[e] + bias[e]`` and ``y = act(h) * probs`` on each expert's rows, zeros past
    ``sum(counts)``.

    Args:
        a: ``[M, K]``; b: ``[E, K, W]``, ``W = 2F`` for the gated activations (SwiGLU: gate
            columns ``[0, F)``, up ``[F, 2F)``; clamped SwiGLU: gate ``2j``, up ``2j + 1``),
            else ``F``. h: ``[M, W]``, y: ``[M, F]`` outputs (last dims contiguous).
        act: a key of :data:`.epilogue.ACTIVATIONS`. bias: contiguous ``[E, W]`` or None.
        probs: row ``r``'s probability is ``probs[r * s + e * t]`` with ``(s, t) =
            probs_strides`` (default: a contiguous ``[M]``), or None. limit, alpha: the clamped
            SwiGLU's.
        routing: the :class:`Routing` of ``counts`` for ``M`` rows (a new one when None).
        gather: ``[M]`` int32/int64: row ``r`` reads ``a[gather[r]]`` and its probability at
            ``gather[r]`` instead of ``r`` (``a`` then has any number of rows; ``-1``: a zero
            row of probability 0). Pointer configs only.
        row_probs: optional fp32 ``[M]`` output: each row's probability (pointer configs).
    """
    M, E = y.shape[0], b.shape[0]
    if M == 0 or y.shape[1] == 0:
        return
    _check_counts(counts, E, a.device)
    plan = forward_act_plan(a, b, counts, h, y, config, act, bias=bias, probs=probs,
                            limit=limit, alpha=alpha, gather=gather, row_probs=row_probs,
                            probs_strides=probs_strides)  # fmt: skip
    plan(act_tensors(a, b, h, y, bias, probs, gather, row_probs), counts,
         routing or Routing(counts, M, E))


def dact_tensors(g, b, h, dh, probs, part, y) -> tuple:
    """The tensors a :func:`dgrad_act_plan` plan takes (unused slots hold ``dh``)."""
    return (g, b, h, dh if probs is None else probs, dh, dh if part is None else part,
            dh if y is None else y)


def dgrad_act_plan(g, b, counts, h, dh, config, act, *, probs=None, limit=7.0, alpha=1.702,
                   y=None):  # fmt: skip
    """The launch of :func:`dgrad_act` for these arguments' key: ``plan(dact_tensors(...),
    counts, routing)`` with ``part`` ``[part_rows(config, F), M]`` fp32."""
    M, K = g.shape
    F = b.shape[2]
    if M == 0 or F == 0:
        return _nothing
    part = None if probs is None else torch.empty((1,), dtype=torch.float32, device=g.device)
    y_stride = 0 if y is None else y.stride(0)
    return act_plan(
        pointer.grouped_gemm_dact_kernel, tma.grouped_gemm_dact_tma_kernel, g, b, 1, counts, M,
        F, K, act, limit, alpha, config, dact_tensors(g, b, h, dh, probs, part, y),
        (g.stride(0), g.stride(1), b.stride(0), b.stride(1), b.stride(2), h.stride(0),
         dh.stride(0), y_stride),
        (g.stride(0), b.stride(0), b.stride(2), h.stride(0), dh.stride(0), y_stride),
        dict(HAS_PROB=probs is not None, RECOMPUTE=y is not None),
    )  # fmt: skip


def part_rows(config, F: int) -> int:
    """Rows of :func:`dgrad_act`'s ``dL/dprobs`` partials: its column tiles over ``F``."""
    return triton.cdiv(F, config.block_n)


def dgrad_act(g, b, counts, h, dh, config, act: str, *, probs=None, limit: float = 7.0,
              alpha: float = 1.702, routing=None, y=None) -> torch.Tensor | None:  # fmt: skip
    """``dy = g_e @ b[e]`` (``b[e] = w2[e]^T``), ``dh = dy * probs * act'(h)`` on each expert's
    rows, zeros past ``sum(counts)``; returns the fp32 ``[column tiles, M]`` partials of
    ``dL/dprobs`` (sum them over dim 0) when ``probs`` is given, else None.

    Args:
        g: ``[M, K]`` (the next GEMM's output gradient); b: ``[E, K, F]`` (``w2.transpose(1,
            2)`` of an ``[E, F, K]`` weight; TMA reads ``w2`` with its unit last stride);
            h: ``[M, W]`` the forward's pre-activation; dh: ``[M, W]`` output; the rest as
            :func:`forward_act`.
        y: optional ``[M, F]`` output (last dim contiguous): ``act(h) * probs`` again, the
            forward's fc1 output (what fc2's weight gradient reads), bit-equal to it.
    """
    M, E, F = g.shape[0], b.shape[0], b.shape[2]
    _check_counts(counts, E, g.device)
    part = None
    if probs is not None:
        part = torch.empty((part_rows(config, F), M), dtype=torch.float32, device=g.device)
    if M == 0 or F == 0:
        return None if part is None else part.zero_()
    plan = dgrad_act_plan(g, b, counts, h, dh, config, act, probs=probs, limit=limit,
                          alpha=alpha, y=y)  # fmt: skip
    plan(dact_tensors(g, b, h, dh, probs, part, y), counts, routing or Routing(counts, M, E))
    return part


# --------------------------------------------------------------------------------------------
# FP8 operands with block scales (:mod:`.fp8`)
# --------------------------------------------------------------------------------------------


class _Fp8Launch:
    """``plan(a, sa, b, sb, counts, out)``: one FP8 launch with its integer arguments bound."""

    __slots__ = ("launch", "ints")

    def __init__(self, launch: Launch, ints: tuple):
        self.launch, self.ints = launch, ints

    def __call__(self, a, sa, b, sb, counts, out) -> None:
        self.launch(a, sa, b, sb, out, counts, *self.ints)


def fp8_forward_plan(a, sa, b, sb, counts, out, config, *, mx: bool, group_k: int,
                     group_n: int):  # fmt: skip
    """``out[rows of e] = a[rows] @ b[e]`` dequantised, zeros past the routed rows: ``a [M, K]``
    e4m3 with scales ``sa [M, cdiv(K, group_k)]``, ``b [E, K, N]`` e4m3 with scales
    ``sb [E, cdiv(K, group_k), cdiv(N, group_n)]`` (fp32, or e8m0 bytes with ``mx``), any
    strides; ``out [M, N]`` with a unit column stride. ``plan(a, sa, b, sb, counts, out)``."""
    M, K = a.shape
    E, _, N = b.shape
    if M == 0 or N == 0:
        return _nothing
    ints = (M, N, K, E, *a.stride(), *sa.stride(), *b.stride(), *sb.stride(), out.stride(0))
    launch = Launch(fp8.grouped_gemm_fp8_kernel, _grid(config, M, N, E),
                    (a, sa, b, sb, out, counts, *ints), dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=next_power_of_2(E), GROUP_M=config.group_m, GROUP_K=group_k, GROUP_N=group_n,
        MX=mx, PERSISTENT=config.persistent, num_warps=config.num_warps,
        num_stages=config.num_stages,
    ))  # fmt: skip
    return _Fp8Launch(launch, ints)


def fp8_wgrad_plan(a, sa, b, sb, counts, out, config, *, mx: bool, group: int,
                   accumulate: bool = False):  # fmt: skip
    """``out[e] (+)= a_e^T @ b_e`` dequantised (exact zeros for empty experts): ``a [M', P]``
    and ``b [M', Q]`` column-wise e4m3 operands in the padded layout (``group x 1`` blocks,
    scales ``[M' / group, P]`` and ``[M' / group, Q]``), ``out [E, P, Q]``.
    ``plan(a, sa, b, sb, counts, out)``."""
    P, Q, E = a.shape[1], b.shape[1], out.shape[0]
    if E == 0 or P == 0 or Q == 0:
        return _nothing
    grid = (E * triton.cdiv(P, config.block_m) * triton.cdiv(Q, config.block_n),)
    ints = (P, Q, E, *a.stride(), *sa.stride(), *b.stride(), *sb.stride(), *out.stride())
    launch = Launch(fp8.grouped_wgrad_fp8_kernel, grid, (a, sa, b, sb, out, counts, *ints), dict(
        BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k,
        BLOCK_E=next_power_of_2(E), GROUP_P=config.group_m, GROUP=group, MX=mx,
        ACCUMULATE=accumulate, num_warps=config.num_warps, num_stages=config.num_stages,
    ))  # fmt: skip
    return _Fp8Launch(launch, ints)
