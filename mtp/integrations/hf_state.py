"""Full, HF-named state dicts of a model split by :func:`mtp.integrations.hf.parallelize_hf` or
:func:`~mtp.integrations.hf.apply_kernels`: :func:`hf_state_dict` gathers every tensor (and its
gradient) back under its Hugging Face name, :func:`load_hf_state_dict` reads each rank's slices
from a checkpoint or a state dict.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from mtp.parallel.mappings import gather_along
from mtp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mtp.tensor_parallel.embedding import VocabParallelEmbedding

__all__ = ["hf_state_dict", "load_hf_state_dict"]

#: The attribute parallelize_hf / apply_kernels leave on the model: group, family, renames...
_INFO = "_mtp_hf"


def _num_experts(config) -> int:
    return (
        getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or getattr(config, "n_routed_experts", None)
        or 0
    )


# --------------------------------------------------------------------------------------------
# State dicts
# --------------------------------------------------------------------------------------------


def _info(model: nn.Module) -> dict:
    info = getattr(model, _INFO, None)
    if info is None:
        raise ValueError("the model was not parallelized with mtp.integrations.hf.parallelize_hf")
    return info


def _hf_name(model: nn.Module, name: str):
    """The HF name of one of the model's tensors (MoE blocks renamed theirs); a ``(gate, up)``
    pair for a shared expert's ``linear_fc1`` (the two HF tensors stacked on dim 0)."""
    renamed = _info(model)["renames"].get(name)
    return name if renamed is None else renamed[0]


def _split_spec(model: nn.Module, name: str):
    """``(dim, blocks, transform)`` of a sharded parameter in its HF layout (``transform``:
    None, ``"conv1d"`` for a transposed GPT-2 weight, ``"experts"`` for ``[E, N, K]`` expert
    weights stored ``[E, K, N]`` by mtp), or None if replicated."""
    info = _info(model)
    renamed = info["renames"].get(name)
    if renamed is not None:
        if renamed[1] != "experts":
            return None
        return 0, [info["num_experts"]], "experts"
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    transposed = "conv1d" if module_name in info["conv1d"] and pname == "weight" else None
    if isinstance(module, ColumnParallelLinear):
        return 0, module._blocks, transposed
    if isinstance(module, RowParallelLinear) and pname == "weight":
        return 1, module._blocks, transposed
    if isinstance(module, VocabParallelEmbedding):
        return 0, [module.num_embeddings], None
    return None


def _transform(t: torch.Tensor, transform) -> torch.Tensor:
    """mtp layout <-> HF layout (both transforms are their own inverse)."""
    if transform == "conv1d":
        return t.t()
    if transform == "experts":
        return t.transpose(1, 2)
    return t


def _spec_group(model: nn.Module, spec):
    """The group a tensor with split ``spec`` is split over: the expert-parallel group for
    experts, else the tensor-parallel group (None: not split, one rank)."""
    info = _info(model)
    if spec is not None and spec[2] == "experts":
        return info.get("ep_group", info["group"])
    return info["group"]


def _rank_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _full_tensor(t: torch.Tensor, spec, group) -> torch.Tensor:
    if spec is None:
        return t.detach().clone()
    dim, blocks, transform = spec
    world = _rank_world(group)[1]
    if world == 1:
        return _transform(t.detach(), transform).contiguous().clone()
    stacked = gather_along(t.detach().unsqueeze(0), 0, group)  # [world, *local]
    sizes = [b // world for b in blocks]
    per_rank = [s.split(sizes, dim) for s in stacked.unbind(0)]
    full = torch.cat([torch.cat([r[i] for r in per_rank], dim) for i in range(len(blocks))], dim)
    return _transform(full, transform).contiguous()


def hf_state_dict(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a parallelized model, in the HF names and layouts
    (GPT-2's ``Conv1D`` weights transposed back), equal to ``model.state_dict()`` of the
    unparallelised model. Collective: call it on every rank of the group; every rank gets all
    tensors. ``grads=True`` returns the parameters' gradients instead (None grads skipped)."""
    out: dict[str, torch.Tensor] = {}
    memo: dict[int, torch.Tensor] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in model.state_dict(keep_vars=True).items():
        if grads:
            if name not in params or value.grad is None:
                continue
            tensor = value.grad
        else:
            tensor = value
        if id(value) not in memo:
            spec = _split_spec(model, name) if name in params else None
            memo[id(value)] = _full_tensor(tensor, spec, _spec_group(model, spec))
        key = _hf_name(model, name)
        if isinstance(key, tuple):  # shared expert fc1 -> gate_proj, up_proj
            for k, part in zip(key, memo[id(value)].chunk(len(key), 0)):
                out[k] = part.clone()
        else:
            out[key] = memo[id(value)]
    return out


def _open_source(source):
    """``name -> getter(index) -> tensor`` over a state dict, a safetensors file or folder."""
    if isinstance(source, Mapping):
        return {k: (lambda idx, t=v: t[idx]) for k, v in source.items()}, {
            k: tuple(v.shape) for k, v in source.items()
        }
    from safetensors import safe_open

    path = os.fspath(source)
    files = [path]
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"load_hf_state_dict: no *.safetensors file in {path!r}")
    getters, shapes = {}, {}
    for file in files:
        handle = safe_open(file, framework="pt")
        for key in handle.keys():
            sl = handle.get_slice(key)
            getters[key] = lambda idx, sl=sl: sl[idx]
            shapes[key] = tuple(sl.get_shape())
    return getters, shapes


def _read_shard(get, shape, spec, rank: int, world: int) -> torch.Tensor:
    if spec is None:
        return get(tuple(slice(None) for _ in shape))
    dim, blocks, transform = spec
    stored_dim = 1 - dim if transform == "conv1d" else dim
    pieces, offset = [], 0
    for b in blocks:
        n = b // world
        idx = [slice(None)] * len(shape)
        idx[stored_dim] = slice(offset + rank * n, offset + (rank + 1) * n)
        pieces.append(get(tuple(idx)))
        offset += b
    return _transform(torch.cat(pieces, stored_dim), transform)


def load_hf_state_dict(model: nn.Module, source, *, strict: bool = True) -> list[str]:
    """Load full HF weights into a parallelized model; each rank copies only its slices.

    Args:
        model: returned by :func:`parallelize_hf`.
        source: a state dict (HF names, full tensors), a ``.safetensors`` file, or a folder of
            them (only this rank's slices are read from disk).
        strict: raise ``KeyError`` when a parameter is missing from ``source``.

    Returns:
        The names of the parameters that were not found (empty when ``strict``).
    """
    getters, shapes = _open_source(source)
    missing = []
    renamed_buffers = [
        (n, model.get_buffer(n)) for n, (_, k) in _info(model)["renames"].items() if k == "buffer"
    ]
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *renamed_buffers]:
            key = _hf_name(model, name)
            keys = key if isinstance(key, tuple) else (key,)
            absent = [k for k in keys if k not in getters]
            if absent:
                missing.extend(absent)
                continue
            spec = _split_spec(model, name)
            rank, world = _rank_world(_spec_group(model, spec))
            value = torch.cat([_read_shard(getters[k], shapes[k], spec, rank, world) for k in keys])
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"load_hf_state_dict: {key}: the shard has shape {tuple(value.shape)}, the "
                    f"model's parameter {tuple(param.shape)} (a checkpoint of another config?)"
                )
            param.copy_(value)
    if missing and strict:
        raise KeyError(f"load_hf_state_dict: missing from the source: {missing}")
    return missing
