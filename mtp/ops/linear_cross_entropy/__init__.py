"""Fused linear + vocab-parallel cross-entropy that never materialises the full logits.

``linear_cross_entropy(hidden, weight, target, group=...)`` equals
``F.cross_entropy(F.linear(hidden, full_weight, full_bias).float(), target, ...)`` where
``full_weight`` is the concatenation of every tensor-parallel rank's vocab shard, but it only
ever holds the logits of one chunk of rows at a time (``[chunk, V/tp]``), never ``[N, V/tp]``.

Algorithm (per call, ``tp`` = size of ``group``), token chunk by token chunk:

* the logits shard of the chunk (one cuBLAS GEMM into a chunk buffer reused by every chunk);
* the loss maths: at tp = 1 one Triton launch reads each row once for its statistics and
  writes the row's loss; at tp > 1 a launch reduces each row to ``(max, sum exp(x - max),
  smoothed target term)``, the ranks exchange these 12 bytes per row in one ``all_gather``
  and a second launch writes the loss. With sequence parallelism the chunk's hidden rows are
  all-gathered first.
* **With a reduced loss** (``reduction="mean"`` or ``"sum"``: the upstream gradient is one
  scalar) that needs gradients, the same launch also overwrites the chunk's logits with the
  gradient of its rows' loss, and the chunk's two gradient GEMMs follow at once:
  ``d_hidden`` rows ``= g @ W`` and ``d_weight (+)= g^T h`` (fp32 results; the first chunk
  writes ``d_weight``, the others add to it). ``d_hidden`` is summed over the group once, at
  the end of the forward. The backward only scales the saved fp32 gradients by the upstream
  gradient (``1 / valid rows`` for the mean) into the parameters' dtypes: **3 GEMMs in all**,
  the logits never recomputed.
* **With** ``reduction="none"`` the upstream gradient differs per row, which ``d_weight`` cannot
  absorb after the fact: the forward keeps ``(max, sum)`` per row (8 bytes) and the backward
  recomputes each chunk's logits (4 GEMMs in all), as the unfused pair would need its logits.
* Without gradients (``torch.no_grad``, or no input requiring one) only the loss is computed
  (1 GEMM).

Memory beyond the inputs and the loss: the chunk buffer (``chunk x V/tp`` in the input dtype;
the default chunk keeps it at most 1/8 of the logits) and ``O(rows)`` statistics; with
gradients of a reduced loss also the fp32 ``d_weight`` ``[V/tp, H]`` and ``d_hidden``
``[N, H]`` (they are the backward's result, computed early), and nothing else saved for the
backward. No host synchronisation (the chunking is fixed by the shapes; the target check is a
status word the kernels write, read by one device-side assert), deterministic (no atomics on
floats).

Backends (the GEMMs are cuBLAS / CPU ``torch.mm`` / ``addmm`` in all):

* ``"triton"`` (default on CUDA for fp32 / fp16 / bf16): the loss maths are Triton kernels
  (:mod:`mtp.kernels.linear_cross_entropy`). On CPU they run under the Triton interpreter
  (``TRITON_INTERPRET=1``).
* ``"fused"`` (opt-in): as ``"triton"``, except that a forward without gradients computes each
  chunk's statistics in a Triton GEMM whose epilogue folds the logits into them
  (:mod:`mtp.kernels.linear_cross_entropy_gemm`): no logits are written at all.
* ``"torch"``, also named ``"reference"`` as in every op (default on CPU and for fp64): the same
  maths as fp32 PyTorch ops, several passes over each chunk.

The custom ops ``mtp::linear_cross_entropy`` (the chunked forward) and
``mtp::linear_cross_entropy_backward`` (the recomputing backward) are what ``torch.compile``
and tracers see; an eager call runs their bodies (:mod:`.bodies`) directly. The argument checks
and the backend choice are in :mod:`.checks`, the call's setup, chunks and collectives in
:mod:`.call`, the PyTorch maths and the GEMMs in :mod:`.maths`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from mtp.ops._eager import CheckedKeys, autograd_apply, eager, needs_grad
from mtp.ops.linear_cross_entropy import bodies
from mtp.ops.linear_cross_entropy.bodies import NEED_BIAS, NEED_HIDDEN, NEED_WEIGHT
from mtp.ops.linear_cross_entropy.checks import (
    BACKENDS,
    REDUCTIONS,
    check_args,
    resolve_backend,
)
from mtp.ops.linear_cross_entropy.maths import accumulation_dtype, scaled
from mtp.parallel.groups import group_name
from mtp.utils import validation_mode

__all__ = ["linear_cross_entropy", "default_chunk_size", "REDUCTIONS", "BACKENDS"]

#: The default chunk's logits are at most 1/``CHUNK_FRACTION`` of the logits ...
CHUNK_FRACTION = 8
#: ... at least this many rows (the fp32 ``d_weight`` GEMM-add reads and writes ``V x H x 8``
#: bytes per chunk for ``2 x chunk x V x H`` FLOPs: ``chunk / 4`` FLOP per byte, against a
#: balance of ~170-300 on H100 / H200) ...
MIN_CHUNK_ROWS = 1024
#: ... and at most this many bytes of logits (in the input dtype), whatever the row count.
MAX_CHUNK_BYTES = 1 << 30


def default_chunk_size(rows: int, vocab_local: int, itemsize: int = 2) -> int:
    """Rows per chunk when ``chunk_size=None``: ``rows / 8`` rounded down to a multiple of 128
    (the chunk's logits at most 1/8 of the logits), at least 1024 rows, at most 1 GiB of logits
    of ``itemsize`` bytes and at most ``rows``; a function of the shapes only (graph-safe)."""
    chunk = max(MIN_CHUNK_ROWS, rows // CHUNK_FRACTION // 128 * 128)
    chunk = min(chunk, max(128, MAX_CHUNK_BYTES // max(1, vocab_local * itemsize) // 128 * 128))
    return max(1, min(rows, chunk))


# --------------------------------------------------------------------------------------------
# Custom ops (what torch.compile and tracers see)
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("mtp::linear_cross_entropy", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    chunk_size: int,
    group_name: str,
    world_size: int,
    sequence_parallel: bool,
    validate: str,
    backend: str,
    need: int,
    keep_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = bodies.forward(
        hidden, weight, bias, target, label_smoothing, ignore_index, z_loss_weight, chunk_size,
        group_name, world_size, sequence_parallel, validate, backend, need, keep_stats,
    )  # fmt: skip
    return tuple(hidden.new_empty(0) if t is None else t for t in outs)


def _grad_shapes(hidden, weight, need: int):
    h = hidden.shape[-1]
    rows = hidden.numel() // h if h else 0
    return ((rows, h) if need & NEED_HIDDEN else (0,), weight.shape if need & NEED_WEIGHT else (0,),
            (weight.shape[0],) if need & NEED_BIAS else (0,))  # fmt: skip


@_forward_op.register_fake
def _(hidden, weight, bias, target, eps, ii, z, chunk, group, world, sp, validate, backend,
      need, keep_stats):  # fmt: skip
    acc = accumulation_dtype(hidden.dtype)
    rows = target.numel()
    grads = [hidden.new_empty(s, dtype=acc) for s in _grad_shapes(hidden, weight, need)]
    return (hidden.new_empty((rows,), dtype=acc),
            hidden.new_empty((rows, 2) if keep_stats else (0,), dtype=acc),
            hidden.new_empty((2 if world > 1 else 0,), dtype=torch.int64), *grads)  # fmt: skip


@torch.library.custom_op("mtp::linear_cross_entropy_backward", mutates_args=())
def _backward_op(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    rowstat: torch.Tensor,
    vinfo: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss_weight: float,
    chunk_size: int,
    group_name: str,
    world_size: int,
    sequence_parallel: bool,
    backend: str,
    need: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = bodies.backward(
        dloss, hidden, weight, bias, target, rowstat, vinfo, label_smoothing, ignore_index,
        z_loss_weight, chunk_size, group_name, world_size, sequence_parallel, backend, need,
    )  # fmt: skip
    return tuple(hidden.new_empty(0) if t is None else t for t in outs)


@_backward_op.register_fake
def _(dloss, hidden, weight, bias, target, rowstat, vinfo, *args):
    acc = accumulation_dtype(hidden.dtype)
    return tuple(hidden.new_empty(s, dtype=acc) for s in _grad_shapes(hidden, weight, args[-1]))


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


def _need(needs_input_grad) -> int:
    h, w, b = needs_input_grad[:3]
    return (NEED_HIDDEN if h else 0) | (NEED_WEIGHT if w else 0) | (NEED_BIAS if b else 0)


class _Reduced(torch.autograd.Function):
    """``reduction="mean"`` / ``"sum"`` with gradients: the forward computes them (of the summed
    loss), the backward scales them by the upstream gradient (and ``1 / valid rows``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, args, mean, direct):
        run = bodies.forward if direct else _forward_op
        need = _need(ctx.needs_input_grad)
        loss, _, _, dh, dw, db = run(hidden, weight, bias, target, *args, need, False)
        loss = loss.sum()
        inv = None
        if mean:
            valid = (target != args[1]).sum()
            loss = loss / valid
            inv = valid.clamp_min(1).reciprocal()  # all rows ignored: NaN loss, zero gradients
        ctx.save_for_backward(dh, dw, db, inv)
        ctx.hidden_shape, ctx.dtype = hidden.shape, hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dh, dw, db, inv = ctx.saved_tensors
        scale = dloss if inv is None else dloss * inv
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = (
            scaled(dh, scale, ctx.dtype).view(ctx.hidden_shape) if need_h else None,
            scaled(dw, scale, ctx.dtype) if need_w else None,
            scaled(db, scale, ctx.dtype) if need_b else None,
        )  # fmt: skip
        if ctx.dtype != dh.dtype and not torch.compiler.is_compiling() and type(dh) is torch.Tensor:
            # fp32 accumulators are scaled in place (their version bumped); the others are
            # marked so too: a second backward through the graph fails autograd's check alike
            for t, need in zip((dh, dw, db), (need_h, need_w, need_b)):
                if need:
                    increment_version(t)
        return (*grads, None, None, None, None)


class _Recompute(torch.autograd.Function):
    """``reduction="none"``: the forward keeps ``(max, sum)`` per row, the backward recomputes
    each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, args, direct):
        run = bodies.forward if direct else _forward_op
        loss, rowstat, vinfo, *_ = run(hidden, weight, bias, target, *args, 0, True)
        ctx.save_for_backward(hidden, weight, bias, target, rowstat, vinfo)
        ctx.args = args
        return loss

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, bias, target, rowstat, vinfo = ctx.saved_tensors
        need = _need(ctx.needs_input_grad)
        eps, ii, z, chunk, gname, world, sp, _validate, backend = ctx.args
        if eager(dloss, hidden):
            dh, dw, db = bodies.backward(dloss, hidden, weight, bias, target, rowstat, vinfo, eps,
                                         ii, z, chunk, gname, world, sp, backend, need)
        else:
            dh, dw, db = _backward_op(dloss, hidden, weight, bias, target, rowstat, vinfo, eps,
                                      ii, z, chunk, gname, world, sp, backend, need)
        return (
            dh.to(hidden.dtype).view(hidden.shape) if need & NEED_HIDDEN else None,
            dw.to(weight.dtype) if need & NEED_WEIGHT else None,
            db.to(bias.dtype) if need & NEED_BIAS else None,
            None, None, None,
        )  # fmt: skip


_REDUCED = autograd_apply(_Reduced)
_RECOMPUTE = autograd_apply(_Recompute)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

_CHECKED = CheckedKeys()


def _group_info(group) -> tuple[str, int]:
    """``(group name, world size)``: ``("", 1)`` without a group or for a group of one."""
    if group is None:
        return "", 1
    world = dist.get_world_size(group)
    return (group_name(group), world) if world > 1 else ("", 1)


def _reduce(loss: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int):
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    return loss.view(target.shape)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    bias: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    sequence_parallel: bool = False,
    validate: bool | str = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight^T (+ bias)`` over a vocab split across ``group``,
    without materialising the logits.

    Equal to ``F.cross_entropy((hidden @ W^T + b).float(), target, label_smoothing=...,
    ignore_index=..., reduction=...) + z_loss_weight * lse**2`` (per row), where ``W`` / ``b``
    are every rank's ``weight`` / ``bias`` stacked in rank order (the logits are rounded to
    ``hidden.dtype`` first, as the unfused ``linear`` + loss pair does).

    Args:
        hidden: ``[..., H]`` fp32 / fp16 / bf16 (or fp64), identical on every rank of ``group``; with
            ``sequence_parallel`` this rank's chunk ``[n, ..., H]`` of the sequence (dim 0).
        weight: ``[V_r, H]`` this rank's vocab shard (same dtype as ``hidden``); rank ``r``
            holds ids ``[sum_{q<r} V_q, sum_{q<=r} V_q)``. Shards may be uneven.
        target: int64 / int32 global ids ``hidden.shape[:-1]`` (sequence parallel:
            ``[n * tp, ...]``, the whole sequence, in rank order), or ``ignore_index``.
        group: the tensor-parallel group the vocab is split over (None: no split).
        bias: optional ``[V_r]`` shard of the output bias.
        label_smoothing: in ``[0, 1]``, spread over the global vocab as in ``F.cross_entropy``.
        ignore_index: rows with this target get loss 0 and no gradient.
        z_loss_weight: adds ``z_loss_weight * lse**2`` per row (PaLM's z-loss).
        reduction: ``"mean"`` (the default, as ``F.cross_entropy``'s; over non-ignored rows;
            NaN when all are ignored, as PyTorch), ``"sum"`` or ``"none"`` (per-row fp32 loss
            of ``target``'s shape; :func:`mtp.ops.vocab_parallel_cross_entropy`'s default).
            With ``"mean"`` / ``"sum"`` the gradients are computed in the forward (the
            backward only scales them); ``"none"`` recomputes the logits in the backward.
        chunk_size: rows whose logits are live at once (sequence parallel: gathered rows);
            default :func:`default_chunk_size` (at most 1/8 of the logits at 8k+ rows).
        sequence_parallel: ``hidden`` is sequence-sharded; its rows are all-gathered chunk by
            chunk and ``d_hidden`` is reduce-scattered.
        validate: data checks (targets in range, ranks agree) on the device by default;
            ``"sync"`` raises typed errors after a host sync (``TargetOutOfRangeError`` naming
            the vocab size and a bad id, ``RankMismatchError``); False skips them.
        backend: ``"auto"`` (``"triton"`` on CUDA for fp32 / fp16 / bf16, else ``"torch"``;
            ``MTP_BACKEND`` overrides), ``"triton"`` (Triton loss kernels per chunk; CPU needs
            ``TRITON_INTERPRET=1``), ``"fused"`` (as ``"triton"``, but a forward without
            gradients takes the statistics from a Triton GEMM's epilogue: no logits are
            written; opt-in until GPU timings exist) or ``"reference"`` / ``"torch"`` (the same
            backend: fp32 PyTorch maths per chunk, fp64 for fp64 inputs).

    Returns:
        fp32 loss: a scalar, or ``target``'s shape for ``reduction="none"``; identical on every
        rank. Gradients flow to ``hidden`` (``hidden.dtype``, summed over the group), ``weight``
        and ``bias`` (this rank's shard, accumulated in fp32 over the chunks).

    Communication per call: one all-gather of 6 int64 (agreement metadata), per chunk one
    all-gather of ``12 * rows`` bytes forward (plus the chunk's hidden rows with sequence
    parallel), one all-reduce (reduce-scatter) of ``d_hidden``: at the end of the forward for a
    reduced loss, in the backward (which gathers the hidden rows again) for ``"none"``.
    """
    direct = eager(hidden, weight, target, bias)
    key = (hidden.shape, hidden.dtype, hidden.device, weight.shape, weight.dtype,
           None if bias is None else (bias.shape, bias.dtype), target.shape, target.dtype,
           target.device, group, sequence_parallel, label_smoothing, ignore_index,
           z_loss_weight, reduction, chunk_size) if direct else None  # fmt: skip
    if key is None or key not in _CHECKED:
        check_args(
            hidden, weight, target, bias, group, sequence_parallel, label_smoothing,
            ignore_index, z_loss_weight, reduction, chunk_size,
        )  # fmt: skip
        if key is not None:
            _CHECKED.add(key)
    gname, world = _group_info(group)
    args = (
        float(label_smoothing), int(ignore_index), float(z_loss_weight),
        chunk_size or default_chunk_size(target.numel(), weight.shape[0], hidden.itemsize),
        gname, world, sequence_parallel and world > 1, validation_mode(validate),
        resolve_backend(backend, hidden),
    )  # fmt: skip
    if needs_grad(hidden, weight, bias):
        if reduction == "none":
            apply = _RECOMPUTE if direct else _Recompute.apply
            return apply(hidden, weight, bias, target, args, direct).view(target.shape)
        apply = _REDUCED if direct else _Reduced.apply
        return apply(hidden, weight, bias, target, args, reduction == "mean", direct)
    run = bodies.forward if direct else _forward_op
    return _reduce(run(hidden, weight, bias, target, *args, 0, False)[0], target, reduction,
                   int(ignore_index))  # fmt: skip
