"""A ``torch.distributed.DeviceMesh`` view of the dense groups of
:func:`mtp.parallel.initialize_model_parallel`: :func:`get_device_mesh`."""

from __future__ import annotations

import torch.distributed as dist

from .parallel_state import get_process_group, get_rank_generators

__all__ = ["get_device_mesh"]

_MESH_KINDS = {"pp": "pp", "dp": "dp", "cp": "cp", "tp": "tp"}


def get_device_mesh(
    dims: tuple[str, ...] = ("pp", "dp", "cp", "tp"), device_type: str | None = None
):
    """A ``torch.distributed.DeviceMesh`` view of the dense groups, reusing them (no new group).

    Args:
        dims: the mesh dimensions, outermost first, each one of ``"pp"``, ``"dp"``, ``"cp"``,
            ``"tp"``; together they must cover the world (size-1 dimensions may be left out).
        device_type: ``"cuda"`` or ``"cpu"`` (default: ``"cuda"`` when the default group uses
            NCCL, else ``"cpu"``).

    ``mesh["tp"]`` can then be passed as ``group=`` to mtp's layers and ``parallelize``, and
    ``mesh["dp"]`` to FSDP2's ``fully_shard(model, mesh=mesh["dp"])``.

    Raises:
        ValueError: an unknown or repeated dimension, or dimensions that do not cover the world.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    dense, _ = get_rank_generators()
    if len(set(dims)) != len(dims) or any(d not in _MESH_KINDS for d in dims):
        raise ValueError(
            f"get_device_mesh: dims must be distinct names from {list(_MESH_KINDS)}, got {dims}"
        )
    axes = dense.order.split("-")
    sizes = dense.ordered_size
    missing = [a for a, n in zip(axes, sizes) if n > 1 and a not in dims]
    if missing:
        raise ValueError(f"get_device_mesh: dims {dims} leave out {missing}, which have size > 1")
    # rank = sum(coord[a] * stride[a]) with the first axis of ``order`` fastest
    grid = torch.arange(dense.world_size).reshape(list(reversed(sizes)))

    def axis(name: str) -> int:
        return len(axes) - 1 - axes.index(name)

    order = [axis(d) for d in dims] + [axis(a) for a in axes if a not in dims]
    mesh = grid.permute(order).reshape([dense.name_to_size[d] for d in dims])
    mesh = mesh + dense.rank_offset
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    groups = [get_process_group(_MESH_KINDS[d]) for d in dims]
    return DeviceMesh.from_group(
        groups if len(groups) > 1 else groups[0],
        device_type,
        mesh=mesh,
        mesh_dim_names=tuple(dims),
    )
