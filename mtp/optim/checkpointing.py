"""Checkpoints of a tensor/expert/data-parallel model and its distributed optimizer.

**Sharded** (:func:`save_checkpoint` / :func:`load_checkpoint`): every rank writes one file,
``shard_<rank>.pt``, holding for each parameter the elements it owns in the distributed
optimizer (the ``param`` range of :attr:`DistributedOptimizer.param_range_map`): the model
values, the fp32 main values and the per-element optimizer state; parameters the optimizer does
not own (frozen ones) and module buffers are written whole by data-parallel rank 0 of their
model-parallel slice. Rank 0 adds ``common.pt`` (parallel sizes, param-group hyperparameters,
loss-scaler state, ``extra``). Pieces are keyed by the parameter's name and its model-parallel
coordinates (``tp<r>.pp<r>`` for dense, ``ep<r>.etp<r>.pp<r>`` for expert parameters), never by
the data-parallel rank, so :func:`load_checkpoint` can read a checkpoint written at another
data-parallel size: each rank memory-maps the shard files and copies the overlaps of the saved
ranges with the ranges it now owns (resharding). Tensor and pipeline parallel sizes must be the
same, and so must the expert parallel sizes of a model with experts. (A plain per-rank
``torch.save`` rather than ``torch.distributed.checkpoint``: the optimizer's shards are arbitrary
element ranges of flattened parameters, which DCP's chunked tensors cannot describe without
gathering them.)

**Full** (:func:`get_full_state_dict` / :func:`load_full_state_dict`): the unsharded
``state_dict`` of the single-device model, with its original names, gathered from the
tensor-parallel shards (``tensor_model_parallel``/``partition_dim``/``partition_stride``; expert
shards over the expert-tensor-parallel group) and the expert-parallel ranks (expert tensors
along dim 0); and the inverse, each rank keeping its shard. Pipeline stages each export their
own parameters.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist
from torch import nn

from mtp.parallel.params import is_expert_param, param_reduction
from mtp.utils import qualified_name

from .distributed import DistributedDataParallel

__all__ = ["get_full_state_dict", "load_checkpoint", "load_full_state_dict", "save_checkpoint"]

_VERSION = 1


def _unwrap(model) -> nn.Module:
    if isinstance(model, DistributedDataParallel):
        return model.module
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {qualified_name(model)}")
    return model


def _wait_params(model) -> None:
    """Wait for parameter all-gathers still running (``overlap_param_gather``)."""
    if isinstance(model, DistributedDataParallel):
        for bucket in model.buckets:
            if bucket.param_work is not None:
                bucket.param_work[0].wait()
                bucket.param_work = None


def _parallel():
    from mtp import parallel

    return parallel if parallel.model_parallel_is_initialized() else None


def _sizes() -> dict[str, int]:
    ps = _parallel()
    if ps is None:
        return {"tp": 1, "pp": 1, "ep": 1, "etp": 1}
    s = ps.get_parallel_sizes()
    return {"tp": s.tp, "pp": s.pp, "ep": s.ep, "etp": s.etp}


def _mp_key(param: torch.Tensor) -> str:
    ps = _parallel()
    if ps is None:
        return ""
    pp = ps.get_pipeline_model_parallel_rank()
    if is_expert_param(param):
        ep, etp = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
        return f"ep{ep}.etp{etp}.pp{pp}"
    return f"tp{ps.get_tensor_model_parallel_rank()}.pp{pp}"


def _is_dp_first(param: torch.Tensor | None) -> bool:
    ps = _parallel()
    if ps is None:
        return not dist.is_initialized() or dist.get_rank() == 0
    if param is not None and is_expert_param(param):
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def save_checkpoint(directory: str, model: nn.Module, optimizer=None, *, extra=None) -> None:
    """Write this rank's part of ``model`` (and ``optimizer``) under ``directory``.

    Args:
        directory: created if needed; every rank must see the same directory.
        model: the model (a :class:`DistributedDataParallel` or a plain module).
        optimizer: a :class:`~mtp.optim.DistributedOptimizer` over ``model`` (or None).
        extra: any picklable object stored in ``common.pt`` (iteration, data state...).

    Call on every rank; returns after every rank has written (a barrier).
    """
    _wait_params(model)
    module = _unwrap(model)
    os.makedirs(directory, exist_ok=True)
    pieces: dict[str, list[dict]] = {}
    covered: set[int] = set()
    if optimizer is not None:
        optimizer.finish_param_sync()
        group_of = {
            id(p): i for i, g in enumerate(optimizer.optimizer.param_groups) for p in g["params"]
        }
        # every parameter the optimizer owns somewhere is written by its owners only
        covered = {id(p) for buf in optimizer.model.buffers for p in buf.params}
        for e in optimizer.shards:
            if not optimizer.sharded and not _is_dp_first(e.param):
                continue
            r = e.ranges["param"]
            state = optimizer.optimizer.state.get(e.main_param, {})
            per, scalars = {}, {}
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() and v.numel() == e.main_param.numel():
                    per[k] = _cpu(v)
                else:
                    scalars[k] = _cpu(v) if isinstance(v, torch.Tensor) else v
            pieces.setdefault(f"{e.name}|{_mp_key(e.param)}", []).append(
                {
                    "range": (r.start, r.end),
                    "numel": e.param.numel(),
                    "param": _cpu(e.model_slice),
                    "main": _cpu(e.main_param),
                    "state": per,
                    "scalars": scalars,
                    "group": group_of.get(id(e.main_param), 0),
                }
            )
    for name, p in module.named_parameters():
        if id(p) in covered or not _is_dp_first(p):
            continue
        flat = p.detach().reshape(-1)
        pieces.setdefault(f"{name}|{_mp_key(p)}", []).append(
            {"range": (0, flat.numel()), "numel": flat.numel(), "param": _cpu(flat)}
        )
    buffers = {}
    if _is_dp_first(None):
        buffers = {f"{n}|{_mp_key(b)}": _cpu(b) for n, b in module.named_buffers()}
    torch.save(
        {"version": _VERSION, "pieces": pieces, "buffers": buffers},
        os.path.join(directory, f"shard_{_rank():05d}.pt"),
    )
    if _rank() == 0:
        common = {"version": _VERSION, "sizes": _sizes(), "extra": extra}
        if optimizer is not None:
            common["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"}
                for g in optimizer.optimizer.param_groups
            ]
            if optimizer.grad_scaler is not None:
                common["grad_scaler"] = optimizer.grad_scaler.state_dict()
        torch.save(common, os.path.join(directory, "common.pt"))
    _barrier()


def _copy_overlaps(dst: torch.Tensor, dst_start: int, pieces: list[dict], field: str) -> int:
    """Copy the parts of ``pieces[i][field]`` (flat, covering ``range``) that fall in
    ``[dst_start, dst_start + dst.numel())``; returns the number of elements copied."""
    end, done = dst_start + dst.numel(), 0
    for piece in pieces:
        if field not in piece:
            continue
        a, b = piece["range"]
        lo, hi = max(a, dst_start), min(b, end)
        if lo >= hi:
            continue
        dst[lo - dst_start : hi - dst_start].copy_(piece[field][lo - a : hi - a])
        done += hi - lo
    return done


def _read_shards(directory: str) -> tuple[dict[str, list[dict]], dict[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(directory, "shard_*.pt")))
    if not files:
        raise FileNotFoundError(f"no shard_*.pt files under {directory!r}")
    pieces: dict[str, list[dict]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for f in files:
        blob = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        for key, ps in blob["pieces"].items():
            pieces.setdefault(key, []).extend(ps)
        buffers.update(blob["buffers"])
    return pieces, buffers


@torch.no_grad()
def load_checkpoint(directory: str, model: nn.Module, optimizer=None, *, strict: bool = True):
    """Load a checkpoint written by :func:`save_checkpoint`, possibly at another data-parallel
    size; returns its ``extra``.

    Raises:
        ValueError: the tensor/pipeline/expert parallel sizes differ from the saved ones, or
            (``strict``) a parameter or buffer is missing or incomplete in the checkpoint.
    """
    _wait_params(model)
    module = _unwrap(model)
    common = torch.load(
        os.path.join(directory, "common.pt"), map_location="cpu", weights_only=False
    )
    saved, now = common["sizes"], _sizes()
    keys = (
        ("tp", "pp", "ep", "etp")
        if any(map(is_expert_param, module.parameters()))
        else ("tp", "pp")
    )
    if any(saved[k] != now[k] for k in keys):
        raise ValueError(
            f"checkpoint {directory!r} was written with parallel sizes {saved}, this job has "
            f"{now}: only the data-parallel size may change"
        )
    pieces, buffers = _read_shards(directory)
    if optimizer is not None:
        optimizer.finish_param_sync()
    for name, p in module.named_parameters():
        key = f"{name}|{_mp_key(p)}"
        got = _copy_overlaps(p.detach().view(-1), 0, pieces.get(key, []), "param")
        if strict and got != p.numel():
            raise ValueError(
                f"checkpoint {directory!r} holds {got} of the {p.numel()} elements of parameter "
                f"{name!r} ({key})"
            )
    for name, b in module.named_buffers():
        key = f"{name}|{_mp_key(b)}"
        if key in buffers:
            b.copy_(buffers[key])
        elif strict:
            raise ValueError(f"checkpoint {directory!r} has no buffer {name!r}")
    if optimizer is not None:
        _load_optimizer(optimizer, pieces, common)
    return common.get("extra")


def _load_optimizer(optimizer, pieces: dict, common: dict) -> None:
    inner = optimizer.optimizer
    groups = common.get("param_groups")
    if groups is not None:
        if len(groups) != len(inner.param_groups):
            raise ValueError(
                f"checkpoint has {len(groups)} optimizer param groups, the optimizer "
                f"{len(inner.param_groups)}"
            )
        for g, hyper in zip(inner.param_groups, groups):
            g.update(hyper)
    if optimizer.grad_scaler is not None and "grad_scaler" in common:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
    for e in optimizer.shards:
        found = [q for q in pieces.get(f"{e.name}|{_mp_key(e.param)}", []) if "main" in q]
        r = e.ranges["param"]
        main = e.main_param.detach()
        if not found:  # a model-only checkpoint: start the state afresh
            optimizer.reload_model_params()
            continue
        _copy_overlaps(main, r.start, found, "main")
        state = {}
        for k in found[0]["state"]:
            t = torch.zeros(r.size, dtype=found[0]["state"][k].dtype, device=main.device)
            for q in found:
                a, b = q["range"]
                lo, hi = max(a, r.start), min(b, r.end)
                if lo < hi:
                    t[lo - r.start : hi - r.start].copy_(q["state"][k][lo - a : hi - a])
            state[k] = t
        for k, v in found[0]["scalars"].items():
            state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        if state:
            inner.state[e.main_param] = state


# --------------------------------------------------------------------------------------------
# Full (unsharded) state dicts
# --------------------------------------------------------------------------------------------


def _blocks(param, full_size: int) -> list[int]:
    stride = getattr(param, "partition_stride", 1)
    if isinstance(stride, int):
        return [full_size // stride] * stride
    return [int(b) for b in stride]


def _gather_tp(param: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the shards of ``param`` over ``group`` along its ``partition_dim`` (block
    by block for a ``partition_stride``)."""
    world = dist.get_world_size(group)
    local = param.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    dim = param.partition_dim
    blocks = _blocks(param, local.size(dim) * world)
    local_blocks = [b // world for b in blocks]
    split = [t.split(local_blocks, dim) for t in parts]
    return torch.cat([torch.cat([s[k] for s in split], dim) for k in range(len(blocks))], dim)


def _gather_ep(tensor: torch.Tensor, group) -> torch.Tensor:
    local = tensor.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, 0)


def _tensor_parallel_group(ps, t: torch.Tensor):
    """The group ``t`` is a tensor-parallel shard over (None: not a shard, or size 1)."""
    if ps is None:
        return None
    r = param_reduction(t)
    if not r.sharded:
        return None
    group = ps.get_process_group(r.tensor_parallel_group)
    return group if dist.get_world_size(group) > 1 else None


def _expert_parallel_group(ps, t: torch.Tensor):
    if ps is None or not is_expert_param(t):
        return None
    group = ps.get_expert_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def get_full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The single-device ``state_dict`` (original names, full tensors, on the CPU) of a
    tensor-/expert-parallel model. Call on every rank (all-gathers over the tensor-,
    expert-tensor- and expert-parallel groups); ``rank0_only`` returns ``{}`` on the other
    ranks. Shards are recognised by their attributes (:mod:`mtp.parallel.params`): a dense
    shard is gathered over the tensor-parallel group, an expert shard over the
    expert-tensor-parallel group, then expert tensors along dim 0 over the expert-parallel
    group."""
    _wait_params(model)
    module = _unwrap(model)
    ps = _parallel()
    tensors = module.state_dict(keep_vars=True)
    out = {}
    for name, t in tensors.items():
        full = t.detach()
        tp_group = _tensor_parallel_group(ps, t)
        if tp_group is not None:
            full = _gather_tp(t, tp_group)
        ep_group = _expert_parallel_group(ps, t)
        if ep_group is not None:
            full = _gather_ep(full, ep_group)
        out[name] = _cpu(full)
    if rank0_only and _rank() != 0:
        return {}
    return out


def _local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    ps = _parallel()
    group = _tensor_parallel_group(ps, param)
    if group is not None:
        from mtp.tensor_parallel.utils import shard

        dim = param.partition_dim
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        full = shard(full, dim, _blocks(param, full.size(dim)), rank, world)
    group = _expert_parallel_group(ps, param)
    if group is not None:
        full = full.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)]
    return full


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor] | None,
    *,
    src: int | None = None,
    optimizer=None,
    strict: bool = True,
) -> None:
    """Load a single-device ``state_dict`` into a tensor-/expert-parallel model, in place.

    Args:
        state_dict: full tensors with the original names (``None`` on ranks other than ``src``).
        src: the global rank that holds ``state_dict``; it is broadcast tensor by tensor (None:
            every rank passes it).
        optimizer: a :class:`~mtp.optim.DistributedOptimizer` whose main parameters are then
            refreshed from the model.
        strict: every entry of the model's ``state_dict`` must be present, with the full shape.
    """
    _wait_params(model)
    module = _unwrap(model)
    targets = module.state_dict(keep_vars=True)
    if src is not None:
        meta = [None]
        if _rank() == src:
            if state_dict is None:
                raise ValueError(f"load_full_state_dict: rank {src} (src) needs the state_dict")
            meta = [{k: (tuple(v.shape), v.dtype) for k, v in state_dict.items() if k in targets}]
        dist.broadcast_object_list(meta, src=src)
        received = {}
        for k, (shape, dtype) in meta[0].items():
            t = (
                state_dict[k].to("cpu", dtype).contiguous()
                if _rank() == src
                else torch.empty(shape, dtype=dtype)
            )
            dist.broadcast(t, src=src)
            received[k] = t
        state_dict = received
    elif state_dict is None:
        raise ValueError("load_full_state_dict: state_dict is None and no src rank was given")
    missing = [k for k in targets if k not in state_dict]
    if strict and missing:
        raise ValueError(f"load_full_state_dict: missing keys {missing}")
    for name, t in targets.items():
        if name not in state_dict:
            continue
        local = _local_part(t, state_dict[name])
        if tuple(local.shape) != tuple(t.shape):
            raise ValueError(
                f"load_full_state_dict: {name!r} has full shape {tuple(state_dict[name].shape)}, "
                f"whose local part {tuple(local.shape)} does not match the model's {tuple(t.shape)}"
            )
        t.detach().copy_(local)
    if optimizer is not None:
        optimizer.reload_model_params()
