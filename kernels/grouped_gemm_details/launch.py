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
- :func:`forward_act` / :func:`dgrad_act`: the activation epilogue and its backward.

Each is a plan builder (``forward_plan``, ...: the config's launches compiled once, bound to
their grids and constexprs, :class:`mtp.kernels._launch.Launch`) called once. The op layer keeps
the plans per key and calls them with the tensors and a
:class:`~mtp.kernels.grouped_gemm_details.routing.Routing`, which holds the tile maps and expert
rows of one counts tensor (TMA kernels read them; one launch of the tile-map kernel per call of
an op, shared by its GEMMs). The pointer kernels derive their tiles from the counts themselves.
"""

from __future__ import annotations

import torch
import triton

from mtp.kernels._common import dot_upcast, fp32_dot_precision, next_power_of_2
from mtp.kernels._launch import Launch
from mtp.kernels.grouped_gemm_details import pointer, tma
from mtp.kernels.grouped_gemm_details.epilogue import ACTIVATIONS
from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.kernels.grouped_gemm_details.tiles import head_size

__all__ = [
    "Routing",
    "act_plan",
    "dgrad_act",
    "dgrad_act_plan",
    "forward",
    "forward_act",
    "forward_act_plan",
    "forward_plan",
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
                         "stride, 16-byte aligned base pointers and 16-byte aligned other strides")


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
    (``block_m`` set) read the tile map of ``block_m``-row tiles."""

    __slots__ = ("launch", "block_m", "ints")

    def __init__(self, launch: Launch, block_m: int, ints: tuple):
        self.launch, self.block_m, self.ints = launch, block_m, ints

    def __call__(self, tensors: tuple, counts: torch.Tensor, routing: Routing) -> None:
        if not self.block_m:
            self.launch(*tensors, counts, *self.ints)
            return
        block_m = self.block_m
        args = (*tensors, routing.head if routing.block == block_m else routing.tile_map(block_m),
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


def forward_plan(a, b, counts, out, config, *, bias=None):
    """The launch of :func:`forward` for these arguments' key: ``plan((a, b, out, bias or
    out), counts, routing)``."""
    M, K = a.shape
    E, _, N = b.shape
    if M == 0 or N == 0:
        return _nothing
    tensors = (a, b, out, out if bias is None else bias)
    grid = _grid(config, M, N, E)
    if config.kernel == "tma":
        _require_tma(tma_aligned(a, 1) and (tma_aligned(b, 2) or tma_aligned(b, 1))
                     and out.stride(1) == 1)  # fmt: skip
        trans_b = not (b.stride(2) == 1 and tma_aligned(b, 2))
        ints = (M, N, K, E, a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0))
        launch = Launch(tma.grouped_gemm_tma_kernel, grid,
                        (*tensors, _map_example(a.device), *ints), dict(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, TRANS_B=trans_b, FLATTEN=config.flatten,
            UPCAST_DOT=dot_upcast(a.dtype), HAS_BIAS=bias is not None,
            WARP_SPECIALIZE=config.warp_specialize, MAP_OFF=head_size(E),
            num_warps=config.num_warps, num_stages=config.num_stages,
        ))  # fmt: skip
        return _TileGemm(launch, config.block_m, ints)
    ints = (M, N, K, E, *a.stride(), *b.stride(), *out.stride())
    launch = Launch(pointer.grouped_gemm_kernel, grid, (*tensors, counts, *ints), dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=next_power_of_2(E), GROUP_M=config.group_m, PERSISTENT=config.persistent,
        HAS_BIAS=bias is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        **_dot_flags(a.dtype),
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
    plan((a, b, out, out if bias is None else bias), counts, routing or Routing(counts, M, E))
    return out


class _Wgrad:
    """The weight-gradient launches: the GEMM (and the split's fixed-order sum)."""

    __slots__ = ("launch", "tma", "ints", "split", "reduce")

    def __init__(self, launch, tma_rows: bool, ints, split=None, reduce=None):
        self.launch, self.tma, self.ints, self.split, self.reduce = (
            launch, tma_rows, ints, split, reduce)

    def __call__(self, a, b, counts, out, routing: Routing) -> None:
        if not self.tma:
            self.launch(a, b, out, counts, *self.ints)
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


def wgrad_plan(a, b, counts, out, config, *, accumulate: bool = False):
    """The launches of :func:`wgrad` for these arguments' key: ``plan(a, b, counts, out,
    routing)``."""
    M, P = a.shape
    Q = b.shape[1]
    E = out.shape[0]
    if E == 0 or P == 0 or Q == 0:
        return _nothing
    grid = (config.split * E * triton.cdiv(P, config.block_m) * triton.cdiv(Q, config.block_n),)
    if config.kernel == "pointer":
        ints = (M, P, Q, E, *a.stride(), *b.stride(), *out.stride())
        launch = Launch(pointer.grouped_wgrad_kernel, grid, (a, b, out, counts, *ints), dict(
            BLOCK_P=config.block_m, BLOCK_Q=config.block_n, BLOCK_R=config.block_k,
            BLOCK_E=next_power_of_2(E), GROUP_P=config.group_m, ACCUMULATE=accumulate,
            num_warps=config.num_warps, num_stages=config.num_stages,
            **_dot_flags(a.dtype),
        ))  # fmt: skip
        return _Wgrad(launch, False, ints)
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


def wgrad(a, b, counts, out, config, *, accumulate: bool = False, routing=None) -> torch.Tensor:
    """``out[e] = a[rows of e]^T @ b[rows of e]``, exact zeros for empty experts;
    ``accumulate=True``: ``out[e] += ...`` in fp32 in the epilogue (empty experts leave
    ``out[e]`` as it was).

    Args:
        a: ``[M, P]``, b: ``[M, Q]`` (same dtype), rows grouped by expert. out: ``[E, P, Q]``.
        config: tiles ``block_m`` x ``block_n`` of ``out[e]``, ``block_k`` rows per step; TMA:
            ``split`` row chunks per expert through an fp32 workspace and a fixed-order sum.
        routing: the :class:`Routing` of ``counts`` for ``M`` rows (a new one when None).
    """
    E = out.shape[0]
    _check_counts(counts, E, a.device)
    plan = wgrad_plan(a, b, counts, out, config, accumulate=accumulate)
    plan(a, b, counts, out, routing or Routing(counts, a.shape[0], E))
    return out


def act_plan(pointer_kernel, tma_kernel, a, b, b_unit_dim, counts, M, F, K, act, limit, alpha,
             config, tensors, pointer_strides, tma_strides, flags) -> _TileGemm:  # fmt: skip
    """The activation kernels: ``config.kernel`` picks the pointer or the TMA version (which
    reads ``b`` with its unit stride in ``b_unit_dim``)."""
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
        launch = Launch(tma_kernel, grid, (*tensors, _map_example(a.device), *ints), dict(
            tiles, FLATTEN=config.flatten, UPCAST_DOT=dot_upcast(a.dtype), MAP_OFF=head_size(E),
            **flags))
        return _TileGemm(launch, config.block_m, ints)
    ints = (M, F, K, E, *pointer_strides)
    launch = Launch(pointer_kernel, grid, (*tensors, counts, *ints), dict(
        tiles, BLOCK_E=next_power_of_2(E), PERSISTENT=config.persistent, **flags,
        **_dot_flags(a.dtype)))
    return _TileGemm(launch, 0, ints)


def forward_act_plan(a, b, counts, h, y, config, act, *, bias=None, probs=None, limit=7.0,
                     alpha=1.702):  # fmt: skip
    """The launch of :func:`forward_act` for these arguments' key: ``plan((a, b, h, y, bias or
    h, probs or h), counts, routing)``."""
    M, K = a.shape
    F = y.shape[1]
    if M == 0 or F == 0:
        return _nothing
    return act_plan(
        pointer.grouped_gemm_act_kernel, tma.grouped_gemm_act_tma_kernel, a, b, 2, counts, M, F,
        K, act, limit, alpha, config,
        (a, b, h, y, h if bias is None else bias, h if probs is None else probs),
        (a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), h.stride(0),
         y.stride(0)),
        (a.stride(0), b.stride(0), b.stride(1), h.stride(0), y.stride(0)),
        dict(HAS_BIAS=bias is not None, HAS_PROB=probs is not None),
    )  # fmt: skip


def forward_act(a, b, counts, h, y, config, act: str, *, bias=None, probs=None,
                limit: float = 7.0, alpha: float = 1.702, routing=None) -> None:  # fmt: skip
    """``h = a_e @ b[e] + bias[e]`` and ``y = act(h) * probs`` on each expert's rows, zeros past
    ``sum(counts)``.

    Args:
        a: ``[M, K]``; b: ``[E, K, W]``, ``W = 2F`` for the gated activations (SwiGLU: gate
            columns ``[0, F)``, up ``[F, 2F)``; clamped SwiGLU: gate ``2j``, up ``2j + 1``),
            else ``F``. h: ``[M, W]``, y: ``[M, F]`` outputs (last dims contiguous).
        act: a key of :data:`.epilogue.ACTIVATIONS`. bias: contiguous ``[E, W]`` or None.
        probs: contiguous ``[M]`` or None. limit, alpha: the clamped SwiGLU's.
        routing: the :class:`Routing` of ``counts`` for ``M`` rows (a new one when None).
    """
    M, E = a.shape[0], b.shape[0]
    if M == 0 or y.shape[1] == 0:
        return
    _check_counts(counts, E, a.device)
    plan = forward_act_plan(a, b, counts, h, y, config, act, bias=bias, probs=probs,
                            limit=limit, alpha=alpha)  # fmt: skip
    plan((a, b, h, y, h if bias is None else bias, h if probs is None else probs), counts,
         routing or Routing(counts, M, E))


def dgrad_act_plan(g, b, counts, h, dh, config, act, *, probs=None, limit=7.0, alpha=1.702):
    """The launch of :func:`dgrad_act` for these arguments' key: ``plan((g, b, h, probs or dh,
    dh, part or dh), counts, routing)`` with ``part`` ``[part_rows(config, F), M]`` fp32."""
    M, K = g.shape
    F = b.shape[2]
    if M == 0 or F == 0:
        return _nothing
    part = dh if probs is None else torch.empty((1,), dtype=torch.float32, device=g.device)
    return act_plan(
        pointer.grouped_gemm_dact_kernel, tma.grouped_gemm_dact_tma_kernel, g, b, 1, counts, M,
        F, K, act, limit, alpha, config,
        (g, b, h, dh if probs is None else probs, dh, part),
        (g.stride(0), g.stride(1), b.stride(0), b.stride(1), b.stride(2), h.stride(0),
         dh.stride(0)),
        (g.stride(0), b.stride(0), b.stride(2), h.stride(0), dh.stride(0)),
        dict(HAS_PROB=probs is not None),
    )  # fmt: skip


def part_rows(config, F: int) -> int:
    """Rows of :func:`dgrad_act`'s ``dL/dprobs`` partials: its column tiles over ``F``."""
    return triton.cdiv(F, config.block_n)


def dgrad_act(g, b, counts, h, dh, config, act: str, *, probs=None, limit: float = 7.0,
              alpha: float = 1.702, routing=None) -> torch.Tensor | None:  # fmt: skip
    """``dy = g_e @ b[e]`` (``b[e] = w2[e]^T``), ``dh = dy * probs * act'(h)`` on each expert's
    rows, zeros past ``sum(counts)``; returns the fp32 ``[column tiles, M]`` partials of
    ``dL/dprobs`` (sum them over dim 0) when ``probs`` is given, else None.

    Args:
        g: ``[M, K]`` (the next GEMM's output gradient); b: ``[E, K, F]`` (``w2.transpose(1,
            2)`` of an ``[E, F, K]`` weight; TMA reads ``w2`` with its unit last stride);
            h: ``[M, W]`` the forward's pre-activation; dh: ``[M, W]`` output; the rest as
            :func:`forward_act`.
    """
    M, E, F = g.shape[0], b.shape[0], b.shape[2]
    _check_counts(counts, E, g.device)
    part = None
    if probs is not None:
        part = torch.empty((part_rows(config, F), M), dtype=torch.float32, device=g.device)
    if M == 0 or F == 0:
        return None if part is None else part.zero_()
    plan = dgrad_act_plan(g, b, counts, h, dh, config, act, probs=probs, limit=limit,
                          alpha=alpha)  # fmt: skip
    plan((g, b, h, dh if probs is None else probs, dh, dh if part is None else part), counts,
         routing or Routing(counts, M, E))
    return part
