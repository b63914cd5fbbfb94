"""Fused linear + vocab-parallel cross-entropy that never materialises the full logits.

``linear_cross_entropy(hidden, weight, target, group=...)`` equals
``F.cross_entropy(F.linear(hidden, full_weight, full_bias).float(), target, ...)`` where
``full_weight`` is the concatenation of every tensor-parallel rank's vocab shard, but it only
ever holds the logits of ``chunk_size`` tokens at a time (``[chunk, V/tp]``), never ``[N, V/tp]``.

Algorithm (per call, ``tp`` = size of ``group``):

* **Forward**, token chunk by token chunk: the logits shard of the chunk (one GEMM), reduced at
  once to three fp32 values per row (max, sum of ``exp(x - max)``, the smoothed target term),
  which the ranks exchange in one small ``all_gather`` (``12 * rows`` bytes per rank per chunk);
  the per-row loss and ``(max, log-sum)`` (8 bytes per row, saved for the backward) follow. With
  ``sequence_parallel`` each rank holds ``[N/tp, H]`` hidden rows and the chunk's rows are
  all-gathered first. One extra all-gather of a few integers per call carries every rank's
  vocab shard size (uneven shards are supported), row count and a checksum of the targets, so
  ranks that disagree fail with :class:`~mtp.parallel.errors.RankMismatchError`-style messages
  instead of hanging.
* **Backward**: the logits of each chunk are recomputed (one GEMM), turned into
  ``dloss * (softmax * (1 + 2 z lse) - (1 - eps) onehot - eps / V)`` and multiplied out:
  ``d_hidden`` rows (fp32, written once per row) and ``d_weight += g^T h`` (fp32 accumulation,
  ``torch.addmm(..., out_dtype=float32)`` on CUDA). ``d_hidden`` is then summed over the group
  once per call (all-reduce, or reduce-scatter with ``sequence_parallel``).

Peak extra memory: ``O(chunk_size * V/tp)`` for the logits and their fp32 temporaries, plus the
fp32 ``d_hidden`` ``[N, H]`` and ``d_weight`` ``[V/tp, H]`` accumulators of the backward; it
does not grow with ``N`` beyond those gradient-sized buffers. No host synchronisation (the
chunking is fixed by the shapes; checks run on the device), deterministic (no atomics).

Backends (the GEMMs are cuBLAS / CPU ``torch.mm`` / ``addmm`` in both):

* ``"triton"`` (default on CUDA for fp32 / fp16 / bf16): the per-chunk loss maths are two
  Triton kernels (:mod:`mtp.kernels.linear_cross_entropy`): the forward reads the chunk's
  logits once for the row statistics, the backward reads them once and overwrites them with the
  gradient (in the input dtype, the operand of the two backward GEMMs). On CPU it runs under
  the Triton interpreter (``TRITON_INTERPRET=1``).
* ``"fused"`` (opt-in): as ``"triton"``, except that the forward computes each chunk's logits
  in a Triton GEMM whose epilogue folds them into the row statistics
  (:mod:`mtp.kernels.linear_cross_entropy_gemm`): the forward writes no logits at all.
* ``"torch"``, also named ``"reference"`` as in every op (default on CPU and for fp64): the same
  maths as fp32 PyTorch ops, several passes over each chunk.

``MTP_BACKEND=triton`` / ``fused`` / ``torch`` (``reference`` is an alias of ``torch``) steers
``"auto"``.

The argument checks and the backend choice are in :mod:`mtp.ops.linear_cross_entropy.checks`,
the per-chunk PyTorch maths (the ``"torch"`` backend's, and the GEMMs every backend runs) in
:mod:`mtp.ops.linear_cross_entropy.maths`; this module holds the chunking, the collectives and
the autograd function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.kernels import linear_cross_entropy as lce_kernels
from mtp.kernels import linear_cross_entropy_gemm as lce_gemm
from mtp.ops.linear_cross_entropy.checks import (
    BACKENDS,
    REDUCTIONS,
    TRITON_BACKENDS,
    check_args,
    check_targets,
    resolve_backend,
)
from mtp.ops.linear_cross_entropy.maths import (
    accumulation_dtype,
    add_weight_grad,
    chunk_grad,
    chunk_logits,
    chunk_stats,
    combine,
    merge_stats,
    mm_fp32,
)
from mtp.parallel.agree import agreement
from mtp.utils import check_values

__all__ = ["linear_cross_entropy", "default_chunk_size", "REDUCTIONS", "BACKENDS"]

_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk in the default chunk size


def default_chunk_size(rows: int, vocab_local: int) -> int:
    """Rows per chunk when ``chunk_size=None``: a power of two with fp32 chunk logits of at most
    1 GiB (at least 64 rows, at most ``rows``); a function of the shapes only (graph-safe)."""
    budget = max(64, _CHUNK_BYTES // (4 * max(vocab_local, 1)))
    chunk = 1 << (budget.bit_length() - 1)
    return max(1, min(rows, chunk))


# --------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------


def _all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[world, *t.shape]`` (every rank takes part, with zero rows too); ``t`` at least 1-D."""
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out.view(world, *t.shape)


def _reduce_scatter(out: torch.Tensor, t: torch.Tensor, group) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, t, group=group)


def _exchange_meta(spec, meta: torch.Tensor, group, world: int, validate) -> torch.Tensor:
    """All-gather this rank's agreement row ``meta`` (``spec``'s fields: vocab shard size, row
    count, hidden size, dtype, target checksum, chunk size) and check that every rank agrees on
    everything but the vocab shard size; returns the gathered ``[world, 6]``."""
    gathered = _all_gather(meta, group, world)
    spec.check_device(
        gathered, group, validate=validate, skip=("vocab shard size",), tensors=(meta,),
        hint="every tensor-parallel rank must pass the same target and the same number of "
        "rows; with uneven vocab shards pass chunk_size explicitly",
    )  # fmt: skip
    check_values(
        (gathered[:, 0] > 0).all(),
        "linear_cross_entropy: weight has 0 rows (an empty vocab shard) on some rank",
        validate=validate,
        tensors=(meta,),
    )
    return gathered


def _target_checksum(target: torch.Tensor) -> torch.Tensor:
    t = target.reshape(-1).long()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64) % 1000003
    return ((t % 1000003) * weights).sum() % 1000000007


# --------------------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------------------


class _Setup:
    """Everything about one call that is not a tensor to differentiate."""

    def __init__(self, hidden, weight, target, group, eps, ignore_index, z, chunk, sp, validate,
                 backend):
        self.group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.eps, self.ignore_index, self.z, self.sp = eps, ignore_index, z, sp and self.world > 1
        self.hidden_size = hidden.shape[-1]
        self.local_rows = hidden.numel() // max(self.hidden_size, 1)
        self.rows = target.numel()
        self.v_local = weight.shape[0]
        self.chunk = chunk
        t = target.reshape(-1).long()
        self.valid = t != ignore_index
        if self.world > 1:
            spec = agreement("linear_cross_entropy", {
                "vocab shard size": self.v_local, "row count": self.rows,
                "hidden size": self.hidden_size, "dtype": hidden.dtype, "target checksum": 0,
                "chunk_size": chunk,
            })  # fmt: skip
            # fills, no host-to-device copy; the checksum is copied in on the device
            meta = spec.tensor(t.device, fill=True, values={"target checksum": _target_checksum(t)})
            sizes = _exchange_meta(spec, meta, group, self.world, validate)[:, 0]
            start = sizes[: self.rank].sum()
            vocab = sizes.sum()
        else:
            start = torch.zeros((), dtype=torch.int64, device=t.device)
            vocab = torch.full((), self.v_local, dtype=torch.int64, device=t.device)
        check_targets(t, self.valid, vocab, ignore_index, validate,
                      self.v_local if self.world == 1 else None)  # fmt: skip
        local = t - start
        self.owns = (local >= 0) & (local < self.v_local)
        self.local_t = local.clamp(0, self.v_local - 1)
        self.coef_target = 1.0 - eps
        self.coef_uniform = eps / vocab.to(accumulation_dtype(hidden.dtype))
        # the kernels' view: local id or -1, coefficients on the device
        if backend in TRITON_BACKENDS:
            self.local_k = torch.where(self.owns, local, torch.full_like(local, -1))
            self.coefs = torch.stack(
                [torch.ones_like(self.coef_uniform) * self.coef_target, self.coef_uniform]
            ).float()
        self.backend = backend

    def forward_stats(self, h: torch.Tensor, weight, bias, rows) -> torch.Tensor:
        """:meth:`stats` of the chunk ``h @ weight^T (+ bias)``; ``"fused"``: in the GEMM."""
        if self.backend == "fused":
            return merge_stats(lce_gemm.gemm_stats(h, weight, bias, self.local_k[rows],
                                                   self.coefs, self.eps > 0.0))  # fmt: skip
        return self.stats(chunk_logits(h, weight, bias), rows)

    def stats(self, x: torch.Tensor, rows) -> torch.Tensor:
        """``[rows, 3]`` ``(max, sum exp(x - max), target term)`` of a chunk's logits ``x``."""
        if self.backend in TRITON_BACKENDS:
            return lce_kernels.chunk_stats(x, self.local_k[rows], self.coefs, self.eps > 0.0)
        return chunk_stats(x, self.local_t[rows], self.owns[rows], self.coef_target,
                           self.coef_uniform)  # fmt: skip

    def grad(self, x: torch.Tensor, rows, rowstat: torch.Tensor, dloss: torch.Tensor):
        """``dloss * d loss / d x`` of a chunk (Triton: written over ``x``, in its dtype)."""
        if self.backend in TRITON_BACKENDS:
            scale = torch.where(self.valid[rows], dloss.float(), torch.zeros_like(rowstat[:, 0]))
            return lce_kernels.chunk_grad_(x, self.local_k[rows], self.coefs, rowstat, scale,
                                           self.z)  # fmt: skip
        return chunk_grad(
            x, rowstat, self.local_t[rows], self.owns[rows], dloss, self.valid[rows],
            self.coef_target, self.coef_uniform, self.z,
        )  # fmt: skip

    def chunks(self):
        """``(local_slice, global_index)`` per chunk: the local hidden rows it reads and the
        global rows (of ``target``) whose loss it computes."""
        if not self.sp:
            for a in range(0, self.rows, self.chunk):
                b = min(a + self.chunk, self.rows)
                yield slice(a, b), slice(a, b)
            return
        step = max(1, self.chunk // self.world)
        for a in range(0, self.local_rows, step):
            b = min(a + step, self.local_rows)
            idx = torch.arange(a, b, device=self.valid.device)
            rows = (torch.arange(self.world, device=idx.device)[:, None] * self.local_rows + idx)
            yield slice(a, b), rows.reshape(-1)

    def rows_of(self, h2d: torch.Tensor, local: slice) -> torch.Tensor:
        part = h2d[local]
        if not self.sp:
            return part
        return _all_gather(part, self.group, self.world).reshape(-1, part.shape[-1])


class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, setup: _Setup):
        h2d = hidden.reshape(-1, setup.hidden_size)
        acc = accumulation_dtype(hidden.dtype)
        loss = torch.empty(setup.rows, dtype=acc, device=hidden.device)
        rowstat = torch.empty((setup.rows, 2), dtype=acc, device=hidden.device)
        for local, rows in setup.chunks():
            stats = setup.forward_stats(setup.rows_of(h2d, local), weight, bias, rows)
            if setup.world > 1:
                gathered = _all_gather(stats, setup.group, setup.world)
            else:
                gathered = stats[None]
            loss[rows], rowstat[rows] = combine(gathered, setup.valid[rows], setup.z)
        ctx.setup = setup
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias, rowstat)
        ctx.mark_non_differentiable(rowstat)
        return loss, rowstat

    @staticmethod
    def backward(ctx, dloss, _drowstat):
        hidden, weight, bias, rowstat = ctx.saved_tensors
        s: _Setup = ctx.setup
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        h2d = hidden.reshape(-1, s.hidden_size)
        acc = accumulation_dtype(hidden.dtype)
        dh = torch.empty((s.rows, s.hidden_size), dtype=acc, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
        dloss = dloss.reshape(-1)
        for local, rows in s.chunks():
            hc = s.rows_of(h2d, local)
            g = s.grad(chunk_logits(hc, weight, bias), rows, rowstat[rows], dloss[rows])
            if need_b:
                db += g.sum(0, dtype=acc)
            g = g.to(weight.dtype)
            if need_h:
                dh[rows] = mm_fp32(g, weight)
            if need_w:
                add_weight_grad(dw, g, hc)
        grad_hidden = _reduce_hidden_grad(dh, s) if need_h else None
        grad_hidden = None if grad_hidden is None else grad_hidden.to(hidden.dtype).view(hidden.shape)
        grad_weight = None if dw is None else dw.to(weight.dtype)
        grad_bias = db.to(bias.dtype) if (need_b and bias is not None) else None
        return grad_hidden, grad_weight, grad_bias, None


def _reduce_hidden_grad(dh: torch.Tensor, s: _Setup) -> torch.Tensor:
    """Sum the ranks' partial ``d_hidden`` (one collective per call)."""
    if s.world == 1:
        return dh
    if not s.sp:
        dist.all_reduce(dh, group=s.group)
        return dh
    out = torch.empty((s.local_rows, s.hidden_size), dtype=dh.dtype, device=dh.device)
    _reduce_scatter(out, dh, s.group)
    return out


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


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
        chunk_size: rows whose logits are live at once (sequence parallel: gathered rows);
            default :func:`default_chunk_size`.
        sequence_parallel: ``hidden`` is sequence-sharded; its rows are all-gathered chunk by
            chunk and ``d_hidden`` is reduce-scattered.
        validate: data checks (targets in range, ranks agree) on the device by default;
            ``"sync"`` raises typed errors after a host sync (``TargetOutOfRangeError`` naming
            the vocab size and a bad id, ``RankMismatchError``); False skips them.
        backend: ``"auto"`` (``"triton"`` on CUDA for fp32 / fp16 / bf16, else ``"torch"``;
            ``MTP_BACKEND`` overrides), ``"triton"`` (Triton loss kernels per chunk; CPU needs
            ``TRITON_INTERPRET=1``), ``"fused"`` (as ``"triton"``, but the forward's logits GEMM
            is a Triton kernel with the row statistics in its epilogue: no logits are written;
            opt-in until GPU timings exist) or ``"reference"`` / ``"torch"`` (the same backend:
            fp32 PyTorch maths per chunk, fp64 for fp64 inputs).

    Returns:
        fp32 loss: a scalar, or ``target``'s shape for ``reduction="none"``; identical on every
        rank. Gradients flow to ``hidden`` (``hidden.dtype``, summed over the group), ``weight``
        and ``bias`` (this rank's shard, accumulated in fp32 over the chunks).

    Communication per call: one all-gather of 6 int64 (agreement metadata), per chunk one
    all-gather of ``12 * rows`` bytes forward (plus the chunk's hidden rows with sequence
    parallel, forward and backward), one all-reduce (reduce-scatter) of ``d_hidden`` backward.
    """
    check_args(
        hidden, weight, target, bias, group, sequence_parallel, label_smoothing, ignore_index,
        z_loss_weight, reduction, chunk_size,
    )  # fmt: skip
    world = 1 if group is None else dist.get_world_size(group)
    rows = target.numel()
    chunk = chunk_size or default_chunk_size(rows, weight.shape[0])
    setup = _Setup(
        hidden, weight, target, group, float(label_smoothing), int(ignore_index),
        float(z_loss_weight), chunk, sequence_parallel and world > 1, validate,
        resolve_backend(backend, hidden),
    )  # fmt: skip
    loss, _ = _LinearCrossEntropyFn.apply(hidden, weight, bias, setup)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / setup.valid.sum()
    return loss.view(target.shape)
