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
* ``"torch"`` (default on CPU and for fp64): the same maths as fp32 PyTorch ops, several passes
  over each chunk.

``MTP_BACKEND=triton`` / ``fused`` / ``torch`` (``reference`` is an alias of ``torch``) steers
``"auto"``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.kernels import linear_cross_entropy as lce_kernels
from mtp.kernels import linear_cross_entropy_gemm as lce_gemm
from mtp.kernels._common import interpreting
from mtp.dtypes import FLOATS, INDEX_DTYPES
from mtp.ops._backend import auto_backend
from mtp.parallel.agree import agreement
from mtp.parallel.agreement import check_collective
from mtp.utils import check_tensor, check_values

__all__ = ["linear_cross_entropy", "default_chunk_size", "REDUCTIONS", "BACKENDS"]

REDUCTIONS = ("none", "mean", "sum")
_DTYPES = FLOATS
_TARGET_DTYPES = INDEX_DTYPES
_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk in the default chunk size


def default_chunk_size(rows: int, vocab_local: int) -> int:
    """Rows per chunk when ``chunk_size=None``: a power of two with fp32 chunk logits of at most
    1 GiB (at least 64 rows, at most ``rows``); a function of the shapes only (graph-safe)."""
    budget = max(64, _CHUNK_BYTES // (4 * max(vocab_local, 1)))
    chunk = 1 << (budget.bit_length() - 1)
    return max(1, min(rows, chunk))


# --------------------------------------------------------------------------------------------
# Per-chunk maths (fp32, plain PyTorch)
# --------------------------------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[rows, V/tp]`` logits in the input dtype; the bias is added in the GEMM's epilogue."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _chunk_stats(x, local_t, owns, coef_target, coef_uniform) -> torch.Tensor:
    """``[rows, 3]`` fp32 ``(max, sum exp(x - max), (1-eps) x_t + eps/V sum x)`` of a shard."""
    x = x.to(_acc(x.dtype))
    m = x.amax(-1)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.exp(x - m_ref[:, None]).sum(-1)
    x_t = torch.where(owns, x.gather(1, local_t[:, None])[:, 0], torch.zeros_like(m))
    c = coef_target * x_t + coef_uniform * x.sum(-1)
    return torch.stack([m, s, c], dim=-1)


def _merge_stats(parts: torch.Tensor) -> torch.Tensor:
    """``[rows, 3]`` statistics of whole rows from ``[k, rows, 3]`` ones of ``k`` column shares
    (the ranks' vocab shards, or the fused GEMM's vocab splits)."""
    if parts.shape[0] == 1:
        return parts[0]
    m_all, s_all, c_all = parts.unbind(-1)
    m = m_all.amax(0)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return torch.stack([m, (s_all * torch.exp(m_all - m_ref)).sum(0), c_all.sum(0)], dim=-1)


def _combine(gathered, valid, z_loss_weight):
    """``(loss [rows], rowstat [rows, 2])`` from every rank's ``[world, rows, 3]`` statistics."""
    m, s, c = _merge_stats(gathered).unbind(-1)
    log_s = torch.log(s)
    lse = m + log_s
    loss = (m - c) + log_s + z_loss_weight * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss)), torch.stack([m, s], dim=-1)


def _chunk_grad(x, rowstat, local_t, owns, dloss, valid, coef_target, coef_uniform, z):
    """``dloss * d loss / d logits`` of a chunk, fp32 ``[rows, V/tp]``; the softmax as PyTorch
    computes it, ``exp(x - m) * (1 / s)`` (not ``exp(x - lse)``, whose rounded ``lse`` costs
    precision at large logits)."""
    m, s = rowstat.unbind(-1)
    lse = m + torch.log(s)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(x.to(_acc(x.dtype)) - m_ref[:, None]) * (1.0 / s)[:, None]
    g = p * (1.0 + 2.0 * z * lse)[:, None] - coef_uniform
    hit = torch.where(owns, -coef_target, torch.zeros_like(lse))
    g.scatter_add_(1, local_t[:, None], hit[:, None].to(g.dtype))
    scale = torch.where(valid, dloss.to(lse.dtype), torch.zeros_like(lse))
    return g * scale[:, None]


_HALF = (torch.float16, torch.bfloat16)
_FUSED_ADDMM: list[bool] = []  # whether addmm(out_dtype=float32, out=C) works here (CUDA)


def _add_weight_grad(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``dw += g^T h`` with fp32 accumulation (``dw`` fp32; ``g``, ``h`` in the input dtype)."""
    if dw.is_cuda and g.dtype in _HALF and _FUSED_ADDMM != [False]:
        try:  # cuBLAS: half inputs, fp32 C read and written in the epilogue
            torch.addmm(dw, g.t(), h, out_dtype=torch.float32, out=dw)
            _FUSED_ADDMM[:] = [True]
            return
        except (RuntimeError, TypeError):
            _FUSED_ADDMM[:] = [False]
    if dw.is_cuda and g.dtype in _HALF:
        dw.add_(torch.mm(g.t(), h, out_dtype=torch.float32))
    else:
        dw.addmm_(g.t().to(dw.dtype), h.to(dw.dtype))


def _mm_fp32(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``g @ weight`` with an fp32 result (``d_hidden`` rows)."""
    if g.is_cuda and g.dtype in _HALF:
        return torch.mm(g, weight, out_dtype=torch.float32)
    acc = _acc(g.dtype)
    return torch.mm(g.to(acc), weight.to(acc))


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
    check_collective("linear_cross_entropy metadata", meta, group)
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
        check_values(
            (~self.valid | ((t >= 0) & (t < vocab))).all(),
            f"linear_cross_entropy: target holds ids outside [0, vocab_size) that are not "
            f"ignore_index={ignore_index} (vocab_size is the global vocab: the sum of the "
            "ranks' weight rows)",
            validate=validate,
            tensors=(t,),
        )
        local = t - start
        self.owns = (local >= 0) & (local < self.v_local)
        self.local_t = local.clamp(0, self.v_local - 1)
        self.coef_target = 1.0 - eps
        self.coef_uniform = eps / vocab.to(_acc(hidden.dtype))
        if backend in _TRITON:  # the kernels' view: local id or -1, coefficients on the device
            self.local_k = torch.where(self.owns, local, torch.full_like(local, -1))
            self.coefs = torch.stack(
                [torch.ones_like(self.coef_uniform) * self.coef_target, self.coef_uniform]
            ).float()
        self.backend = backend

    def forward_stats(self, h: torch.Tensor, weight, bias, rows) -> torch.Tensor:
        """:meth:`stats` of the chunk ``h @ weight^T (+ bias)``; ``"fused"``: in the GEMM."""
        if self.backend == "fused":
            return _merge_stats(lce_gemm.gemm_stats(h, weight, bias, self.local_k[rows],
                                                    self.coefs, self.eps > 0.0))  # fmt: skip
        return self.stats(_logits(h, weight, bias), rows)

    def stats(self, x: torch.Tensor, rows) -> torch.Tensor:
        """``[rows, 3]`` ``(max, sum exp(x - max), target term)`` of a chunk's logits ``x``."""
        if self.backend in _TRITON:
            return lce_kernels.chunk_stats(x, self.local_k[rows], self.coefs, self.eps > 0.0)
        return _chunk_stats(x, self.local_t[rows], self.owns[rows], self.coef_target,
                            self.coef_uniform)  # fmt: skip

    def grad(self, x: torch.Tensor, rows, rowstat: torch.Tensor, dloss: torch.Tensor):
        """``dloss * d loss / d x`` of a chunk (Triton: written over ``x``, in its dtype)."""
        if self.backend in _TRITON:
            scale = torch.where(self.valid[rows], dloss.float(), torch.zeros_like(rowstat[:, 0]))
            return lce_kernels.chunk_grad_(x, self.local_k[rows], self.coefs, rowstat, scale,
                                           self.z)  # fmt: skip
        return _chunk_grad(
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
        acc = _acc(hidden.dtype)
        loss = torch.empty(setup.rows, dtype=acc, device=hidden.device)
        rowstat = torch.empty((setup.rows, 2), dtype=acc, device=hidden.device)
        for local, rows in setup.chunks():
            stats = setup.forward_stats(setup.rows_of(h2d, local), weight, bias, rows)
            if setup.world > 1:
                gathered = _all_gather(stats, setup.group, setup.world)
            else:
                gathered = stats[None]
            loss[rows], rowstat[rows] = _combine(gathered, setup.valid[rows], setup.z)
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
        acc = _acc(hidden.dtype)
        dh = torch.empty((s.rows, s.hidden_size), dtype=acc, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
        dloss = dloss.reshape(-1)
        for local, rows in s.chunks():
            hc = s.rows_of(h2d, local)
            g = s.grad(_logits(hc, weight, bias), rows, rowstat[rows], dloss[rows])
            if need_b:
                db += g.sum(0, dtype=acc)
            g = g.to(weight.dtype)
            if need_h:
                dh[rows] = _mm_fp32(g, weight)
            if need_w:
                _add_weight_grad(dw, g, hc)
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

BACKENDS = ("auto", "triton", "fused", "torch")
_TRITON = ("triton", "fused")


def _resolve_backend(backend, hidden: torch.Tensor) -> str:
    """``"triton"``, ``"fused"`` or ``"torch"`` for ``backend`` (see
    :func:`linear_cross_entropy`)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    fp64 = hidden.dtype == torch.float64
    if backend == "auto":
        backend = auto_backend(BACKENDS[1:], hidden.device, reference="torch")
        if fp64:
            return "torch"
    if backend in _TRITON and fp64:
        raise ValueError(f"backend={backend!r} takes fp32 / fp16 / bf16 inputs; fp64 needs 'torch'")
    if backend in _TRITON and not hidden.is_cuda and not interpreting():
        raise ValueError(
            f"backend={backend!r} needs CUDA tensors; on CPU use backend='torch' or set "
            "TRITON_INTERPRET=1 to run the kernels in the interpreter"
        )
    return backend


def _check_args(hidden, weight, target, bias, group, sp, eps, ignore_index, z, reduction, chunk):
    check_tensor("hidden", hidden, dtypes=_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., H] with H = weight.shape[1] = {weight.shape[1]}, got shape "
            f"{tuple(hidden.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocab row (its shape is [V/tp, H])")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(hidden.dtype,), device=hidden.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
        raise TypeError(f"target must hold class indices (int64 or int32), got {target.dtype}")
    check_tensor("target", target, dtypes=_TARGET_DTYPES, device=hidden.device)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {group!r}")
    world = 1 if group is None else dist.get_world_size(group)
    lead = tuple(hidden.shape[:-1])
    want = lead if not (sp and world > 1) else ((lead[0] * world,) + lead[1:] if lead else None)
    if want is None or tuple(target.shape) != want:
        extra = " (sequence_parallel: hidden's first dim is this rank's chunk)" if sp else ""
        raise ValueError(
            f"target must have shape {want} for hidden of shape {tuple(hidden.shape)}{extra}, "
            f"got {tuple(target.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {eps!r}")
    if not isinstance(z, (int, float)) or isinstance(z, bool) or not 0.0 <= z < float("inf"):
        raise ValueError(f"z_loss_weight must be a finite float >= 0, got {z!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk!r}")
    if not isinstance(sp, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sp!r}")


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
        reduction: ``"mean"`` (over non-ignored rows; NaN when all are ignored, as PyTorch),
            ``"sum"`` or ``"none"`` (per-row fp32 loss of ``target``'s shape).
        chunk_size: rows whose logits are live at once (sequence parallel: gathered rows);
            default :func:`default_chunk_size`.
        sequence_parallel: ``hidden`` is sequence-sharded; its rows are all-gathered chunk by
            chunk and ``d_hidden`` is reduce-scattered.
        validate: data checks (targets in range, ranks agree) on the device by default;
            ``"sync"`` raises Python errors after a host sync; False skips them.
        backend: ``"auto"`` (``"triton"`` on CUDA for fp32 / fp16 / bf16, else ``"torch"``;
            ``MTP_BACKEND`` overrides), ``"triton"`` (Triton loss kernels per chunk; CPU needs
            ``TRITON_INTERPRET=1``), ``"fused"`` (as ``"triton"``, but the forward's logits GEMM
            is a Triton kernel with the row statistics in its epilogue: no logits are written;
            opt-in until GPU timings exist) or ``"torch"`` (fp32 PyTorch maths per chunk).

    Returns:
        fp32 loss: a scalar, or ``target``'s shape for ``reduction="none"``; identical on every
        rank. Gradients flow to ``hidden`` (``hidden.dtype``, summed over the group), ``weight``
        and ``bias`` (this rank's shard, accumulated in fp32 over the chunks).

    Communication per call: one all-gather of 6 int64 (agreement metadata), per chunk one
    all-gather of ``12 * rows`` bytes forward (plus the chunk's hidden rows with sequence
    parallel, forward and backward), one all-reduce (reduce-scatter) of ``d_hidden`` backward.
    """
    _check_args(
        hidden, weight, target, bias, group, sequence_parallel, label_smoothing, ignore_index,
        z_loss_weight, reduction, chunk_size,
    )  # fmt: skip
    world = 1 if group is None else dist.get_world_size(group)
    rows = target.numel()
    chunk = chunk_size or default_chunk_size(rows, weight.shape[0])
    setup = _Setup(
        hidden, weight, target, group, float(label_smoothing), int(ignore_index),
        float(z_loss_weight), chunk, sequence_parallel and world > 1, validate,
        _resolve_backend(backend, hidden),
    )  # fmt: skip
    loss, _ = _LinearCrossEntropyFn.apply(hidden, weight, bias, setup)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / setup.valid.sum()
    return loss.view(target.shape)
