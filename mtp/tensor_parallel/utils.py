"""Helpers shared by the tensor-parallel layers: sizes, weight sharding, parameter attributes,
and the reduction of sequence-parallel gradients."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mtp.parallel.mappings import all_reduce_, resolve_tensor_parallel_group
from mtp.parallel.params import (
    param_is_sequence_parallel,
    param_is_tensor_parallel,
    param_reduction,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "VocabUtility",
    "allreduce_sequence_parallel_grads",
    "divide",
    "mark_sequence_parallel_parameters",
    "pad_vocab_size",
    "param_is_tensor_parallel",
    "set_tensor_model_parallel_attributes",
]

#: ``init_method(tensor)`` fills a tensor in place (Megatron-Core's convention).
InitMethod = Callable[[torch.Tensor], object]
#: Output-dim blocks of a fused weight: an int (that many equal blocks) or the block sizes.
Stride = int | Sequence[int]


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``; ``ValueError`` naming ``what`` when it does not divide."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor parallel size ({denominator})"
        )
    return numerator // denominator


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Smallest size >= ``vocab_size`` divisible by ``multiple * tp`` (seed 002: 128 per rank).

    Megatron pads the vocabulary so that every rank's shard is a multiple of ``multiple`` rows
    (good GEMM shapes) and the shards are equal.
    """
    if vocab_size <= 0 or tp <= 0 or multiple <= 0:
        raise ValueError(
            f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, tp={tp}, "
            f"multiple={multiple}"
        )
    step = multiple * tp
    return math.ceil(vocab_size / step) * step


class VocabUtility:
    """Vocabulary range ``[first, last)`` owned by a rank (Megatron-Core helper)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        per = divide(global_vocab_size, world_size, "vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per, rank, world_size)


def group_rank_and_size(group) -> tuple[dist.ProcessGroup, int, int]:
    """Resolve ``group`` (None: the tensor-parallel group) and return it with rank and size."""
    group = resolve_tensor_parallel_group(group)
    return group, dist.get_rank(group), dist.get_world_size(group)


def block_sizes(size: int, stride: Stride, world: int, what: str) -> list[int]:
    """The blocks of a fused dimension, each checked to divide by ``world``."""
    if isinstance(stride, int):
        if stride < 1 or size % stride:
            raise ValueError(f"{what} ({size}) must divide into stride={stride} equal blocks")
        blocks = [size // stride] * stride
    else:
        blocks = [int(b) for b in stride]
        if sum(blocks) != size or any(b < 0 for b in blocks):
            raise ValueError(
                f"{what}: the block sizes {blocks} (stride) must be non-negative and sum to {size}"
            )
    if len(blocks) == 1:
        divide(size, world, what)
    for b in blocks:
        if b % world:
            raise ValueError(
                f"{what} ({size}) is fused from blocks {blocks}; each block must be divisible "
                f"by the tensor parallel size ({world}), {b} is not"
            )
    return blocks


def shard(
    full: torch.Tensor, dim: int, blocks: Sequence[int], rank: int, world: int
) -> torch.Tensor:
    """This rank's shard of ``full`` along ``dim``: chunk ``rank`` of every block, concatenated."""
    pieces = []
    for block in full.split(list(blocks), dim):
        n = block.size(dim) // world
        pieces.append(block.narrow(dim, rank * n, n))
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def mark_sequence_parallel_parameters(params: Iterable[torch.Tensor] | nn.Module) -> int:
    """Set ``sequence_parallel = True`` on every replicated parameter whose gradient is still
    partial over the tensor-parallel group.

    Use it for the parameters that act on sequence shards under sequence parallelism
    (LayerNorm weights and biases, biases added after a reduce-scatter); their gradients are
    then summed over the group by :func:`allreduce_sequence_parallel_grads` (or
    ``DistributedDataParallel.finish_grad_sync``). Left alone, as
    :mod:`mtp.parallel.params` describes them: tensor-parallel shards, expert parameters
    (``allreduce = False``: complete over the expert groups), parameters whose gradient the
    layer already sums over the group (``tensor_parallel_grad_reduced``: a
    :class:`~mtp.moe.MoELayer`'s router and shared expert) and parameters explicitly marked
    ``sequence_parallel = False``. Returns how many parameters were marked.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    count = 0
    for p in params:
        r = param_reduction(p)
        explicit_no = getattr(p, "sequence_parallel", None) is False
        if r.sharded or r.expert or r.grad_reduced or explicit_no:
            continue
        p.sequence_parallel = True
        count += 1
    return count


def allreduce_sequence_parallel_grads(
    module: nn.Module | Iterable[torch.Tensor], group=None
) -> int:
    """Sum, over the tensor-parallel group, the gradients of the ``sequence_parallel`` params.

    Under sequence parallelism a replicated parameter (LayerNorm weight, the bias of a
    row-parallel layer) sees only this rank's sequence chunk, so each rank holds a partial
    gradient. Call this after ``backward()`` and before the optimizer step (Megatron-Core does
    it in ``finalize_model_grads``), on every rank of the group: one all-reduce per dtype, over
    a flat buffer. Returns the number of gradients reduced.
    """
    group = resolve_tensor_parallel_group(group)
    params = module.parameters() if isinstance(module, nn.Module) else module
    grads = [p.grad for p in params if param_is_sequence_parallel(p) and p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return len(grads)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        all_reduce_(flat, group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)


def default_linear_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s weight init (Kaiming-uniform, a=sqrt(5)) on the full (master) weight."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def default_linear_bias_init(bias: torch.Tensor, fan_in: int) -> None:
    """``nn.Linear``'s bias init: uniform in ``±1/sqrt(fan_in)``."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(bias, -bound, bound)


# --------------------------------------------------------------------------------------------
# Argument checks shared by the layers
# --------------------------------------------------------------------------------------------


def check_positive_int(layer: str, name: str, value: object) -> int:
    """``value`` as an int >= 1; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{layer}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{layer}: {name} must be positive, got {value}")
    return value


def check_layer_args(
    layer: str,
    *,
    flags: dict[str, object],
    seq_dim: object,
    stride: object = 1,
    init_methods: dict[str, object] | None = None,
    group: object = None,
    dtype: object = None,
    device: object = None,
) -> None:
    """Type checks of a tensor-parallel layer's constructor arguments (clear errors naming the
    argument instead of failures deep in ``torch.empty`` or the first forward)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{layer}: {name} must be a bool, got {type(value).__name__} {value!r}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(
            f"{layer}: seq_dim must be an int, got {type(seq_dim).__name__} {seq_dim!r}"
        )
    if isinstance(stride, bool) or not (
        isinstance(stride, int)
        or (isinstance(stride, Sequence) and stride and all(
            isinstance(b, int) and not isinstance(b, bool) for b in stride))  # fmt: skip
    ):
        raise TypeError(
            f"{layer}: stride must be an int or a non-empty sequence of block sizes (ints), got "
            f"{stride!r}"
        )
    for name, fn in (init_methods or {}).items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{layer}: {name} must be callable (fn(weight)) or None, got {fn!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{layer}: group must be a torch.distributed.ProcessGroup or None (the tensor "
            f"parallel group), got {type(group).__name__}"
        )
    if dtype is not None and (
        not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
    ):
        raise TypeError(
            f"{layer}: dtype must be a floating-point torch.dtype (float32, bfloat16, ...) or "
            f"None, got {dtype!r}"
        )
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{layer}: device {device!r} is not a valid device ({exc})") from None


def check_float_input(layer: str, name: str, x: object, weight: torch.Tensor) -> torch.Tensor:
    """``x`` must be a real floating tensor of ``weight``'s dtype (any dtype under autocast)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"{layer}: {name} must be a floating-point tensor (like the layer's {weight.dtype} "
            f"weight), got dtype {x.dtype}"
        )
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer}: {name} has dtype {x.dtype} but the layer's weight is {weight.dtype}; cast "
            f"the input (or the layer with .to(dtype)), or run under torch.autocast"
        )
    return x


def master_then_shard(
    full_shape: tuple[int, ...],
    dim: int,
    blocks: list[int],
    rank: int,
    world: int,
    init: InitMethod | None,
    factory: dict,
) -> torch.Tensor:
    """Build the full tensor with ``init`` and return this rank's shard (or an empty shard)."""
    full = torch.empty(full_shape, **factory)
    if init is not None:
        with torch.no_grad():
            init(full)
    return shard(full, dim, blocks, rank, world) if world > 1 else full
