"""One call of :func:`mtp.ops.linear_cross_entropy`: its shapes and options, the vocab shard's
place in the global vocab (exchanged once per call at tp > 1, with the ranks' agreement row),
the token chunks and the collectives.

Chunks: ``chunk`` rows of ``hidden`` at a time (with sequence parallelism ``chunk // tp`` rows
of each rank's part, all-gathered: the same ``chunk`` rows of logits). Per-row outputs (the
loss, the row statistics, ``d_hidden``) are written by the chunk straight into their slice;
with sequence parallelism a chunk's rows are strided in them (``tp`` runs of ``chunk // tp``),
so the chunk works on contiguous temporaries copied in and out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.ops.linear_cross_entropy.maths import accumulation_dtype
from mtp.parallel.agree import agreement
from mtp.parallel.groups import resolve_group_name
from mtp.utils import check_values, poison_, poison_enabled

__all__ = ["Call", "all_gather"]


def all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[world, *t.shape]`` (every rank takes part, with zero rows too)."""
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out.view(world, *t.shape)


def _reduce_scatter(out: torch.Tensor, t: torch.Tensor, group) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, t, group=group)


def _target_checksum(target: torch.Tensor) -> torch.Tensor:
    t = target.reshape(-1).long()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64) % 1000003
    return ((t % 1000003) * weights).sum() % 1000000007


def _exchange_meta(spec, meta: torch.Tensor, group, world: int, validate) -> torch.Tensor:
    """All-gather this rank's agreement row ``meta`` (``spec``'s fields: vocab shard size, row
    count, hidden size, dtype, target checksum, chunk size) and check that every rank agrees on
    everything but the vocab shard size; returns the gathered ``[world, 6]``."""
    gathered = all_gather(meta, group, world)
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


class Call:
    """Everything about one call that is not a tensor to differentiate.

    ``t``: the flat global target ids; ``vinfo``: int64 ``[2]`` ``(first id of this rank's
    shard, global vocab size)`` on the device at tp > 1, None at tp = 1 (``0``, ``V_local``).
    """

    __slots__ = ("h2d", "t", "eps", "ii", "z", "chunk", "group", "world", "rank", "sp",
                 "backend", "hidden_size", "rows", "local_rows", "v_local", "dtype", "acc",
                 "vinfo", "poison")  # fmt: skip

    def __init__(self, hidden, weight, target, eps: float, ii: int, z: float, chunk: int,
                 group_name: str, world: int, sp: bool, validate, backend: str,
                 vinfo: torch.Tensor | None = None):  # fmt: skip
        self.hidden_size = hidden.shape[-1]
        self.h2d = hidden.reshape(-1, self.hidden_size)
        self.t = target.reshape(-1).contiguous()
        self.eps, self.ii, self.z, self.chunk, self.backend = eps, ii, z, chunk, backend
        self.world = world
        self.group = resolve_group_name(group_name) if world > 1 else None
        self.rank = dist.get_rank(self.group) if world > 1 else 0
        self.sp = sp and world > 1
        self.rows, self.local_rows = self.t.shape[0], self.h2d.shape[0]
        self.v_local = weight.shape[0]
        self.dtype, self.acc = hidden.dtype, accumulation_dtype(hidden.dtype)
        self.poison = poison_enabled()
        if world > 1 and vinfo is None:  # the forward; the backward has the forward's
            vinfo = self._exchange(hidden, validate)
        self.vinfo = vinfo if world > 1 else None

    def _exchange(self, hidden, validate) -> torch.Tensor:
        """The agreement row's all-gather: ``vinfo`` from the ranks' shard sizes."""
        spec = agreement("linear_cross_entropy", {
            "vocab shard size": self.v_local, "row count": self.rows,
            "hidden size": self.hidden_size, "dtype": hidden.dtype, "target checksum": 0,
            "chunk_size": self.chunk,
        })  # fmt: skip
        # fills, no host-to-device copy; the checksum is copied in on the device
        meta = spec.tensor(self.t.device, fill=True,
                           values={"target checksum": _target_checksum(self.t)})  # fmt: skip
        sizes = _exchange_meta(spec, meta, self.group, self.world, validate)[:, 0]
        return torch.stack([sizes[: self.rank].sum(), sizes.sum()])

    def empty(self, shape) -> torch.Tensor:
        """A per-row output in the accumulation dtype (poisoned when outputs are)."""
        out = torch.empty(shape, dtype=self.acc, device=self.t.device)
        return poison_(out) if self.poison else out

    # ---------------------------------------------------------------------------------------

    def chunk_rows(self) -> int:
        """Rows of logits a chunk holds at most (the chunk buffer's height)."""
        if not self.sp:
            return min(self.chunk, self.rows)
        return min(max(1, self.chunk // self.world), self.local_rows) * self.world

    def gather(self, stats: torch.Tensor) -> torch.Tensor:
        """Every rank's ``stats`` ``[..., rows, 3]`` stacked: ``[world * ..., rows, 3]``."""
        parts = stats.shape[0] if stats.dim() == 3 else 1
        if self.world > 1:
            stats = all_gather(stats, self.group, self.world)
        return stats.view(parts * self.world, *stats.shape[-2:])

    def chunks(self, outs=(), ins=()):
        """Per chunk ``(h, t, outs, ins)``: its hidden rows ``[n, H]`` (gathered with sequence
        parallelism), its targets ``[n]`` and the chunk's rows of each per-row tensor of
        ``outs`` (to write; None stays None) and ``ins`` (to read), contiguous."""
        if not self.sp:
            if self.rows <= self.chunk:  # one chunk: the tensors themselves
                if self.rows:
                    yield self.h2d, self.t, list(outs), list(ins)
                return
            parts = [self.h2d.split(self.chunk), self.t.split(self.chunk)]
            parts += [() if x is None else x.split(self.chunk) for x in (*outs, *ins)]
            k = len(outs)
            for i in range(len(parts[0])):
                rows = [p[i] if p else None for p in parts[2:]]
                yield parts[0][i], parts[1][i], rows[:k], rows[k:]
            return
        step = max(1, self.chunk // self.world)
        for a in range(0, self.local_rows, step):
            b = min(a + step, self.local_rows)
            h = all_gather(self.h2d[a:b], self.group, self.world).view(-1, self.hidden_size)
            dst = [None if x is None else self._strided(x, a, b) for x in outs]
            tmp = [None if d is None else torch.empty_like(d).view(-1, *d.shape[2:])
                   for d in dst]  # fmt: skip
            src = [None if x is None else self._strided(x, a, b).reshape(-1, *x.shape[1:])
                   for x in ins]  # fmt: skip
            yield h, self._strided(self.t, a, b).reshape(-1), tmp, src
            for d, x in zip(dst, tmp):
                if d is not None:
                    d.copy_(x.view(d.shape))

    def _strided(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The rows ``r * local_rows + [a, b)`` of every rank ``r``: ``[world, b - a, ...]``."""
        return x.view(self.world, self.local_rows, *x.shape[1:])[:, a:b]

    def reduce_hidden_grad(self, dh: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial ``d_hidden`` (one collective per call)."""
        if self.world == 1:
            return dh
        if not self.sp:
            dist.all_reduce(dh, group=self.group)
            return dh
        out = torch.empty((self.local_rows, self.hidden_size), dtype=dh.dtype, device=dh.device)
        _reduce_scatter(out, dh, self.group)
        return out
