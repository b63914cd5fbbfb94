"""The chunked bodies of :func:`mtp.ops.linear_cross_entropy`: what its custom ops run, and what
the eager path calls directly.

:func:`forward`, per chunk of rows: the logits GEMM into one chunk buffer (cuBLAS), the loss
maths (one Triton launch at tp = 1; statistics, their all-gather and a finishing launch at
tp > 1) and, when gradients are asked for (``need``), the gradient of the rows' loss written
over the chunk's logits, then ``d_hidden`` rows ``= g @ W`` and ``d_weight (+)= g^T h`` (fp32
results from the half-precision GEMMs) and ``d_bias += sum(g)``: the gradients of the summed
loss, for an upstream gradient of 1. ``d_hidden`` is summed over the group once at the end.

:func:`backward`, the backward of an unreduced loss (``reduction="none"``, an upstream gradient
per row): per chunk the logits GEMM again, the gradient from the forward's saved row statistics
``(m, s)`` scaled by the row's upstream gradient, and the same two gradient GEMMs.

Backends: ``"triton"`` (the kernels of :mod:`mtp.kernels.linear_cross_entropy`), ``"fused"``
(as ``"triton"``, but a forward without gradients takes the statistics from the Triton GEMM's
epilogue and writes no logits) and ``"torch"`` (the fp32 PyTorch maths of :mod:`.maths`).
"""

from __future__ import annotations

import torch

from mtp.kernels import linear_cross_entropy as lce_kernels
from mtp.kernels import linear_cross_entropy_gemm as lce_gemm
from mtp.ops.linear_cross_entropy.call import Call
from mtp.ops.linear_cross_entropy.checks import check_status, check_targets
from mtp.ops.linear_cross_entropy.maths import (
    add_weight_grad,
    chunk_grad,
    chunk_logits,
    chunk_stats,
    combine,
    mm_into,
)
from mtp.utils import data_checks_enabled

__all__ = ["NEED_BIAS", "NEED_HIDDEN", "NEED_WEIGHT", "backward", "forward"]

#: Bits of ``need``: the gradients to compute.
NEED_HIDDEN, NEED_WEIGHT, NEED_BIAS = 1, 2, 4


class _Triton:
    """The loss maths of a chunk in Triton kernels (backends ``"triton"`` and ``"fused"``)."""

    def __init__(self, c: Call, weight, bias, status):
        self.c, self.weight, self.bias, self.status = c, weight, bias, status
        self.wt = weight.t()

    def forward(self, buf, h, t, loss, rowstat, grad: bool):
        """Loss (and ``rowstat``) of the chunk; with ``grad`` its gradient, returned."""
        c = self.c
        common = dict(ignore_index=c.ii, eps=c.eps)
        if c.backend == "fused" and not grad:  # statistics from the GEMM: no logits written
            parts = lce_gemm.gemm_stats(h.contiguous(), self.weight, self.bias, t, c.vinfo,
                                        **common)  # fmt: skip
            lce_kernels.finish_rows(c.gather(parts), None, t, c.vinfo, loss, rowstat,
                                    self.status, v_local=c.v_local, z=c.z, grad=False, **common)
            return None
        x = chunk_logits(buf[: h.shape[0]], h, self.wt, self.bias)
        if c.world == 1:
            lce_kernels.forward_rows(x, t, loss, rowstat, self.status, z=c.z, grad=grad, **common)
        else:
            stats = torch.empty((h.shape[0], 3), dtype=torch.float32, device=x.device)
            lce_kernels.chunk_stats(x, t, c.vinfo, stats, **common)
            lce_kernels.finish_rows(c.gather(stats), x, t, c.vinfo, loss, rowstat, self.status,
                                    v_local=c.v_local, z=c.z, grad=grad, **common)  # fmt: skip
        return x if grad else None

    def backward(self, buf, h, t, rowstat, dloss):
        """The chunk's gradient from its saved ``rowstat``, scaled by ``dloss`` per row."""
        c = self.c
        x = chunk_logits(buf[: h.shape[0]], h, self.wt, self.bias)
        lce_kernels.chunk_grad_(x, t, c.vinfo, rowstat, dloss, ignore_index=c.ii, eps=c.eps,
                                z=c.z)  # fmt: skip
        return x


class _Torch:
    """The loss maths of a chunk in fp32 PyTorch ops (backend ``"torch"``)."""

    def __init__(self, c: Call, weight, bias, status):
        self.c, self.bias, self.wt = c, bias, weight.t()
        self.start = 0 if c.vinfo is None else c.vinfo[0]
        vocab = c.v_local if c.vinfo is None else c.vinfo[1].to(c.acc)
        self.coef_target, self.coef_uniform = 1.0 - c.eps, c.eps / vocab

    def _targets(self, t):
        valid = t != self.c.ii
        local = t.long() - self.start
        owns = valid & (local >= 0) & (local < self.c.v_local)
        return local.clamp(0, self.c.v_local - 1), owns, valid

    def forward(self, buf, h, t, loss, rowstat, grad: bool):
        c = self.c
        x = chunk_logits(buf[: h.shape[0]], h, self.wt, self.bias)
        local_t, owns, valid = self._targets(t)
        stats = chunk_stats(x, local_t, owns, self.coef_target, self.coef_uniform)
        rows_loss, rs = combine(c.gather(stats), valid, c.z)
        loss.copy_(rows_loss)
        if rowstat is not None:
            rowstat.copy_(rs)
        if not grad:
            return None
        g = chunk_grad(x, rs, local_t, owns, valid.to(c.acc), self.coef_target,
                       self.coef_uniform, c.z)  # fmt: skip
        return g.to(c.dtype)

    def backward(self, buf, h, t, rowstat, dloss):
        c = self.c
        x = chunk_logits(buf[: h.shape[0]], h, self.wt, self.bias)
        local_t, owns, valid = self._targets(t)
        scale = torch.where(valid, dloss.to(c.acc), torch.zeros((), dtype=c.acc, device=x.device))
        g = chunk_grad(x, rowstat, local_t, owns, scale, self.coef_target, self.coef_uniform, c.z)
        return g.to(c.dtype)


def _maths(c: Call, weight, bias, status):
    return (_Torch if c.backend == "torch" else _Triton)(c, weight, bias, status)


class _Grads:
    """The gradient accumulators of one call (fp32, or fp64 for fp64 inputs)."""

    def __init__(self, c: Call, weight, need: int):
        acc, dev = c.acc, weight.device
        self.weight = weight
        self.dh = c.empty((c.rows, c.hidden_size)) if need & NEED_HIDDEN else None
        # written by the first chunk's GEMM (no fill, no read of C), zeroed if there is none
        self.dw = torch.empty(weight.shape, dtype=acc, device=dev) if need & NEED_WEIGHT else None
        self.db = torch.zeros(weight.shape[0], dtype=acc, device=dev) if need & NEED_BIAS else None
        self.first = True

    def add(self, g, h, dh_rows) -> None:
        """One chunk: ``d_hidden`` rows ``= g @ W``, ``d_weight (+)= g^T h``,
        ``d_bias += sum g``."""
        if dh_rows is not None:
            mm_into(dh_rows, g, self.weight)
        if self.dw is not None:
            if self.first:
                mm_into(self.dw, g.t(), h)
            else:
                add_weight_grad(self.dw, g, h)
        if self.db is not None:
            self.db += g.sum(0, dtype=self.db.dtype)
        self.first = False

    def finish(self, c: Call):
        if self.first and self.dw is not None:
            self.dw.zero_()
        dh = None if self.dh is None else c.reduce_hidden_grad(self.dh)
        return dh, self.dw, self.db


def _buffer(c: Call, weight, grad: bool) -> torch.Tensor | None:
    """The chunk buffer: one chunk's logits in the input dtype (none for the fused GEMM)."""
    if c.backend == "fused" and not grad:
        return None
    return torch.empty((c.chunk_rows(), c.v_local), dtype=c.dtype, device=weight.device)


def forward(hidden, weight, bias, target, eps: float, ii: int, z: float, chunk: int,
            group_name: str, world: int, sp: bool, validate: str, backend: str, need: int,
            keep_stats: bool):  # fmt: skip
    """``(loss [rows], rowstat [rows, 2] | None, vinfo | None, d_hidden | None,
    d_weight | None, d_bias | None)``: the per-row loss (fp32; fp64 for fp64 inputs), the row
    statistics ``(m, s)`` when ``keep_stats``, the shard's ``(first id, global vocab)`` at
    tp > 1 and the gradients ``need`` asks for (of the summed loss, unscaled; fp32)."""
    c = Call(hidden, weight, target, eps, ii, z, chunk, group_name, world, sp, validate, backend)
    check = validate != "off" and data_checks_enabled(validate, c.t)
    status = None
    if check and backend != "torch":
        status = torch.zeros((), dtype=torch.int32, device=c.t.device)
    elif check:
        check_targets(c.t, c.v_local if world == 1 else c.vinfo[1], ii, validate,
                      c.v_local if world == 1 else None)  # fmt: skip
    loss = c.empty((c.rows,))
    rowstat = c.empty((c.rows, 2)) if keep_stats else None
    grads = _Grads(c, weight, need) if need else None
    maths = _maths(c, weight, bias, status)
    buf = _buffer(c, weight, bool(need))
    dh = None if grads is None else grads.dh
    for h, t, (loss_c, stats_c, dh_c), _ in c.chunks(outs=(loss, rowstat, dh)):
        g = maths.forward(buf, h, t, loss_c, stats_c, grad=grads is not None)
        if grads is not None:
            grads.add(g, h, dh_c)
    if status is not None:
        check_status(status, c.t, c.v_local if world == 1 else c.vinfo[1], ii, validate,
                     c.v_local if world == 1 else None)  # fmt: skip
    dh, dw, db = (None, None, None) if grads is None else grads.finish(c)
    return loss, rowstat, c.vinfo, dh, dw, db


def backward(dloss, hidden, weight, bias, target, rowstat, vinfo, eps: float, ii: int, z: float,
             chunk: int, group_name: str, world: int, sp: bool, backend: str, need: int):
    """``(d_hidden | None, d_weight | None, d_bias | None)`` (fp32) of ``sum(dloss * loss)``,
    recomputing each chunk's logits (``dloss``: ``[rows]``, any stride)."""
    c = Call(hidden, weight, target, eps, ii, z, chunk, group_name, world, sp, False, backend,
             vinfo=vinfo)  # fmt: skip
    grads = _Grads(c, weight, need)
    maths = _maths(c, weight, bias, None)
    buf = _buffer(c, weight, True)
    for h, t, (dh_c,), (stats_c, dloss_c) in c.chunks(outs=(grads.dh,),
                                                    ins=(rowstat, dloss.reshape(-1))):
        grads.add(maths.backward(buf, h, t, stats_c, dloss_c), h, dh_c)
    return grads.finish(c)
