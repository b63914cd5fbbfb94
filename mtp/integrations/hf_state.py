"""Full, HF-named state dicts of a model split by :func:`mtp.integrations.hf.parallelize_hf` or
:func:`~mtp.integrations.hf.apply_kernels`.

:func:`attach_hf_state` (run by both) hooks ``state_dict`` and ``load_state_dict`` of every
module that renames or splits a tensor, so the model's own state dict is the Hugging Face one:
``model.state_dict()`` returns each tensor under its HF name, in its HF layout and full shape
(shards gathered over their group: a collective at tp > 1 or ep > 1, as ``save_pretrained``
from every rank does; gathered tensors are on the CPU, as HF's own tensor-parallel save puts
them), and ``model.load_state_dict`` takes such a dict (each rank copies its
slices; a tensor that already has the shard's shape, or a tensor under mtp's name, is taken as
it is). ``state_dict(keep_vars=True)`` still returns the live parameters and buffers: mtp's
names, this rank's shards. :func:`hf_state_dict` is the same state dict (copied) or the
gradients in it; :func:`load_hf_state_dict` reads each rank's slices from a checkpoint without
loading the full tensors.
"""

from __future__ import annotations

import glob
import itertools
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from mtp.parallel.mappings import gather_along
from mtp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mtp.tensor_parallel.embedding import VocabParallelEmbedding

__all__ = ["attach_hf_state", "hf_state_dict", "load_hf_state_dict"]

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
        return 0, (info["num_experts"],), "experts"
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    transposed = "conv1d" if module_name in info["conv1d"] and pname == "weight" else None
    if isinstance(module, ColumnParallelLinear):
        return 0, tuple(module._blocks), transposed
    if isinstance(module, RowParallelLinear) and pname == "weight":
        return 1, tuple(module._blocks), transposed
    if isinstance(module, VocabParallelEmbedding):
        return 0, (module.num_embeddings,), None
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
    """The full tensor in HF layout (collective over ``group`` when split; ``t`` itself,
    detached, when nothing changes)."""
    if spec is None:
        return t.detach()
    dim, blocks, transform = spec
    world = _rank_world(group)[1]
    if world == 1:
        return _transform(t.detach(), transform).contiguous()
    stacked = gather_along(t.detach().unsqueeze(0), 0, group)  # [world, *local]
    sizes = [b // world for b in blocks]
    per_rank = [s.split(sizes, dim) for s in stacked.unbind(0)]
    full = torch.cat([torch.cat([r[i] for r in per_rank], dim) for i in range(len(blocks))], dim)
    return _transform(full, transform).contiguous()


# --------------------------------------------------------------------------------------------
# state_dict / load_state_dict hooks
# --------------------------------------------------------------------------------------------

#: The attribute each hooked module carries: its ``_Entry`` tuple.
_ENTRIES = "_mtp_hf_entries"


class _Entry(NamedTuple):
    """A tensor a hooked module renames or splits. ``local``: its name under the module;
    ``hf``: its HF name(s) under the module (two for a shared expert's ``linear_fc1``: gate and
    up, stacked on dim 0); ``spec``: :func:`_split_spec`; ``group``: what it is split over."""

    local: str
    hf: tuple[str, ...]
    spec: tuple | None
    group: object


def _hooked_entries(model: nn.Module) -> dict[str, list[_Entry]]:
    """``{module name: entries}``: each swapped MoE block (its renamed tensors) and each split
    linear / embedding layer (its split parameters, names unchanged)."""
    info = _info(model)
    renames = info["renames"]
    blocks = [n[: -len(".router.weight")] for n in renames if n.endswith(".router.weight")]
    out: dict[str, list[_Entry]] = {b: [] for b in blocks}
    for name, (hf, _) in renames.items():
        block = next(b for b in blocks if name.startswith(b + "."))
        cut = len(block) + 1
        hf = hf if isinstance(hf, tuple) else (hf,)
        spec = _split_spec(model, name)
        out[block].append(
            _Entry(name[cut:], tuple(h[cut:] for h in hf), spec, _spec_group(model, spec))
        )
    for name, _ in model.named_parameters(remove_duplicate=False):  # tied: under both owners
        spec = None if name in renames else _split_spec(model, name)
        if spec is not None:
            module_name, _, pname = name.rpartition(".")
            entry = _Entry(pname, (pname,), spec, _spec_group(model, spec))
            out.setdefault(module_name, []).append(entry)
    return out


def _live(module: nn.Module, local: str) -> torch.Tensor | None:
    owner, _, leaf = local.rpartition(".")
    owner = module.get_submodule(owner) if owner else module
    found = owner._parameters.get(leaf)
    return owner._buffers.get(leaf) if found is None else found


def _to_hf(module: nn.Module, tensors: dict, prefix: str, memo: dict | None,
           offload: bool = True) -> None:  # fmt: skip
    """Replace ``module``'s tensors in ``tensors`` (keys ``prefix + local``) by their HF
    entries, in place, keeping the module's order (collective for split tensors; ``offload``:
    the gathered ones go to the CPU, so the device holds one full tensor at a time). ``memo``:
    tensors already gathered in this call, by live tensor: tied weights come out as one."""
    entries = {e.local: e for e in getattr(module, _ENTRIES)}
    for key in [k for k in tensors if k.startswith(prefix)]:
        value = tensors.pop(key)
        e = entries.get(key[len(prefix) :])
        if e is None:
            tensors[key] = value
            continue
        live = _live(module, e.local)
        mkey = (id(live), live._version, e.spec)
        full = None if memo is None else memo.get(mkey)
        if full is None:
            full = _full_tensor(value, e.spec, e.group)
            if offload and e.spec is not None and _rank_world(e.group)[1] > 1:
                full = full.cpu()
            if memo is not None:
                memo[mkey] = full
        parts = [p.clone() for p in full.chunk(len(e.hf), 0)] if len(e.hf) > 1 else [full]
        for name, part in zip(e.hf, parts):
            tensors[prefix + name] = part


#: Per-expert ``(gate, up, down)`` names under ``experts.<i>.`` in the original checkpoint
#: format (what ``save_pretrained`` writes by default: transformers' conversion mapping
#: reversed): Qwen2/3-MoE and DeepSeek-V3, Mixtral.
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: ``family: (old, new)``: module names the original format has under another name.
_ORIGINAL_NAMES = {"mixtral": (".block_sparse_moe.", ".mlp.")}


def _merge_per_expert(state_dict: dict, prefix: str, experts: int) -> None:
    """Stack an MoE block's per-expert tensors of the original checkpoint format into HF's
    ``experts.gate_up_proj [E, 2F, H]`` and ``experts.down_proj [E, H, F]``, in place."""
    if prefix + "experts.gate_up_proj" in state_dict:
        return
    for names in _PER_EXPERT:
        keys = [[f"{prefix}experts.{i}.{n}.weight" for i in range(experts)] for n in names]
        if all(k in state_dict for k in itertools.chain(*keys)):
            gate, up, down = (torch.stack([state_dict.pop(k) for k in ks]) for ks in keys)
            state_dict[prefix + "experts.gate_up_proj"] = torch.cat([gate, up], 1)
            state_dict[prefix + "experts.down_proj"] = down
            return


def _from_hf(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """Replace the HF entries of ``module`` in ``state_dict`` by this rank's shards under
    mtp's names, in place (experts also from the original per-expert format). Left as they
    are: entries absent (or incomplete), tensors under mtp's names, and split tensors that
    already have the shard's shape."""
    for e in getattr(module, _ENTRIES):
        if e.spec is not None and e.spec[2] == "experts":
            _merge_per_expert(state_dict, prefix, e.spec[1][0])
        keys = [prefix + h for h in e.hf]
        if not all(k in state_dict for k in keys):
            continue
        live = _live(module, e.local)
        if e.hf == (e.local,) and tuple(state_dict[keys[0]].shape) == tuple(live.shape):
            continue
        rank, world = _rank_world(e.group)
        parts = [
            _read_shard(lambda idx, t=t: t[idx], tuple(t.shape), e.spec, rank, world)
            for t in (state_dict.pop(k) for k in keys)
        ]
        state_dict[prefix + e.local] = torch.cat(parts).contiguous()


def _hook(module: nn.Module, entries: list[_Entry], memo_box: dict) -> None:
    setattr(module, _ENTRIES, tuple(entries))
    loading = {}

    def save(module, destination, prefix, local_metadata):
        first = getattr(module, _ENTRIES)[0].local
        if destination.get(prefix + first) is _live(module, first):
            return  # keep_vars=True: the live tensors, as mtp holds them
        _to_hf(module, destination, prefix, memo_box.get("memo"))

    def load_pre(module, state_dict, prefix, *args):
        loading["prefix"] = prefix
        _from_hf(module, state_dict, prefix)

    def load_post(module, incompatible):
        prefix, missing = loading.pop("prefix", ""), incompatible.missing_keys
        for e in getattr(module, _ENTRIES):
            if prefix + e.local in missing and e.hf != (e.local,):
                i = missing.index(prefix + e.local)
                missing[i : i + 1] = [prefix + h for h in e.hf]

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load_pre)
    module.register_load_state_dict_post_hook(load_post)


def attach_hf_state(model: nn.Module, info: dict) -> None:
    """Record ``info`` (group, family, renames...) on a model split by ``parallelize_hf`` /
    ``apply_kernels`` and hook its state dict (see the module docstring): every module that
    renames or splits a tensor converts it on ``state_dict`` and ``load_state_dict``; the model
    itself keeps a memo during ``state_dict`` so tied weights are gathered once and stay one
    tensor."""
    setattr(model, _INFO, info)
    hooked = _hooked_entries(model)
    if not hooked:
        return
    memo_box: dict = {}
    for name, entries in hooked.items():
        _hook(model.get_submodule(name), entries, memo_box)

    def start(module, prefix, keep_vars):
        memo_box["memo"] = {}

    def finish(module, state_dict, prefix, local_metadata):
        memo_box.pop("memo", None)

    model.register_state_dict_pre_hook(start)
    model.register_state_dict_post_hook(finish)
    if info["family"] in _ORIGINAL_NAMES:
        old, new = _ORIGINAL_NAMES[info["family"]]

        def rename(module, state_dict, prefix, *args):
            for key in [k for k in state_dict if old in k[len(prefix) :]]:
                state_dict[prefix + key[len(prefix) :].replace(old, new)] = state_dict.pop(key)

        model.register_load_state_dict_pre_hook(rename)


def hf_state_dict(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a parallelized model, in the HF names and layouts
    (GPT-2's ``Conv1D`` weights transposed back), equal to ``model.state_dict()`` of the
    unparallelised model: ``model.state_dict()`` with every tensor that shares memory with the
    model copied. Collective: call it on every rank of the group; every rank gets all tensors.
    ``grads=True`` returns the parameters' gradients instead (None grads skipped; gathered
    ones on their device)."""
    _info(model)
    live = [*model.parameters(), *model.buffers()]
    if grads:
        out = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        out = {n: g for n, g in out.items() if g is not None}
        live += list(out.values())
        memo: dict = {}
        for name, module in model.named_modules():
            if hasattr(module, _ENTRIES):
                _to_hf(module, out, f"{name}." if name else "", memo, offload=False)
    else:
        out = model.state_dict()
    shared = {t.untyped_storage().data_ptr() for t in live}
    copies: dict[tuple, torch.Tensor] = {}
    for key, value in out.items():
        if value.untyped_storage().data_ptr() in shared:  # a view of the model: copy it
            view = (value.data_ptr(), value.shape, value.stride())
            if view not in copies:
                copies[view] = value.detach().clone()
            out[key] = copies[view]
    return dict(out)


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
