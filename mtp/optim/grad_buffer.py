"""Contiguous parameter and gradient buffers, split into buckets (Megatron's local DDP).

One :class:`ParamAndGradBuffer` holds the parameters of one kind (same parameter dtype, same
gradient dtype, dense or expert, same device). Parameters are laid out in **reverse** order of
``module.parameters()`` (the order in which backward produces their gradients) and grouped into
buckets of about ``bucket_size`` elements; a parameter never straddles two buckets. Each bucket
is padded to a multiple of the data-parallel size ``d`` so that it splits into ``d`` equal
shards: shard ``r`` of every bucket belongs to data-parallel rank ``r`` (its reduce-scatter
output, its optimizer state, its all-gather input). With one bucket this is the plain ZeRO-1
picture: the whole buffer padded to a multiple of ``d``, rank ``r`` owning
``[r * n/d, (r+1) * n/d)``.

Every parameter's ``.main_grad`` is a view of its slice of ``grad_data``; with a parameter buffer
(the distributed optimizer needs one) its ``.data`` becomes a view of ``param_data`` too, so
the all-gather of the updated shards writes the parameters in place.

Index ranges, per parameter and data-parallel rank (Megatron's ``param_range_map``),
see :func:`param_range_map`:

- ``gbuf_world``: the elements of the parameter this rank owns, in the coordinates of the whole
  buffer (``[start, end)`` into ``grad_data``/``param_data``);
- ``gbuf_local``: the same elements relative to the start of this rank's shard of the bucket;
- ``param``: the same elements as a range of the flattened parameter (``param.view(-1)``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

__all__ = ["Bucket", "ParamAndGradBuffer", "Range", "param_range_map"]


@dataclasses.dataclass(frozen=True)
class Range:
    """A half-open index range ``[start, end)``."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: Range) -> Range:
        start = max(self.start, other.start)
        return Range(start, max(start, min(self.end, other.end)))

    def shift(self, offset: int) -> Range:
        return Range(self.start - offset, self.end - offset)


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class Bucket:
    """A contiguous slice ``[offset, offset + numel)`` of a buffer, reduced as one collective.

    Attributes:
        index: position in the buffer (0 holds the last parameters of the model).
        params: the parameters in it, in buffer order.
        offset, numel: where it lies in the buffer; ``numel`` is padded to a multiple of ``d``.
        grad_data, param_data: views of the buffer's slices (``param_data`` may be None).
    """

    def __init__(self, buffer: ParamAndGradBuffer, index: int, offset: int, numel: int, params):
        self.buffer, self.index, self.offset, self.numel = buffer, index, offset, numel
        self.params = list(params)
        self.grad_data = buffer.grad_data[offset : offset + numel]
        self.param_data = (
            None if buffer.param_data is None else buffer.param_data[offset : offset + numel]
        )
        self.ready: set[int] = set()
        self.grad_work = None  # (work, output or None) of the running reduction
        self.param_work = None  # (work, input) of the running all-gather

    @property
    def shard_size(self) -> int:
        return self.numel // self.buffer.dp_size

    def shard_range(self, dp_rank: int | None = None) -> Range:
        """Rank ``dp_rank``'s shard of this bucket, in buffer coordinates."""
        r = self.buffer.dp_rank if dp_rank is None else dp_rank
        start = self.offset + r * self.shard_size
        return Range(start, start + self.shard_size)

    def __repr__(self) -> str:
        return (
            f"Bucket({self.index}, offset={self.offset}, numel={self.numel}, "
            f"params={len(self.params)})"
        )


class ParamAndGradBuffer:
    """Contiguous gradient (and parameter) storage for ``params``, split into buckets.

    Args:
        params: parameters in model order (same dtype and device); laid out reversed.
        grad_dtype: dtype of ``grad_data`` (fp32 with ``accumulate_allreduce_grads_in_fp32``).
        group: the data-parallel group its buckets are reduced over (None: one rank).
        bucket_size: about this many elements per bucket (None: one bucket).
        param_buffer: also move the parameters into one contiguous ``param_data``.
        is_expert: expert parameters (reduced over the expert-data-parallel group).
        data_parallel_size: with ``group=None``, lay the buffer out for this many ranks anyway
            (to inspect shards and :func:`param_range_map` without a process group).
        pad_buckets_to: pad each bucket to a multiple of ``lcm(d, pad_buckets_to)`` elements
            (e.g. 128 for aligned shards, as Megatron does for NCCL bus bandwidth).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        group,
        bucket_size: int | None,
        *,
        param_buffer: bool,
        is_expert: bool = False,
        data_parallel_size: int | None = None,
        pad_buckets_to: int = 1,
    ) -> None:
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        self.params = list(params)
        self.param_dtype = self.params[0].dtype
        for p in self.params:
            if p.dtype != self.param_dtype or p.device != self.params[0].device:
                raise ValueError(
                    f"ParamAndGradBuffer: params must share one dtype and device, got "
                    f"{p.dtype} on {p.device} and {self.param_dtype} on {self.params[0].device}"
                )
        self.grad_dtype, self.group, self.is_expert = grad_dtype, group, is_expert
        self.dp_size, self.dp_rank = _group_size(group), _group_rank(group)
        if group is None and data_parallel_size is not None:  # layout only (no communication)
            self.dp_size = int(data_parallel_size)
        if not isinstance(pad_buckets_to, int) or pad_buckets_to < 1:
            raise ValueError(f"pad_buckets_to must be a positive int, got {pad_buckets_to!r}")
        self.pad_multiple = math.lcm(self.dp_size, pad_buckets_to)
        device = self.params[0].device
        layout, offset, start, current = [], 0, 0, []
        self.param_index: dict[torch.nn.Parameter, Range] = {}
        for p in reversed(self.params):
            self.param_index[p] = Range(offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            if bucket_size is not None and offset - start >= bucket_size:
                layout.append((start, current))
                offset = start = self._pad(offset)
                current = []
        if current:
            layout.append((start, current))
            offset = self._pad(offset)
        self.numel = offset
        self.numel_unpadded = sum(p.numel() for p in self.params)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if param_buffer:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        ends = [s for s, _ in layout[1:]] + [self.numel]
        self.buckets = [
            Bucket(self, i, s, e - s, ps) for i, ((s, ps), e) in enumerate(zip(layout, ends))
        ]
        self.bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[p] = b
        for p, r in self.param_index.items():
            if self.param_data is not None:
                view = self.param_data[r.start : r.end]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
            p.main_grad = self.grad_data[r.start : r.end].view(p.shape)

    def _pad(self, n: int) -> int:
        return math.ceil(n / self.pad_multiple) * self.pad_multiple

    def reset(self) -> None:
        """Zero the gradients and forget which parameters reported this iteration."""
        self.grad_data.zero_()
        for b in self.buckets:
            b.ready.clear()
            b.grad_work = None

    def __repr__(self) -> str:
        kind = "expert" if self.is_expert else "dense"
        return (
            f"ParamAndGradBuffer({kind}, param={self.param_dtype}, grad={self.grad_dtype}, "
            f"numel={self.numel}, buckets={len(self.buckets)}, dp={self.dp_size})"
        )


def param_range_map(buffer: ParamAndGradBuffer, dp_rank: int | None = None, sharded=True):
    """``{param: {"gbuf_world": Range, "gbuf_local": Range, "param": Range}}`` for the
    parameters that have elements in rank ``dp_rank``'s shards (see the module docstring).

    ``sharded=False`` (no distributed optimizer): every rank owns the whole buffer.
    """
    out = {}
    for bucket in buffer.buckets:
        if sharded:
            shard = bucket.shard_range(dp_rank)
        else:
            shard = Range(bucket.offset, bucket.offset + bucket.numel)
        for p in bucket.params:
            whole = buffer.param_index[p]
            world = whole.intersect(shard)
            if world.size == 0:
                continue
            out[p] = {
                "gbuf_world": world,
                "gbuf_local": world.shift(shard.start),
                "param": world.shift(whole.start),
                "bucket": bucket.index,
            }
    return out
