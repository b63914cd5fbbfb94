"""The custom ops of the FP8 expert MLP (each with its fake), their bodies on the ``triton`` and
``reference`` backends and the Triton launch plans
(:mod:`mtp.kernels.grouped_gemm_details.fp8_act`).

- ``mtp::grouped_mlp_fp8_fc1``: fc1 from row-wise FP8 tokens (read through ``gather`` when
  given) and fc1's FP8 weight; writes the pre-activation ``h`` and ``y = act(h) * p``
  quantised row-wise (``q``, ``q_scales``: the recipe's layout, bitwise what
  :func:`mtp.ops.quantize` makes of the activation in ``h``'s dtype), and with ``gather`` each
  row's probability (``row_probs``).
- ``mtp::grouped_mlp_fp8_dact``: fc2's FP8 data gradient with the activation's backward:
  ``(dh, dL/dp, y)`` (``y = act(h) * p`` again with ``recompute``: fc2's weight gradient).

``reference``: the same values from the dequantised operands in PyTorch (fp32 math, the
reference quantiser), for comparison and CPUs without the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton

from mtp.kernels._common import interpreting, next_power_of_2
from mtp.kernels._launch import Plans, aligned
from mtp.kernels.grouped_gemm_details import fp8_act as kernels
from mtp.kernels.grouped_gemm_details.epilogue import ACTIVATIONS
from mtp.kernels.quantize import SCALE_KINDS
from mtp.ops.grouped_gemm.backends import _reference_forward, activation_reference
from mtp.ops.grouped_gemm.config import choice_state, device_arch
from mtp.ops.quantize import Fp8Tensor
from mtp.ops.quantize.reference import quantize_blocks
from mtp.utils import empty

__all__ = ["act_tiles", "dact_tiles", "fc1", "fp8_dact", "gathered_rows"]

_PLANS = Plans()
_F32 = torch.float32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """e8m0 scales as the bytes the kernels read and write."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def act_tiles(arch: int, recipe: str) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)`` of fc1's FP8 kernel: a
    blockwise tile is one 128-column scale group wide (two fp32 accumulators: 64 rows), an
    MXFP8 tile 128 rows (the block-scaled MMA's M) by 64 columns (two 32-column groups)."""
    if arch == 0:  # the interpreter: small tiles, K steps of 32 (the MX block)
        return 16, 128 if recipe == "blockwise" else 32, 32, 2, 4, 1
    if recipe == "blockwise":
        return 64, 128, 128, 8, 8, 3
    return 128, 64, 128, 8, 8, 3


def dact_tiles(arch: int, recipe: str) -> tuple[int, int, int, int, int, int]:
    """The same for fc2's data gradient with the activation's backward: its epilogue holds
    ``h``, ``dh`` and the recomputed ``y`` next to the fp32 ``dy``, so smaller tiles or more
    warps than the FP8 forward's (no spills on sm_90a / sm_100a): blockwise 64 x 64, 8 warps;
    MXFP8 128 x 64 (64 rows leave the block-scaled MMA for an emulation), 8 warps, 2 stages."""
    if arch == 0:
        return 16, 32, 32, 2, 4, 1
    if recipe == "blockwise":
        return 64, 64, 128, 8, 8, 3
    return 128, 64, 128, 8, 8, 2


def _probs_strides(probs, gather) -> tuple[int, int]:
    if probs is None:
        return 0, 0
    return (probs.stride(0), 0) if probs.dim() == 1 else (probs.stride(0), probs.stride(1))


# --------------------------------------------------------------------------------------------
# Triton bodies
# --------------------------------------------------------------------------------------------


def triton_fc1(x: Fp8Tensor, w: Fp8Tensor, counts, h, q, qs, probs, gather, row_probs, act,
               kind, limit, alpha) -> None:  # fmt: skip
    """The ``triton`` body of ``mtp::grouped_mlp_fp8_fc1`` (one launch)."""
    K, E, (M, F) = x.data.shape[1], w.data.shape[0], q.shape
    if M == 0 or F == 0:
        return
    sa, sb, ss = _bytes(x.scales), _bytes(w.scales), _bytes(qs)
    stand = x.data
    strides = _probs_strides(probs, gather)
    ints = (M, F, K, E, *x.data.stride(), *sa.stride(), *w.data.stride(), *sb.stride(),
            h.stride(0), q.stride(0), ss.stride(0), *strides)  # fmt: skip
    tensors = (x.data, sa, w.data, sb, h, q, ss, stand if probs is None else probs,
               stand if gather is None else gather, stand if row_probs is None else row_probs,
               counts)  # fmt: skip
    arch = device_arch(x.device)[0]
    key = ("fc1", x.recipe, w.layout, ints, tuple(t.dtype for t in tensors), aligned(*tensors),
           x.device, act, kind, limit, alpha, probs is None, gather is None, row_probs is None,
           choice_state())  # fmt: skip

    def options():
        bm, bn, bk, gm, warps, stages = act_tiles(arch, x.recipe)
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=next_power_of_2(E), GROUP_M=gm,
                    GROUP_K=w.block[0], GROUP_N=w.block[1], GROUP_Q=x.block[1],
                    MX=x.recipe == "mxfp8", ACT=ACTIVATIONS[act], HAS_PROB=probs is not None,
                    GATHER=gather is not None, ROW_PROBS=row_probs is not None,
                    SCALE=SCALE_KINDS[kind], SOFT_CVT=interpreting(), LIMIT=limit, ALPHA=alpha,
                    num_warps=warps, num_stages=stages)  # fmt: skip

    bm, bn = act_tiles(arch, x.recipe)[:2]
    grid = (kernels.row_tiles_bound(M, E, bm) * triton.cdiv(F, bn),)
    _PLANS.run(key, kernels.grouped_gemm_fp8_act_kernel, grid, (*tensors, *ints), options)


def triton_dact(a: Fp8Tensor, b: Fp8Tensor, counts, h, p, act, limit, alpha, recompute):
    """The ``triton`` body of ``mtp::grouped_mlp_fp8_dact``: ``(dh, fp32 [M] dL/dp or [0],
    y or [M, 0])``."""
    (M, K), (E, _, F) = a.data.shape, b.data.shape
    bm, bn, bk, gm, warps, stages = dact_tiles(device_arch(a.device)[0], a.recipe)
    dh = empty(h.shape, dtype=h.dtype, device=h.device)
    y = empty((M, F if recompute else 0), dtype=h.dtype, device=h.device)
    part = None if p is None else torch.empty((triton.cdiv(F, bn), M), dtype=_F32,
                                              device=h.device)  # fmt: skip
    if M and F:
        sa, sb = _bytes(a.scales), _bytes(b.scales)
        ints = (M, F, K, E, *a.data.stride(), *sa.stride(), *b.data.stride(), *sb.stride(),
                h.stride(0), dh.stride(0), y.stride(0))  # fmt: skip
        stand = a.data
        tensors = (a.data, sa, b.data, sb, h, stand if p is None else p, dh,
                   stand if part is None else part, y if recompute else stand, counts)
        key = ("dact", a.recipe, b.layout, ints, tuple(t.dtype for t in tensors),
               aligned(*tensors), a.device, act, limit, alpha, p is None, recompute,
               choice_state())  # fmt: skip

        def options():
            return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                        BLOCK_E=next_power_of_2(E), GROUP_M=gm, GROUP_K=b.block[0],
                        GROUP_N=b.block[1], MX=a.recipe == "mxfp8", ACT=ACTIVATIONS[act],
                        HAS_PROB=p is not None, RECOMPUTE=recompute, LIMIT=limit, ALPHA=alpha,
                        num_warps=warps, num_stages=stages)  # fmt: skip

        grid = (kernels.row_tiles_bound(M, E, bm) * triton.cdiv(F, bn),)
        _PLANS.run(key, kernels.grouped_gemm_fp8_dact_kernel, grid, (*tensors, *ints), options)
    elif part is not None:
        part.zero_()
    dp = h.new_empty((0,), dtype=_F32) if part is None else part.sum(0)  # fixed order
    return dh, dp, y


# --------------------------------------------------------------------------------------------
# Reference bodies (dequantised operands, PyTorch)
# --------------------------------------------------------------------------------------------


def gathered_rows(x, probs, gather, counts):
    """``(rows, probabilities)`` a row gather reads, materialised: ``x[gather[r]]`` (zeros for
    ``-1``) and ``probs[gather[r], expert of r]`` (``[S, E]`` probs; None stays None)."""
    keep = (gather >= 0).unsqueeze(1)
    if x.shape[0] == 0:  # no source row: every row reads -1
        return x.new_zeros((gather.shape[0], x.shape[1])), None if probs is None else \
            probs.new_zeros(gather.shape[0])  # fmt: skip
    # clamped into range both ways: the -1 rows are masked, and an index the kernels have not
    # written (a recording that launches nothing) reads a row instead of failing
    src = gather.clamp(0, x.shape[0] - 1).long()
    rows = torch.where(keep, x.index_select(0, src), 0)
    if probs is None:
        return rows, None
    ends = torch.cumsum(counts.to(gather.device), 0)
    r = torch.arange(gather.shape[0], device=gather.device)
    expert = torch.searchsorted(ends, r, right=True).clamp(max=probs.shape[1] - 1)
    p = probs[src, expert]
    return rows, torch.where(keep.squeeze(1), p, 0)


def _act_value(h, act, p, limit, alpha):
    """``act(h) * p`` in fp32, rounded once to ``h``'s dtype (as the kernels compute it)."""
    return activation_reference(h.float(), act, p, limit, alpha).to(h.dtype)


def reference_fc1(x: Fp8Tensor, w: Fp8Tensor, counts, h, q, qs, probs, gather, row_probs, act,
                  kind, limit, alpha) -> None:  # fmt: skip
    rows, p = x.dequantize(), probs
    if gather is not None:
        rows, p = gathered_rows(rows, probs, gather, counts)
        p = None if p is None else p.float()
    h.copy_(_reference_forward(rows, w.dequantize(), counts.cpu(), False, None))
    y = _act_value(h, act, p, limit, alpha)
    data, scales = quantize_blocks(y, 1, x.block[1], kind)
    q.copy_(data)
    qs.copy_(scales)
    if row_probs is not None:
        row_probs.copy_(torch.zeros_like(row_probs) if p is None else p)


def reference_dact(a: Fp8Tensor, b: Fp8Tensor, counts, h, p, act, limit, alpha, recompute):
    dy = _reference_forward(a.dequantize(), b.dequantize(), counts.cpu(), False, None)
    with torch.enable_grad():
        hh = h.detach().float().requires_grad_()
        pp = None if p is None else p.detach().float().requires_grad_()
        yy = activation_reference(hh, act, pp, limit, alpha)
        grads = torch.autograd.grad(yy, [hh] if pp is None else [hh, pp], dy)
    dp = h.new_empty((0,), dtype=_F32) if p is None else grads[1]
    y = _act_value(h, act, p, limit, alpha) if recompute else h.new_empty((h.shape[0], 0))
    return grads[0].to(h.dtype), dp, y


# --------------------------------------------------------------------------------------------
# Custom ops (fakes below each) and the calls on both paths
# --------------------------------------------------------------------------------------------


def run_fc1(x, w, counts, h, q, qs, probs, gather, row_probs, act, kind, limit, alpha,
            backend) -> None:  # fmt: skip
    body = reference_fc1 if backend == "reference" else triton_fc1
    body(x, w, counts, h, q, qs, probs, gather, row_probs, act, kind, limit, alpha)


@torch.library.custom_op("mtp::grouped_mlp_fp8_fc1",
                         mutates_args=("h", "q", "q_scales", "row_probs"))  # fmt: skip
def _fc1_op(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    h: torch.Tensor,
    q: torch.Tensor,
    q_scales: torch.Tensor,
    probs: torch.Tensor | None,
    gather: torch.Tensor | None,
    row_probs: torch.Tensor | None,
    recipe: str,
    w_layout: str,
    scale_kind: str,
    activation: str,
    limit: float,
    alpha: float,
    backend: str,
) -> None:
    """fc1 of the FP8 MLP: ``h`` and ``act(h) * p`` quantised into ``q``/``q_scales`` (module
    doc); no argument has a default (see ``mtp::grouped_gemm_out``)."""
    run_fc1(Fp8Tensor(x, x_scales, recipe, "rowwise"), Fp8Tensor(w, w_scales, recipe, w_layout),
            tokens_per_expert, h, q, q_scales, probs, gather, row_probs, activation, scale_kind,
            limit, alpha, backend)  # fmt: skip


@_fc1_op.register_fake
def _(x, x_scales, w, w_scales, tokens_per_expert, h, q, q_scales, probs, gather, row_probs,
      recipe, w_layout, scale_kind, activation, limit, alpha, backend):  # fmt: skip
    return None


def run_dact(a, b, counts, h, p, act, limit, alpha, recompute, backend):
    body = reference_dact if backend == "reference" else triton_dact
    return body(a, b, counts, h, p, act, limit, alpha, recompute)


@torch.library.custom_op("mtp::grouped_mlp_fp8_dact", mutates_args=())
def _dact_op(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None,
    recipe: str,
    b_layout: str,
    activation: str,
    limit: float,
    alpha: float,
    recompute: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh, dL/dp, y)`` from the row-wise FP8 output gradient ``a [M, H]`` and fc2's weight
    ``b [E, H, F]`` quantised along H (module doc)."""
    return run_dact(Fp8Tensor(a, a_scales, recipe, "rowwise"),
                    Fp8Tensor(b, b_scales, recipe, b_layout), tokens_per_expert, h, probs,
                    activation, limit, alpha, recompute, backend)  # fmt: skip


@_dact_op.register_fake
def _(a, a_scales, b, b_scales, tokens_per_expert, h, probs, recipe, b_layout, activation, limit,
      alpha, recompute, backend):  # fmt: skip
    M, F = a.shape[0], b.shape[2]
    return (h.new_empty(h.shape), h.new_empty((0 if probs is None else M,), dtype=_F32),
            h.new_empty((M, F if recompute else 0)))


def _scale_dtype(recipe: str) -> torch.dtype:
    return torch.float8_e8m0fnu if recipe == "mxfp8" else _F32


def fc1(xq: Fp8Tensor, wf: Fp8Tensor, counts, probs, gather, act, kind, limit, alpha, backend,
        direct, dtype, rows: int, F: int):  # fmt: skip
    """``(h [rows, W], y quantised (Fp8Tensor [rows, F]), p)`` with ``p`` the rows'
    probabilities (``probs``, or with ``gather`` the fp32 ``[rows]`` the kernel wrote);
    ``direct``: the body, else the custom op."""
    dev, W = xq.device, wf.shape[2]
    h = empty((rows, W), dtype=dtype, device=dev)
    q = empty((rows, F), dtype=torch.float8_e4m3fn, device=dev)
    qs = empty((rows, triton.cdiv(F, xq.block[1])), dtype=_scale_dtype(xq.recipe), device=dev)
    p = probs
    if gather is not None and probs is not None:
        p = empty((rows,), dtype=_F32, device=dev)
    rp = p if gather is not None else None
    if direct:
        run_fc1(xq, wf, counts, h, q, qs, probs, gather, rp, act, kind, limit, alpha, backend)
    else:
        torch.ops.mtp.grouped_mlp_fp8_fc1(xq.data, xq.scales, wf.data, wf.scales, counts, h, q,
                                          qs, probs, gather, rp, xq.recipe, wf.layout, kind, act,
                                          limit, alpha, backend)  # fmt: skip
    return h, Fp8Tensor(q, qs, xq.recipe, "rowwise"), p


def fp8_dact(dq: Fp8Tensor, w2d: Fp8Tensor, counts, h, p, act, limit, alpha, recompute,
             backend, direct):  # fmt: skip
    """``(dh, dL/dp (fp32 [M] or [0]), y or [M, 0])`` of ``mtp::grouped_mlp_fp8_dact``."""
    if direct:
        return run_dact(dq, w2d, counts, h, p, act, limit, alpha, recompute, backend)
    return torch.ops.mtp.grouped_mlp_fp8_dact(dq.data, dq.scales, w2d.data, w2d.scales, counts,
                                              h, p, dq.recipe, w2d.layout, act, limit, alpha,
                                              recompute, backend)  # fmt: skip
