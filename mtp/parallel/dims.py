"""The parallel dimensions of one layer, as one validated value: :class:`ParallelDims`.

torchtitan's ``ParallelDims`` is the model: sizes and groups are checked once, when the value is
made, and the value is passed explicitly to what communicates (the MoE dispatchers, the MoE
layer) instead of group attributes being set on those objects from outside.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from . import parallel_state as ps
from .groups import group_from_mesh

__all__ = ["ParallelDims"]

_DIMS = ("tp", "ep", "etp", "dp", "pp")
_GROUP_ARGS = {"tp": "tp_group", "ep": "ep_group", "etp": "etp_group", "dp": "dp_group",
               "pp": "pp_group"}  # fmt: skip


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Sizes and process groups of tensor (``tp``), expert (``ep``), expert-tensor (``etp``),
    data (``dp``) and pipeline (``pp``) parallelism, as one layer sees them.

    Give the groups (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None); each size is then its
    group's size, and a group of one rank is stored as None. A size may be given too: it must
    match the group's, and a size above 1 needs its group. ``*_rank`` are this rank's index in
    each group (0 without one). Checked in ``__post_init__``: ``TypeError``/``ValueError``
    naming the field.
    """

    tp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    etp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    tp: int | None = None
    ep: int | None = None
    etp: int | None = None
    dp: int | None = None
    pp: int | None = None
    tp_rank: int = dataclasses.field(init=False, default=0)
    ep_rank: int = dataclasses.field(init=False, default=0)
    etp_rank: int = dataclasses.field(init=False, default=0)
    dp_rank: int = dataclasses.field(init=False, default=0)
    pp_rank: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        for dim in _DIMS:
            arg = _GROUP_ARGS[dim]
            group = group_from_mesh(getattr(self, arg), arg)
            if group is not None and not isinstance(group, dist.ProcessGroup):
                raise TypeError(
                    f"ParallelDims: {arg} must be a torch.distributed.ProcessGroup, a 1-D "
                    f"DeviceMesh or None, got {type(group).__name__}"
                )
            size, given = _size(group), getattr(self, dim)
            if given is not None:
                if isinstance(given, bool) or not isinstance(given, int) or given < 1:
                    raise ValueError(f"ParallelDims: {dim} must be an int >= 1, got {given!r}")
                if given != size:
                    raise ValueError(
                        f"ParallelDims: {dim}={given} but {arg} has {size} rank(s)"
                        + ("; pass the group" if group is None else "")
                    )
            rank = 0 if group is None else dist.get_rank(group)
            object.__setattr__(self, arg, group if size > 1 else None)
            object.__setattr__(self, dim, size)
            object.__setattr__(self, f"{dim}_rank", rank if size > 1 else 0)

    @classmethod
    def from_parallel_state(cls, **overrides) -> ParallelDims:
        """The groups of :func:`mtp.parallel.initialize_model_parallel` (``etp`` is its expert
        tensor-parallel group, Megatron's default ``expert_tensor_parallel_size = tp``);
        ``overrides``: groups to use instead (``ep_group=...``)."""
        groups = dict(
            tp_group=ps.get_tensor_model_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
        )
        groups.update(overrides)
        return cls(**groups)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}={getattr(self, d)}" for d in _DIMS)
        return f"ParallelDims({sizes})"
