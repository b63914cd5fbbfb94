"""The custom op ``mtp::quantize_fp8`` (with its fake), its body on each backend and the launch
plans of the ``triton`` backend.

The op returns the *physical* tensors ``(q, s, qt, st)`` (``[0]``-shaped where a layout was not
asked), for ``x [..., R, C]`` with ``b`` the block:

=================== ======================================== ===================================
``layouts``          ``q``, ``s``                              ``qt``, ``st``
=================== ======================================== ===================================
``rowwise``          ``[..., R, C]``, ``[..., R, cdiv(C, b)]``
``colwise``                                                    ``[..., C, R']``, ``[..., C, R'/b]``
``rowwise+colwise``  as ``rowwise``                            as ``colwise``
``block``            ``[..., R, C]``, 128 x 128 blocks
``block+t``          as ``block``                              ``[..., C, R]`` (the same values)
=================== ======================================== ===================================

``R' = R``, or with counts (``x [M, C]`` grouped by expert) the padded rows of
:func:`~mtp.ops.quantize.reference.padded_rows`. The colwise tensors are stored with the blocked
axis contiguous (``qt.mT`` is the logical ``[..., R', C]``).
"""

from __future__ import annotations

import torch

from mtp.kernels._launch import Plans, aligned
from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.kernels.quantize import QuantizePlan
from mtp.ops.quantize.reference import padded_rows, quantize_layouts
from mtp.utils import empty

__all__ = ["LAYOUT_SETS", "output_shapes", "run_quantize"]

#: what ``layouts`` may be: one layout, a row- and column-wise pair, or blocks with a copy
LAYOUT_SETS = ("rowwise", "colwise", "rowwise+colwise", "block", "block+t")
_F8 = torch.float8_e4m3fn
_PLANS = Plans()


def _scale_dtype(kind: str) -> torch.dtype:
    return torch.float8_e8m0fnu if kind == "e8m0" else torch.float32


def output_shapes(shape, counts_len: int | None, block: int, layouts: str) -> list:
    """Shapes of ``(q, s, qt, st)`` (``(0,)`` for those not written)."""
    *lead, R, C = shape
    cdiv = lambda n, b: -(-n // b)  # noqa: E731
    none = (0,)
    if layouts.startswith("block"):
        s = (*lead, cdiv(R, 128), cdiv(C, 128))
        return [shape, s, (*lead, C, R) if layouts == "block+t" else none, none]
    rows = R if counts_len is None else padded_rows(R, counts_len, block)
    row = "rowwise" in layouts
    col = "colwise" in layouts
    return [shape if row else none, (*lead, R, cdiv(C, block)) if row else none,
            (*lead, C, rows) if col else none, (*lead, C, rows // block if counts_len is not None
                                                else cdiv(R, block)) if col else none]


def _outputs(x, counts, block, layouts, kind):
    shapes = output_shapes(tuple(x.shape), None if counts is None else counts.shape[0], block,
                           layouts)  # fmt: skip
    sd = _scale_dtype(kind)
    return [empty(shape, dtype=dtype, device=x.device) if shape != (0,) else
            torch.empty(0, dtype=dtype, device=x.device)
            for shape, dtype in zip(shapes, (_F8, sd, _F8, sd))]  # fmt: skip


def _as3(t: torch.Tensor | None, logical_t: bool = False):
    """A 3-D view ``[B, rows, cols]`` of a kernel operand (``logical_t``: of ``t.mT``); e8m0
    scales as bytes."""
    if t.dtype == torch.float8_e8m0fnu:
        t = t.view(torch.uint8)
    if logical_t:
        t = t.mT
    return t.reshape(-1, *t.shape[-2:]) if t.dim() != 3 else t


def _triton(x, counts, block, layouts, kind, routing):
    q, s, qt, st = outs = _outputs(x, counts, block, layouts, kind)
    if x.numel() == 0:
        return outs
    x3 = _as3(x)
    square = "block" in layouts
    first = square or "rowwise" in layouts  # the row-wise (or block) data
    second = "+t" in layouts or "colwise" in layouts
    views = (_as3(q) if first else None, _as3(s) if first else None,
             _as3(qt, True) if second else None,
             _as3(st, True) if second and not square else None)  # fmt: skip
    E = 0 if counts is None else counts.shape[0]
    key = (layouts, kind, block, E, *x3.shape, *x3.stride(), x.dtype, x.device,
           aligned(x, *views, counts))  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        rows = padded_rows(x3.shape[1], E, block) if E else x3.shape[1]
        plan = _PLANS.add(key, QuantizePlan(
            x3, *views, group=128 if square else block, row=first and not square, col=second,
            square=square, experts=E, rows_bound=rows, scale=kind))  # fmt: skip
    map_buf = None
    if E:
        routing = routing or Routing(counts, x3.shape[1], E)
        map_buf = routing.tile_map(block)
    plan(x3, *views, map_buf)
    return outs


def _reference(x, counts, block, layouts, kind):
    got = quantize_layouts(x, counts, block, layouts, kind)
    outs = _outputs(x, counts, block, layouts, kind)
    for out, value in zip(outs, got):
        if value is not None:
            out.copy_(value)
    return outs


def run_quantize(x, counts, block: int, layouts: str, kind: str, backend: str,
                 routing=None) -> list:  # fmt: skip
    """The body of ``mtp::quantize_fp8`` on a resolved backend (``routing``: the Routing of
    ``counts`` for ``x``'s rows, shared with the grouped GEMM of the same call)."""
    if backend == "reference":
        return _reference(x, counts, block, layouts, kind)
    return _triton(x, counts, block, layouts, kind, routing)


@torch.library.custom_op("mtp::quantize_fp8", mutates_args=())
def _quantize_op(
    x: torch.Tensor,
    counts: torch.Tensor | None,
    block: int,
    layouts: str,
    kind: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, s, qt, st)``: ``x`` quantised to e4m3 in the ``layouts`` asked (module doc)."""
    return tuple(run_quantize(x, counts, block, layouts, kind, backend))


@_quantize_op.register_fake
def _(x, counts, block, layouts, kind, backend):
    shapes = output_shapes(tuple(x.shape), None if counts is None else counts.shape[0], block,
                           layouts)  # fmt: skip
    sd = _scale_dtype(kind)
    return tuple(x.new_empty(shape, dtype=dtype)
                 for shape, dtype in zip(shapes, (_F8, sd, _F8, sd)))  # fmt: skip
