"""The distributed optimizer (ZeRO-1): :class:`DistributedOptimizer`.

Each data-parallel rank owns shard ``r`` of every bucket of the gradient buffers
(:mod:`mtp.optim.grad_buffer`). For every parameter element in its shards it keeps an fp32 main
parameter and the optimizer state; one step is:

1. reduce-scatter of every bucket (started by the backward hooks of
   :class:`~mtp.optim.DistributedDataParallel`; :meth:`DistributedOptimizer.step` waits for them);
2. the fp32 main gradients of the shard: a view of the gradient buffer when it is fp32, else a
   copy into a persistent fp32 buffer; unscaled and checked for inf/NaN with a loss scaler;
   clipped by the global norm;
3. ``optimizer.step()`` on the main parameters of the shard only;
4. the updated shard is written (cast) into the contiguous parameter buffer and every bucket is
   all-gathered over the data-parallel group (expert buckets over the expert-data-parallel
   group), in place into the parameters; with ``overlap_param_gather=True`` the all-gathers run
   asynchronously and each module waits for its own buckets in a forward pre-hook.

Main parameters are separate fp32 tensors for fp16/bf16 models; for fp32 parameters they are views
of the parameter buffer (no copy), which is what the bytes-per-parameter table assumes:

================================  ==================  ===============================
parameter / gradient dtypes        without ZeRO (d=1)  distributed optimizer (d ranks)
================================  ==================  ===============================
fp16/bf16 param, fp16/bf16 grad    20                  4 + 16/d
fp16/bf16 param, fp32 grad         18                  6 + 12/d
fp32 param, fp32 grad              16                  8 + 8/d
================================  ==================  ===============================

with Adam. In general (:func:`bytes_per_parameter_formula`): ``P + G + (M + MG + S) / d``, with
``P``/``G`` the bytes of the model parameter and of its gradient (replicated), ``M`` = 4 for the
fp32 main parameter unless the parameter is fp32, ``MG`` = 4 for the fp32 main gradient unless
the gradient buffer is fp32, and ``S`` the optimizer state per element (Adam: 8 for ``exp_avg``
and ``exp_avg_sq``; SGD with momentum: 4; plain SGD: 0).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
import torch.distributed as dist
from torch import nn

from .clip_grads import clip_grads_by_norm, get_grad_norm, param_is_not_duplicate
from .distributed import DistributedDataParallel, _all_gather_flat
from .grad_buffer import ParamAndGradBuffer, Range, param_range_map
from .grad_scaler import DynamicLossScaler

__all__ = ["OPTIMIZER_STATE_BYTES", "DistributedOptimizer", "bytes_per_parameter_formula"]

#: Optimizer state bytes per parameter element (fp32 state).
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4}


def bytes_per_parameter_formula(
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    optimizer: str | int = "adam",
    data_parallel_size: int = 1,
) -> float:
    """Bytes per parameter: ``P + G + (M + MG + S) / d`` (module docstring).

    ``optimizer``: a key of :data:`OPTIMIZER_STATE_BYTES` or the state bytes per element.
    """
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZER_STATE_BYTES)} or an int")
        state = OPTIMIZER_STATE_BYTES[optimizer]
    else:
        state = int(optimizer)
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    p = torch.empty((), dtype=param_dtype).element_size()
    g = torch.empty((), dtype=grad_dtype).element_size()
    main = 0 if param_dtype == torch.float32 else 4
    main_grad = 0 if grad_dtype == torch.float32 else 4
    return p + g + (main + main_grad + state) / data_parallel_size


@dataclasses.dataclass
class ShardEntry:
    """One parameter's piece in this rank's shard (see :attr:`DistributedOptimizer.shards`)."""

    name: str
    param: nn.Parameter  # the model parameter
    buffer: ParamAndGradBuffer
    ranges: dict  # "gbuf_world", "gbuf_local", "param" (Range), "bucket" (int)
    main_param: torch.Tensor  # fp32, what the torch optimizer updates
    model_slice: torch.Tensor  # the model parameter's elements (flat view, model dtype)
    grad_slice: torch.Tensor  # the gradient buffer's elements (flat view, grad dtype)


def _ctor_kwargs(cls, defaults: dict) -> dict:
    try:
        names = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in defaults.items() if k in names}


class DistributedOptimizer:
    """ZeRO-1 around any torch optimizer whose state is per element (AdamW, Adam, SGD, ...).

    Args:
        optimizer: a ``torch.optim.Optimizer`` class (built here with ``optimizer_kwargs`` over
            the main parameters), or an instance built over ``model.parameters()`` (its param
            groups and hyperparameters are kept; it must have no state yet).
        model: a :class:`DistributedDataParallel`; ``use_distributed_optimizer=True`` shards
            the state over the data-parallel ranks, False keeps it whole on every rank (a
            mixed-precision optimizer with fp32 main parameters, Megatron's
            ``Float16OptimizerWithFloat16Params``).
        clip_grad: clip the global gradient norm to this (0: no clipping).
        grad_scaler: a :class:`DynamicLossScaler` for fp16 (scale the loss with
            ``optimizer.scale_loss(loss)``).
        overlap_param_gather: leave the parameter all-gathers running after :meth:`step`; each
            module waits for its buckets in a forward pre-hook (call :meth:`finish_param_sync`
            before reading parameters outside a forward).
        grad_stats_group: group for the norm and found-inf reductions (default: the world).

    Attributes:
        optimizer: the inner torch optimizer (over the main parameters; give it to LR schedulers).
        shards: one :class:`ShardEntry` per parameter piece this rank owns.
        param_range_map: ``{param: {"gbuf_world", "gbuf_local", "param": Range, "bucket"}}``
            (the world / local / param index ranges, :func:`mtp.optim.param_range_map`).
    """

    def __init__(
        self,
        optimizer,
        model: DistributedDataParallel,
        *,
        clip_grad: float = 0.0,
        grad_scaler: DynamicLossScaler | None = None,
        overlap_param_gather: bool = False,
        grad_stats_group: dist.ProcessGroup | None = None,
        **optimizer_kwargs,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "model must be an mtp.optim.DistributedDataParallel (wrap the model with "
                f"use_distributed_optimizer=True), got {type(model).__name__}"
            )
        if clip_grad < 0 or math.isnan(clip_grad):
            raise ValueError(f"clip_grad must be >= 0, got {clip_grad}")
        if grad_scaler is not None and not isinstance(grad_scaler, DynamicLossScaler):
            raise TypeError(f"grad_scaler must be a DynamicLossScaler, got {type(grad_scaler)}")
        self.model, self.clip_grad, self.grad_scaler = model, float(clip_grad), grad_scaler
        self.device = model.buffers[0].grad_data.device
        if grad_scaler is not None:
            grad_scaler.to(self.device)
        self.sharded = model.use_distributed_optimizer
        self.overlap_param_gather = bool(overlap_param_gather) and self.sharded
        self.grad_stats_group = grad_stats_group
        names = {p: n for n, p in model.module.named_parameters()}
        self.param_range_map: dict = {}
        self.shards: list[ShardEntry] = []
        self._main_grad_storage: list[torch.Tensor] = []
        for buf in model.buffers:
            ranges = param_range_map(buf, sharded=self.sharded)
            self.param_range_map.update(ranges)
            self._add_shards(buf, ranges, names)
        self._main_of = {id(e.param): e.main_param for e in self.shards}
        self.optimizer = self._build_inner(optimizer, optimizer_kwargs)
        self._counted = [param_is_not_duplicate(e.param, sharded=self.sharded) for e in self.shards]
        self._bucket_of_param = {p: b for buf in model.buffers for p, b in buf.bucket_of.items()}
        self._pre_hooks = []
        if self.overlap_param_gather:
            for module in model.module.modules():
                if any(True for _ in module.parameters(recurse=False)):
                    self._pre_hooks.append(module.register_forward_pre_hook(self._wait_hook))

    # -- construction ------------------------------------------------------------------------

    def _add_shards(self, buf: ParamAndGradBuffer, ranges: dict, names: dict) -> None:
        fp32_grads = buf.grad_dtype == torch.float32
        total = sum(r["gbuf_world"].size for r in ranges.values())
        storage = None
        if not fp32_grads and total:
            storage = torch.zeros(total, dtype=torch.float32, device=buf.grad_data.device)
            self._main_grad_storage.append(storage)
        offset = 0
        for p, r in ranges.items():
            w, pr = r["gbuf_world"], r["param"]
            if buf.param_data is not None:
                model_slice = buf.param_data[w.start : w.end]
            else:
                model_slice = p.detach().view(-1)[pr.start : pr.end]
            grad_slice = buf.grad_data[w.start : w.end]
            if p.dtype == torch.float32:
                main = nn.Parameter(model_slice, requires_grad=False)
            else:
                main = nn.Parameter(model_slice.detach().float().clone(), requires_grad=False)
            if fp32_grads:
                main.grad = grad_slice
            else:
                main.grad = storage[offset : offset + w.size]
                offset += w.size
            self.shards.append(ShardEntry(names[p], p, buf, r, main, model_slice, grad_slice))

    def _build_inner(self, optimizer, kwargs) -> torch.optim.Optimizer:
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            mains = [e.main_param for e in self.shards]
            return optimizer([{"params": mains}], **kwargs)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer class or instance, got "
                f"{type(optimizer).__name__}"
            )
        if kwargs:
            raise TypeError(
                f"optimizer is an instance: unexpected keyword arguments {sorted(kwargs)}"
            )
        if optimizer.state:
            raise ValueError("optimizer already has state; build the DistributedOptimizer first")
        trainable = {id(p) for buf in self.model.buffers for p in buf.params}
        groups = []
        for i, group in enumerate(optimizer.param_groups):
            mains = []
            for p in group["params"]:
                if id(p) not in trainable:
                    raise ValueError(
                        f"optimizer param_groups[{i}] holds a parameter that is not a trainable "
                        "parameter of model (frozen, or of another module)"
                    )
                if id(p) in self._main_of:
                    mains.append(self._main_of[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mains})
        cls = type(optimizer)
        return cls(groups, **_ctor_kwargs(cls, optimizer.defaults))

    # -- the step ----------------------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged without a scaler)."""
        return loss if self.grad_scaler is None else self.grad_scaler.scale_loss(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradient buffers (the main gradients are views or overwritten).
        Running parameter all-gathers (``overlap_param_gather``) are not waited for."""
        self.model.zero_grad_buffer()

    def _stats_group(self):
        if self.grad_stats_group is not None:
            return self.grad_stats_group
        if not dist.is_available() or not dist.is_initialized():
            return None
        from mtp import parallel

        if self.sharded or parallel.model_parallel_is_initialized():
            return dist.group.WORLD
        return None

    def _copy_model_grads_to_main_grads(self) -> None:
        for e in self.shards:
            if e.main_param.grad.data_ptr() != e.grad_slice.data_ptr():
                e.main_param.grad.copy_(e.grad_slice)

    def _unscale_and_check(self) -> bool:
        inv = self.grad_scaler.inv_scale
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        for e in self.shards:
            g = e.main_param.grad
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        group = self._stats_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        found_inf = bool(found.item())  # one host sync: the step is skipped or not
        self.grad_scaler.update(found_inf)
        return found_inf

    def get_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the main gradients (every element counted once)."""
        grads = [e.main_param.grad for e in self.shards]
        return get_grad_norm(grads, self._counted, 2.0, self._stats_group())

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the gradient reduction, unscale/check/clip, step on the shard, all-gather.

        Returns ``(update_successful, grad_norm, num_zeros_in_grad)`` like Megatron-Core:
        ``update_successful`` is False when the loss scaler found inf/NaN (step skipped; the
        only host sync, and only with a scaler); ``grad_norm`` is the norm before clipping (a
        device tensor) when ``clip_grad > 0``, else None; ``num_zeros_in_grad`` is None.
        """
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        self.model.finish_grad_sync(set_param_grads=False)  # main_grad is what it reads
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None and self._unscale_and_check():
            return False, None, None
        grad_norm = None
        if self.clip_grad > 0:
            grad_norm = self.get_grad_norm()
            clip_grads_by_norm([e.main_param.grad for e in self.shards], self.clip_grad, grad_norm)
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        self.start_param_sync()
        if not self.overlap_param_gather:
            self.finish_param_sync()
        return True, grad_norm, None

    def _copy_main_params_to_model_params(self) -> None:
        for e in self.shards:
            if e.main_param.data_ptr() != e.model_slice.data_ptr():
                e.model_slice.copy_(e.main_param)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model parameters into the main parameters (after loading model weights)."""
        for e in self.shards:
            if e.main_param.data_ptr() != e.model_slice.data_ptr():
                e.main_param.copy_(e.model_slice)

    def state_dict(self) -> dict:
        """This rank's state: the inner optimizer's ``state_dict`` (over its shard) and the loss
        scaler's. Reloadable only with the same sizes and layout; :func:`mtp.optim.save_checkpoint`
        writes checkpoints that reshard."""
        out = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of :meth:`state_dict` (same sizes and layout)."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    # -- parameter all-gather ----------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Start the all-gather of every bucket's parameters (last bucket first: the first
        layers' parameters, which the next forward needs first)."""
        if not self.sharded:
            return
        for buf in self.model.buffers:
            if buf.dp_size == 1:
                continue
            for bucket in reversed(buf.buckets):
                s = bucket.shard_range()
                inp = buf.param_data[s.start : s.end].clone()
                work = _all_gather_flat(bucket.param_data, inp, buf.group, async_op=True)
                bucket.param_work = (work, inp)

    def finish_param_sync(self) -> None:
        """Wait for every running parameter all-gather."""
        for bucket in self.model.buckets:
            self._wait_bucket(bucket)

    @staticmethod
    def _wait_bucket(bucket) -> None:
        if bucket.param_work is not None:
            bucket.param_work[0].wait()
            bucket.param_work = None

    def _wait_hook(self, module, args) -> None:
        for p in module.parameters(recurse=False):
            bucket = self._bucket_of_param.get(p)
            if bucket is not None:
                self._wait_bucket(bucket)

    # -- memory ------------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by this rank: model parameters, gradient buffers, fp32 main parameters
        (separate copies only), fp32 main gradients (separate copies only), optimizer state
        (per-element tensors only; 0-d ``step`` counters are not counted), and ``param.grad``
        copies in the parameter dtype when some are held (``"grad_copies"``: after a
        ``model.finish_grad_sync()`` called by hand, until :meth:`step` or :meth:`zero_grad`
        drops them)."""

        def nbytes(t):
            return t.numel() * t.element_size()

        params = 0
        for buf in self.model.buffers:
            if buf.param_data is not None:
                params += nbytes(buf.param_data)
            else:
                params += sum(nbytes(p) for p in buf.params)
        grads = sum(nbytes(buf.grad_data) for buf in self.model.buffers)
        mains = sum(
            nbytes(e.main_param)
            for e in self.shards
            if e.main_param.data_ptr() != e.model_slice.data_ptr()
        )
        main_grads = sum(nbytes(t) for t in self._main_grad_storage)
        state = 0
        for e in self.shards:
            for v in self.optimizer.state.get(e.main_param, {}).values():
                if isinstance(v, torch.Tensor) and v.numel() == e.main_param.numel() and v.dim():
                    state += nbytes(v)
        return {
            "params": params,
            "grads": grads,
            "main_params": mains,
            "main_grads": main_grads,
            "optimizer_state": state,
            "grad_copies": self.model.param_grad_copy_bytes(),
        }

    def bytes_per_parameter(self) -> float:
        """Measured :meth:`memory_bytes` total over the number of model parameter elements
        (after the first step, once the optimizer state exists). Equals
        :func:`bytes_per_parameter_formula` when no bucket needs padding."""
        n = sum(buf.numel_unpadded for buf in self.model.buffers)
        return sum(self.memory_bytes().values()) / n

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({type(self.optimizer).__name__}, sharded={self.sharded}, "
            f"pieces={len(self.shards)}, clip_grad={self.clip_grad})"
        )


__all__ += ["Range", "ShardEntry"]
