"""Gradient norm and clipping over a tensor-, pipeline-, expert- and data-parallel model.

Each gradient element is counted once in the whole job (the parameter attributes of
:mod:`mtp.parallel.params` say where it lives):

- a tensor-parallel shard (``tensor_model_parallel = True``) on every rank of its group (the
  expert-tensor-parallel group for an expert parameter);
- a parameter replicated over the tensor-parallel group only on tensor-parallel rank 0
  (Megatron's ``param_is_not_tensor_parallel_duplicate``); a replicated expert parameter
  (``allreduce = False``) on expert-tensor-parallel rank 0;
- replicated data-parallel gradients (after the all-reduce) only on data-parallel rank 0 (the
  expert-data-parallel rank for expert parameters); with the distributed optimizer each rank
  counts its own shard instead, which holds every element exactly once.

The local sums of ``|g|^p`` (or the local max for ``inf``) are then reduced in one all-reduce
over the world (every rank must call), so the norm is the single-process norm of the same model.
Nothing is read on the host: the norm stays a device tensor and clipping multiplies by
``min(1, max_norm / (norm + 1e-6))`` unconditionally (``torch.nn.utils.clip_grad_norm_``'s
convention).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mtp.parallel.params import check_param_attributes, param_is_not_tensor_parallel_duplicate

from .distributed import DistributedDataParallel

__all__ = ["clip_grad_norm", "get_grad_norm", "param_is_not_duplicate"]


def _ranks() -> dict[str, int] | None:
    from mtp import parallel

    if not parallel.model_parallel_is_initialized():
        return None
    return {
        "tp": parallel.get_tensor_model_parallel_rank(),
        "etp": parallel.get_expert_tensor_parallel_rank(),
        "dp": parallel.get_data_parallel_rank(with_context_parallel=True),
        "edp": parallel.get_expert_data_parallel_rank(),
    }


def param_is_not_duplicate(param: torch.Tensor, *, sharded: bool = False) -> bool:
    """Whether this rank counts ``param``'s gradient in the global norm (module docstring).

    ``sharded=True``: the gradient is this rank's data-parallel shard (distributed optimizer),
    so the data-parallel rank does not matter. Without ``mtp.parallel`` every rank counts every
    gradient (and no reduction happens).
    """
    ranks = _ranks()
    if ranks is None:
        return True
    r = check_param_attributes(param)
    if not sharded and ranks[r.data_parallel_group] != 0:
        return False
    return param_is_not_tensor_parallel_duplicate(param, ranks["tp"], ranks["etp"])


def _check_norm_type(norm_type) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)) or math.isnan(norm_type):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    return norm_type


def _reduce_group():
    """The world when mtp.parallel (hence possibly several model-parallel ranks) is set up."""
    return dist.group.WORLD if _ranks() is not None else None


def get_grad_norm(
    grads: list[torch.Tensor],
    counted: list[bool],
    norm_type: float = 2.0,
    group=None,
) -> torch.Tensor:
    """The ``norm_type`` norm (fp32 device tensor) of the ``counted`` ``grads``, reduced over
    ``group`` (None: no reduction)."""
    norm_type = _check_norm_type(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if not grads and group is not None and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = [g for g, c in zip(grads, counted) if c and g.numel()]
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in mine:
            local = torch.maximum(local, g.detach().abs().max().float())
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in mine:
        local = local + torch.linalg.vector_norm(g.detach().float(), norm_type).pow(norm_type)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return local.pow(1.0 / norm_type)


def clip_grads_by_norm(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor):
    """Multiply ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def clip_grad_norm(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of a (tensor/expert/pipeline/data) parallel model by their global norm.

    Args:
        parameters: a module (a plain or ``parallelize()``d model, or a
            :class:`DistributedDataParallel` without the distributed optimizer after
            ``finish_grad_sync()``) or parameters; ``param.grad`` is used (None: skipped).
        max_norm: the largest norm allowed (> 0).
        norm_type: 2.0 by default; any p > 0 or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` when the norm is NaN or inf (a host sync).

    Returns:
        The total norm before clipping (0-d fp32 tensor on the gradients' device), equal on
        every rank. Call it on every rank (one all-reduce over the world with ``mtp.parallel``).

    With the distributed optimizer, pass ``clip_grad=`` to
    :class:`~mtp.optim.DistributedOptimizer` instead (each rank holds only its shard).
    """
    if isinstance(parameters, DistributedDataParallel) and parameters.use_distributed_optimizer:
        raise ValueError(
            "clip_grad_norm: parameters is a DistributedDataParallel model with "
            "use_distributed_optimizer=True, whose gradients are sharded; pass clip_grad=... to "
            "mtp.optim.DistributedOptimizer instead"
        )
    if isinstance(max_norm, bool) or not float(max_norm) > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters[{i}] is a {type(p).__name__}, not a tensor")
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    counted = [param_is_not_duplicate(p) for p in with_grad]
    total = get_grad_norm(grads, counted, norm_type, _reduce_group())
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)})"
        )
    clip_grads_by_norm(grads, float(max_norm), total)
    return total
