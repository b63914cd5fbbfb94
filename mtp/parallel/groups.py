"""Process-group plumbing shared by the mappings, the layers and the ops.

- :func:`group_from_mesh`: ``group=`` arguments accept a ``DeviceMesh`` (1-D, or one named
  dimension of a larger mesh: ``mesh["tp"]``) as well as a ``ProcessGroup``.
- :func:`group_name` / :func:`resolve_group_name`: a trace-safe way to pass a group through a
  ``torch.library`` custom op (which cannot take a ``ProcessGroup``): the name is the one
  ``torch.distributed`` registers every group under when it creates it, so nothing is mutated
  while ``torch.compile`` traces (a module-level registry filled as a side effect is deferred
  by Dynamo and missing when the compiled graph first runs).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_description", "group_from_mesh", "group_name", "resolve_group_name"]


try:
    from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh
except ImportError:  # pragma: no cover - torch without DeviceMesh
    _DeviceMesh = None


def group_from_mesh(group, what: str = "group"):
    """``group`` itself, or the process group of a 1-D ``DeviceMesh``.

    Raises:
        ValueError: a DeviceMesh with more than one dimension (name the dimension:
            ``mesh["tp"]``).
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if _DeviceMesh is None or not isinstance(group, _DeviceMesh):
        return group
    if group.ndim != 1:
        names = getattr(group, "mesh_dim_names", None)
        raise ValueError(
            f"{what}: a DeviceMesh with {group.ndim} dimensions {names} is ambiguous; pass one "
            "dimension of it, e.g. mesh['tp']"
        )
    return group.get_group()


def group_name(group: dist.ProcessGroup) -> str:
    """The name ``torch.distributed`` registered ``group`` under (traceable by Dynamo)."""
    return group.group_name


def resolve_group_name(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (see :func:`group_name`)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_description(group) -> str:
    """``"group of global ranks [0, 1]"`` (or the world) for messages."""
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - destroyed or foreign group: say what we can
        return "process group"
    return f"group of global ranks {ranks}"
