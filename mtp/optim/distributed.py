"""Data-parallel wrapper with contiguous gradient buffers: :class:`DistributedDataParallel`.

Megatron's "local DDP": every trainable parameter gets a ``.main_grad`` view into one contiguous
buffer per kind (parameter dtype, gradient dtype, dense or expert; see
:mod:`mtp.optim.grad_buffer`). A post-accumulate-grad hook on each parameter adds ``.grad`` into
``.main_grad`` and frees ``.grad`` (or only frees it when the op already added its gradient to
``.main_grad`` and set ``grad_added_to_main_grad``: Megatron's gradient-accumulation fusion, e.g.
:class:`mtp.moe.GroupedMLP` with ``gradient_accumulation_fusion=True``); when every parameter of a bucket has reported, the bucket's
reduction starts asynchronously (reduce-scatter with the distributed optimizer, all-reduce
without), so communication overlaps the rest of the backward. Buckets are launched strictly in
index order on every rank (a bucket that fills early waits for the ones before it), so ranks
always issue the same collectives in the same order.

Gradients are averaged: each bucket is multiplied by ``1 / d`` (``d`` the data-parallel size,
context parallel included) before the sum. Dense parameters reduce over the data-parallel
(-and-context-parallel) group, expert parameters (``allreduce = False``, set by
:class:`mtp.moe.GroupedMLP`) over the expert-data-parallel group: their gradients already hold the
tokens of every expert-parallel rank, so they are also scaled by ``1 / d``, not by the size of
their own group (Megatron-Core's convention).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mtp.parallel.params import (
    check_param_attributes,
    is_expert_param,
    param_is_sequence_parallel,
)
from mtp.utils import qualified_name

from .grad_buffer import ParamAndGradBuffer

__all__ = ["DistributedDataParallel", "is_expert_param"]

logger = logging.getLogger("mtp")

_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _all_gather_flat(out, inp, group, async_op=False):
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def _reduce_scatter_flat(out, inp, group, async_op=False):
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(out, inp, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


def _default_groups(data_parallel_group, expert_data_parallel_group):
    """(dense dp group, expert dp group, dense dp size); None groups mean a single rank."""
    from mtp import parallel

    if parallel.model_parallel_is_initialized():
        if data_parallel_group is None:
            data_parallel_group = parallel.get_data_parallel_group(with_context_parallel=True)
        if expert_data_parallel_group is None:
            expert_data_parallel_group = parallel.get_expert_data_parallel_group()
    elif data_parallel_group is None and dist.is_available() and dist.is_initialized():
        data_parallel_group = dist.group.WORLD
    return data_parallel_group, expert_data_parallel_group


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training with contiguous gradient buffers.

    Args:
        module: the model (tensor-/expert-parallel or not), the same on every data-parallel rank.
        use_distributed_optimizer: reduce-scatter each bucket (ZeRO-1: each data-parallel rank
            keeps the sum of its shard only) and keep the parameters in a contiguous buffer for
            the all-gather; needed by :class:`mtp.optim.DistributedOptimizer`. False: all-reduce.
        accumulate_allreduce_grads_in_fp32: fp32 gradient buffers for fp16/bf16 parameters
            (gradients accumulate and reduce in fp32).
        overlap_grad_reduce: start each bucket's reduction from the backward hooks; False
            waits for :meth:`finish_grad_sync`.
        bucket_size: about this many elements per bucket (default ``max(40_000_000,
            1_000_000 * d)``, Megatron's); None: one bucket per buffer.
        pad_buckets_to: pad every bucket to a multiple of ``lcm(d, pad_buckets_to)`` elements
            (default: of ``d``, the minimum the reduce-scatter needs).
        data_parallel_group: the dense parameters' group (default: ``mtp.parallel``'s
            data-parallel group with context parallel; without ``mtp.parallel``, the world).
        expert_data_parallel_group: the expert parameters' group (default: ``mtp.parallel``'s).

    After ``loss.backward()`` (under :meth:`no_sync` for all micro-batches but the last) call
    :meth:`finish_grad_sync` (the optimizer does it): without the distributed optimizer every
    parameter's ``.grad`` then holds the averaged gradient (a view of ``.main_grad`` when the
    dtypes agree), ready for any ``torch.optim`` optimizer and :func:`mtp.optim.clip_grad_norm`.
    :meth:`zero_grad_buffer` starts the next iteration. Parameters shared by several modules are
    counted once; frozen parameters (``requires_grad=False``) get no buffer; a parameter that
    gets no gradient in an iteration gets a zero gradient (its ``main_grad`` stays zero).
    Parameters with ``sequence_parallel = True`` have their gradient summed over the
    tensor-parallel group by :meth:`finish_grad_sync`. How each parameter is reduced is read
    from its attributes (:mod:`mtp.parallel.params`); contradictory ones raise ``ValueError``
    naming the parameter.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        use_distributed_optimizer: bool = False,
        accumulate_allreduce_grads_in_fp32: bool = False,
        overlap_grad_reduce: bool = True,
        bucket_size: int | None | str = "default",
        pad_buckets_to: int = 1,
        data_parallel_group: dist.ProcessGroup | None = None,
        expert_data_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {qualified_name(module)}")
        if isinstance(module, DistributedDataParallel):
            raise TypeError("module is already wrapped in mtp.optim.DistributedDataParallel")
        self.module = module
        self.use_distributed_optimizer = bool(use_distributed_optimizer)
        self.accumulate_allreduce_grads_in_fp32 = bool(accumulate_allreduce_grads_in_fp32)
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        dense_group, expert_group = _default_groups(data_parallel_group, expert_data_parallel_group)
        self.data_parallel_group, self.expert_data_parallel_group = dense_group, expert_group
        dp = 1 if dense_group is None else dist.get_world_size(dense_group)
        self.data_parallel_size = dp
        if bucket_size == "default":
            bucket_size = max(40_000_000, 1_000_000 * dp)
        if bucket_size is not None and (not isinstance(bucket_size, int) or bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive int or None, got {bucket_size!r}")
        self.bucket_size, self.pad_buckets_to = bucket_size, pad_buckets_to
        self.buffers = self._build_buffers(dense_group, expert_group)
        self._sync_enabled = True
        self._grads_synced = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(buf, p))
            for buf in self.buffers
            for p in buf.params
        ]
        for buf in self.buffers:  # Megatron's flag: ops that add to main_grad themselves set it
            for p in buf.params:
                p.grad_added_to_main_grad = False

    # -- construction ------------------------------------------------------------------------

    def _build_buffers(self, dense_group, expert_group) -> list[ParamAndGradBuffer]:
        kinds: dict[tuple, list[nn.Parameter]] = {}
        for name, p in self.module.named_parameters():  # deduplicated: shared params once
            if not p.requires_grad:
                continue
            if p.dtype not in _FLOAT:
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; DistributedDataParallel needs "
                    f"floating-point trainable parameters (freeze it: requires_grad_(False))"
                )
            expert = check_param_attributes(p, f"parameter {name!r}").expert
            if expert and expert_group is None and dist.is_initialized():
                from mtp import parallel

                if not parallel.model_parallel_is_initialized():
                    raise ValueError(
                        f"parameter {name!r} is an expert parameter (allreduce=False) but no "
                        "expert_data_parallel_group was given and mtp.parallel is not initialized"
                    )
            grad_dtype = p.dtype
            if self.accumulate_allreduce_grads_in_fp32 and p.dtype in (
                torch.float16,
                torch.bfloat16,
            ):
                grad_dtype = torch.float32
            kinds.setdefault((p.dtype, grad_dtype, expert, p.device), []).append(p)
        buffers = []
        for (_, grad_dtype, expert, _), params in kinds.items():
            buffers.append(
                ParamAndGradBuffer(
                    params,
                    grad_dtype,
                    expert_group if expert else dense_group,
                    self.bucket_size,
                    param_buffer=self.use_distributed_optimizer,
                    is_expert=expert,
                    pad_buckets_to=self.pad_buckets_to,
                )
            )
        if not buffers:
            raise ValueError("module has no trainable parameters (requires_grad=True)")
        logger.debug("DistributedDataParallel buffers: %s", buffers)
        return buffers

    # -- forward / hooks ---------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _make_hook(self, buf: ParamAndGradBuffer, param: nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            if self._grads_synced:
                raise RuntimeError(
                    "a backward ran after finish_grad_sync() without zero_grad_buffer(): call "
                    "model.zero_grad_buffer() (or DistributedOptimizer.zero_grad()) at the start "
                    "of every iteration"
                )
            bucket = buf.bucket_of[param]
            if bucket.grad_work is not None:
                raise RuntimeError(
                    "a gradient arrived for a bucket whose reduction already started: a second "
                    "backward without finish_grad_sync()/zero_grad_buffer(); run all micro-batches "
                    "but the last under ddp.no_sync()"
                )
            if getattr(param, "grad_added_to_main_grad", False):  # fused into main_grad
                param.grad_added_to_main_grad = False
            else:
                param.main_grad.add_(p.grad)
            p.grad = None
            if self._sync_enabled and self.overlap_grad_reduce:
                bucket.ready.add(id(param))
                self._launch_ready(buf)

        return hook

    def _launch_ready(self, buf: ParamAndGradBuffer) -> None:
        """Start the reductions of the leading run of full buckets not started yet."""
        for bucket in buf.buckets:
            if bucket.grad_work is not None:
                continue
            if len(bucket.ready) < len(bucket.params):
                return
            self._start_bucket(bucket)

    def _start_bucket(self, bucket) -> None:
        buf = bucket.buffer
        if self.data_parallel_size > 1:
            bucket.grad_data.mul_(1.0 / self.data_parallel_size)
        if buf.dp_size == 1:
            bucket.grad_work = (None, None)
        elif self.use_distributed_optimizer:
            out = torch.empty(bucket.shard_size, dtype=buf.grad_dtype, device=buf.grad_data.device)
            work = _reduce_scatter_flat(out, bucket.grad_data, buf.group, async_op=True)
            bucket.grad_work = (work, out)
        else:
            bucket.grad_work = (
                dist.all_reduce(bucket.grad_data, group=buf.group, async_op=True),
                None,
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients into the buffers without reducing them (micro-batches but the
        last of an iteration)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- synchronisation ---------------------------------------------------------------------

    def start_grad_sync(self) -> None:
        """Start every bucket's reduction that has not started yet (in bucket order)."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                if bucket.grad_work is None:
                    self._start_bucket(bucket)

    def finish_grad_sync(self, *, set_param_grads: bool = True) -> None:
        """Wait for every bucket's reduction (starting those that are not running).

        Afterwards ``main_grad`` holds the averaged gradient: everywhere (all-reduce), or in this
        rank's shard of every bucket (distributed optimizer). Without the distributed optimizer
        and with ``set_param_grads`` (default) ``param.grad`` is set to it too, for a torch
        optimizer: a view of ``main_grad`` when the dtypes agree, else a copy in the parameter's
        dtype (2 more bytes per fp16/bf16 parameter with fp32 gradient buffers, held until
        :meth:`zero_grad_buffer`; :class:`~mtp.optim.DistributedOptimizer` reads ``main_grad``
        and passes ``set_param_grads=False``). Calling it twice is harmless.
        """
        if self._grads_synced:
            if not set_param_grads:
                self.release_param_grads()
            return
        self.start_grad_sync()
        for buf in self.buffers:
            for bucket in buf.buckets:
                work, out = bucket.grad_work
                if work is not None:
                    work.wait()
                if out is not None:
                    s = bucket.shard_range()
                    buf.grad_data[s.start : s.end].copy_(out)
                bucket.grad_work = (None, None)
        self._allreduce_sequence_parallel_grads()
        if set_param_grads and not self.use_distributed_optimizer:
            for buf in self.buffers:
                for p in buf.params:
                    g = p.main_grad
                    p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        self._grads_synced = True

    def release_param_grads(self) -> None:
        """Drop the ``param.grad`` copies :meth:`finish_grad_sync` made (parameters whose
        dtype differs from their gradient buffer's); views of ``main_grad`` stay."""
        for buf in self.buffers:
            if buf.grad_dtype == buf.param_dtype:
                continue
            for p in buf.params:
                p.grad = None

    def param_grad_copy_bytes(self) -> int:
        """Bytes held by ``param.grad`` tensors that are not views of a gradient buffer (the
        copies :meth:`finish_grad_sync` makes for a torch optimizer, see there)."""
        total = 0
        for buf in self.buffers:
            if buf.grad_dtype == buf.param_dtype:
                continue
            for p in buf.params:
                if p.grad is not None:
                    total += p.grad.numel() * p.grad.element_size()
        return total

    def _allreduce_sequence_parallel_grads(self) -> None:
        sp = [p for buf in self.buffers for p in buf.params if param_is_sequence_parallel(p)]
        if not sp:
            return
        from mtp import parallel

        if not parallel.model_parallel_is_initialized():
            return
        group = parallel.get_tensor_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in sp:
            by_dtype.setdefault(p.main_grad.dtype, []).append(p.main_grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and ``param.grad`` (start of an iteration)."""
        for buf in self.buffers:
            buf.reset()
            for p in buf.params:
                p.grad = None
        self._grads_synced = False

    # -- introspection -----------------------------------------------------------------------

    @property
    def buckets(self):
        """Every bucket of every buffer, in launch order per buffer."""
        return [b for buf in self.buffers for b in buf.buckets]

    def state_dict(self, *args, **kwargs):
        """The wrapped module's ``state_dict`` (original names, no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module in place (``assign`` is refused: the parameters must
        stay views of the buffers)."""
        if assign:
            raise ValueError("assign=True would detach the parameters from the DDP buffers")
        return self.module.load_state_dict(state_dict, strict=strict)
