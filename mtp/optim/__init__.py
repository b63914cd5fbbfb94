"""Data-parallel training pieces: gradient buffers, the distributed optimizer (ZeRO-1), loss
scaling, gradient clipping and checkpoints (Megatron-Core names).

================================  ===========================================================
name                              what
================================  ===========================================================
:class:`DistributedDataParallel`  ``.main_grad`` views into contiguous buffers (one per
                                  param dtype / grad dtype / dense-or-expert), buckets reduced
                                  from backward hooks; ``no_sync()``, ``finish_grad_sync()``,
                                  ``zero_grad_buffer()``
:class:`DistributedOptimizer`     ZeRO-1 around a torch optimizer: fp32 main params and state
                                  for this rank's shard, step, all-gather; ``param_range_map``
                                  (world / local / param ranges), ``bytes_per_parameter()``
:class:`DynamicLossScaler`        fp16 loss scale; found-inf reduced over every rank
:func:`clip_grad_norm`            global norm of a TP/PP/EP/DP model, each element once
:func:`save_checkpoint` /         sharded model + optimizer checkpoint (each rank its shard),
:func:`load_checkpoint`           loadable at another data-parallel size (same TP/PP/EP)
:func:`get_full_state_dict` /     unsharded ``state_dict`` with the original names from a
:func:`load_full_state_dict`      tensor/expert-parallel model, and its inverse
:func:`bytes_per_parameter_formula`  the bytes-per-parameter table: ``P + G + (M + MG + S) / d``
================================  ===========================================================

A training loop (after ``mtp.parallel.initialize_model_parallel(...)``)::

    model = DistributedDataParallel(model, use_distributed_optimizer=True,
                                    accumulate_allreduce_grads_in_fp32=True)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=3e-4, weight_decay=0.1,
                               clip_grad=1.0)
    for batch in batches:
        opt.zero_grad()                                   # zeroes the grad buffers
        for i, micro in enumerate(batch):                 # gradient accumulation
            ctx = model.no_sync() if i < len(batch) - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model(micro.x), micro.y) / len(batch)
                opt.scale_loss(loss).backward()           # last one: reduce-scatter from hooks
        ok, grad_norm, _ = opt.step()                     # wait, clip, step shard, all-gather
    save_checkpoint("ckpt", model, opt)                   # every rank writes its shard
"""

from .checkpointing import (
    get_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from .clip_grads import clip_grad_norm, get_grad_norm, param_is_not_duplicate
from .distributed import DistributedDataParallel, is_expert_param
from .grad_buffer import Bucket, ParamAndGradBuffer, Range, param_range_map
from .grad_scaler import DynamicGradScaler, DynamicLossScaler
from .optimizer import (
    OPTIMIZER_STATE_BYTES,
    DistributedOptimizer,
    ShardEntry,
    bytes_per_parameter_formula,
)

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "Bucket",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "DynamicLossScaler",
    "ParamAndGradBuffer",
    "Range",
    "ShardEntry",
    "bytes_per_parameter_formula",
    "clip_grad_norm",
    "get_full_state_dict",
    "get_grad_norm",
    "is_expert_param",
    "load_checkpoint",
    "load_full_state_dict",
    "param_is_not_duplicate",
    "param_range_map",
    "save_checkpoint",
]
