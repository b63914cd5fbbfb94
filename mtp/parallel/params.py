"""How each parameter's gradient is reduced: the parameter attributes, in one place.

The layers mark their parameters; :class:`mtp.optim.DistributedDataParallel`, the gradient norm
and clipping (:func:`mtp.optim.clip_grad_norm`, :class:`mtp.optim.DistributedOptimizer`), the
full and sharded checkpoints and :func:`mtp.tensor_parallel.mark_sequence_parallel_parameters`
read them only through the functions here, so they cannot disagree.

Attributes (Megatron-Core's names where it has one):

``tensor_model_parallel = True`` (with ``partition_dim``, ``partition_stride``)
    A shard: different on every rank of its tensor-parallel group, the dense tensor-parallel
    group for a dense parameter, the expert-tensor-parallel group for an expert parameter. Its
    gradient is complete on each rank; every rank counts it in the global norm.
``allreduce = False``
    An expert parameter: its gradient is reduced over the expert-data-parallel group (not the
    data-parallel group). Without ``tensor_model_parallel`` it is replicated over the
    expert-tensor-parallel group with the same, complete gradient on every rank of it.
``sequence_parallel = True``
    Replicated over the tensor-parallel group, but each rank's gradient covers only its own
    sequence chunk (LayerNorm weights and biases added after a reduce-scatter under sequence
    parallelism): summed over the tensor-parallel group after the backward
    (``DistributedDataParallel.finish_grad_sync``, or
    :func:`mtp.tensor_parallel.allreduce_sequence_parallel_grads`).
``tensor_parallel_grad_reduced = True``
    Replicated over the tensor-parallel group, its gradient already summed over that group
    inside the backward (the weight entered the region through
    ``copy_to_tensor_model_parallel_region``: the router and shared expert of a
    :class:`mtp.moe.MoELayer` at ``tp > 1``). Complete on every rank: nothing more is summed,
    and sequence-parallel marking leaves it alone.

A parameter without any of them is replicated over the tensor-parallel group with a complete
gradient on every rank (it saw every token), counted on tensor-parallel rank 0.
Contradictory combinations (a shard that is also sequence-parallel, an expert that is
sequence-parallel, ...) are refused by :func:`check_param_attributes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = [
    "ParamReduction",
    "check_param_attributes",
    "is_expert_param",
    "mark_tensor_parallel_grad_reduced",
    "param_is_not_tensor_parallel_duplicate",
    "param_is_sequence_parallel",
    "param_is_tensor_parallel",
    "param_reduction",
    "set_expert_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

#: The attribute names (see the module docstring).
TENSOR_MODEL_PARALLEL = "tensor_model_parallel"
ALLREDUCE = "allreduce"
SEQUENCE_PARALLEL = "sequence_parallel"
GRAD_REDUCED = "tensor_parallel_grad_reduced"


@dataclasses.dataclass(frozen=True)
class ParamReduction:
    """What a parameter's attributes say (see the module docstring).

    Attributes:
        expert: an expert parameter (``allreduce = False``).
        sharded: a tensor-parallel shard (over the expert-tensor-parallel group when ``expert``).
        sequence_parallel: partial gradient, summed over the tensor-parallel group after the
            backward.
        grad_reduced: replicated, gradient already summed over the tensor-parallel group in the
            backward.
    """

    expert: bool = False
    sharded: bool = False
    sequence_parallel: bool = False
    grad_reduced: bool = False

    @property
    def data_parallel_group(self) -> str:
        """``"edp"`` or ``"dp"``: where the data-parallel reduction runs."""
        return "edp" if self.expert else "dp"

    @property
    def tensor_parallel_group(self) -> str:
        """``"etp"`` or ``"tp"``: the group it is sharded or replicated over."""
        return "etp" if self.expert else "tp"

    @property
    def kind(self) -> str:
        """A short name: ``"expert_tensor_parallel"``, ``"expert"``, ``"tensor_parallel"``,
        ``"sequence_parallel"``, ``"tensor_parallel_grad_reduced"`` or ``"replicated"``."""
        if self.expert:
            return "expert_tensor_parallel" if self.sharded else "expert"
        if self.sharded:
            return "tensor_parallel"
        if self.sequence_parallel:
            return "sequence_parallel"
        return "tensor_parallel_grad_reduced" if self.grad_reduced else "replicated"


def is_expert_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (Megatron's marker ``allreduce = False``)."""
    return getattr(param, ALLREDUCE, True) is False


def param_is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a tensor-parallel shard (different on every rank of its group)."""
    return bool(getattr(param, TENSOR_MODEL_PARALLEL, False))


def param_is_sequence_parallel(param: torch.Tensor) -> bool:
    """True when the gradient must be summed over the tensor-parallel group after the
    backward (``sequence_parallel = True``)."""
    return bool(getattr(param, SEQUENCE_PARALLEL, False))


def param_reduction(param: torch.Tensor) -> ParamReduction:
    """The :class:`ParamReduction` ``param``'s attributes describe (unchecked)."""
    return ParamReduction(
        expert=is_expert_param(param),
        sharded=param_is_tensor_parallel(param),
        sequence_parallel=param_is_sequence_parallel(param),
        grad_reduced=bool(getattr(param, GRAD_REDUCED, False)),
    )


def check_param_attributes(param: torch.Tensor, name: str = "parameter") -> ParamReduction:
    """:func:`param_reduction`, or ``ValueError`` naming ``name`` when the attributes
    contradict each other (the gradient would be summed twice, or over the wrong ranks)."""
    r = param_reduction(param)
    clashes = []
    if r.sequence_parallel and r.sharded:
        clashes.append("tensor_model_parallel=True and sequence_parallel=True (a shard's "
                       "gradient is complete; only replicated parameters are sequence-parallel)")
    if r.sequence_parallel and r.grad_reduced:
        clashes.append("sequence_parallel=True and tensor_parallel_grad_reduced=True (the "
                       "gradient would be summed over the tensor-parallel group twice)")
    if r.sharded and r.grad_reduced:
        clashes.append("tensor_model_parallel=True and tensor_parallel_grad_reduced=True")
    if r.expert and (r.sequence_parallel or r.grad_reduced):
        clashes.append("allreduce=False (expert) with sequence_parallel / "
                       "tensor_parallel_grad_reduced (expert gradients are complete over the "
                       "expert groups; they are reduced over the expert-data-parallel group)")
    if clashes:
        raise ValueError(f"{name}: contradictory parallel attributes: " + "; ".join(clashes))
    return r


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int | Sequence[int] = 1
) -> None:
    """Mark ``param`` as a shard (Megatron-Core's ``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride`` attributes)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_expert_parallel_attributes(
    param: torch.Tensor,
    *,
    is_parallel: bool = False,
    dim: int = 0,
    stride: int | Sequence[int] = 1,
) -> None:
    """Mark ``param`` as an expert parameter (``allreduce = False``); ``is_parallel``: a shard
    over the expert-tensor-parallel group along ``dim`` (``stride`` blocks, as
    :func:`set_tensor_model_parallel_attributes`)."""
    param.allreduce = False
    set_tensor_model_parallel_attributes(param, is_parallel, dim, stride)


def mark_tensor_parallel_grad_reduced(param: torch.Tensor) -> None:
    """Mark a replicated ``param`` whose gradient the layer sums over the tensor-parallel group
    in the backward (``tensor_parallel_grad_reduced = True``, never ``sequence_parallel``)."""
    param.tensor_parallel_grad_reduced = True
    param.sequence_parallel = False


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tp_rank: int | None = None, etp_rank: int | None = None
) -> bool:
    """Whether this rank's copy of ``param`` is the one counted over its tensor-parallel group
    (Megatron-Core's ``param_is_not_tensor_parallel_duplicate``): every shard, and replicated
    parameters on rank 0 of the group (the expert-tensor-parallel group for expert parameters).
    ``tp_rank``/``etp_rank``: None reads them from ``mtp.parallel`` (0 when not initialized)."""
    r = param_reduction(param)
    if r.sharded:
        return True
    rank = etp_rank if r.expert else tp_rank
    if rank is None:
        from mtp.parallel import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return True
        rank = ps.get_group_rank(r.tensor_parallel_group)
    return rank == 0
