"""Tensor- and sequence-parallel communication mappings (Megatron-LM section 3, seed 000/002).

Each mapping is an autograd function whose backward is the conjugate collective
(forward / backward):

- :func:`copy_to_tensor_model_parallel_region` (the paper's ``f``): identity / all-reduce
- :func:`reduce_from_tensor_model_parallel_region` (``g``): all-reduce / identity
- :func:`scatter_to_tensor_model_parallel_region`: split last dim / all-gather last dim
- :func:`gather_from_tensor_model_parallel_region`: all-gather last dim / split last dim
- :func:`scatter_to_sequence_parallel_region`: split ``seq_dim`` / all-gather ``seq_dim``
- :func:`gather_from_sequence_parallel_region`: all-gather ``seq_dim`` / reduce-scatter
- :func:`reduce_scatter_to_sequence_parallel_region`: reduce-scatter / all-gather ``seq_dim``

``group=None`` means the tensor-model-parallel group of
:func:`mtp.parallel.initialize_model_parallel`. Every mapping is the identity when the group
has one rank. ``seq_dim`` defaults to 0 (Megatron's ``[s, b, h]`` layout); pass ``seq_dim=1``
for ``[b, s, h]``. Splits are rank-major: rank ``r`` holds the ``r``-th contiguous chunk of the
split dimension.

Every mapping traces under ``torch.compile(fullgraph=True)``: the collectives are the
synchronous ``torch.distributed`` calls that Dynamo rewrites into functional collectives (the
asynchronous overlap in eager mode becomes synchronous while tracing; the compiler schedules).

Collectives are called through the ``torch.distributed`` module (so
:func:`mtp.testing.count_collectives` sees them); all-gather and reduce-scatter use one flat
collective (``all_gather_single`` / ``reduce_scatter_single``, or their older names
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on torch releases without them).

Ranks that disagree (:mod:`mtp.parallel.collective_check`): each collective is preceded by
one all-gather of a fixed-size row (operation, row count, hidden size, dtype, shape), and a
mismatch raises ``RankMismatchError`` on every rank instead of a gloo ``SIGABRT`` or an NCCL
hang; a backward collective whose forward checked the same shape skips it (one exchange per
mapping call). An exception inside a mapping follows ``MTP_ABORT_ON_ERROR`` (abort the group by
default).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import parallel_state
from .agreement import collective_region
from .collective_check import check_collective
from .groups import group_from_mesh

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "resolve_tensor_parallel_group",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]


# --------------------------------------------------------------------------------------------
# Groups and raw collectives
# --------------------------------------------------------------------------------------------


def resolve_tensor_parallel_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group``, or the tensor-model-parallel group when ``group`` is None.

    ``group`` may also be a 1-D ``DeviceMesh`` (or one named dimension of a larger mesh,
    ``mesh["tp"]``): its process group is used.

    Raises:
        mtp.parallel.ParallelStateError: ``group`` is None and the model parallel groups do not
            exist (the message says what to call).
    """
    if group is not None:
        return group_from_mesh(group)
    if not dist.is_available() or not dist.is_initialized():
        raise parallel_state.ParallelStateError(
            "group=None means the tensor-model-parallel group, but torch.distributed is not "
            "initialized: call torch.distributed.init_process_group() (or run under torchrun), "
            "then mtp.parallel.initialize_model_parallel(tensor_model_parallel_size=...), "
            "or pass group= explicitly"
        )
    if not parallel_state.model_parallel_is_initialized():
        raise parallel_state.ParallelStateError(
            "group=None means the tensor-model-parallel group, which is not initialized: call "
            "mtp.parallel.initialize_model_parallel(tensor_model_parallel_size=...) after "
            "torch.distributed.init_process_group(), or pass group= explicitly"
        )
    return parallel_state.get_tensor_model_parallel_group()


def _norm_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if x.dim() == 0:
        raise ValueError(f"{name}: cannot split or gather a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name}: dim {dim} out of range for a {x.dim()}-D tensor")
    return dim % x.dim()


def _check_divisible(x: torch.Tensor, dim: int, world: int, name: str) -> None:
    if x.size(dim) % world:
        raise ValueError(
            f"{name}: dimension {dim} of the input (shape {tuple(x.shape)}) has size "
            f"{x.size(dim)}, which does not divide by the group size {world}; pad it to a "
            f"multiple of {world}"
        )


def _traceable(async_op: bool) -> bool:
    """``async_op``, or False while ``torch.compile`` traces: Dynamo rewrites the synchronous
    c10d collectives into functional ones it can put in the graph (an ``async_op=True`` call is
    a graph break), and the compiler schedules the overlap itself."""
    return async_op and not torch.compiler.is_compiling()


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``out`` (``world * inp.numel()`` elements, rank-major) <- every rank's ``inp``."""
    async_op = _traceable(async_op)
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def _reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``out`` <- this rank's chunk (rank-major along dim 0) of the sum of every rank's ``inp``."""
    async_op = _traceable(async_op)
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(out, inp, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


def split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (a new contiguous tensor)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "split")
    n = x.size(dim) // world
    return x.narrow(dim, dist.get_rank(group) * n, n).contiguous()


class GatherHandle:
    """An all-gather in flight (``async_op=True``); :meth:`wait` returns the gathered tensor."""

    def __init__(self, work, buffer: torch.Tensor, dim: int, world: int) -> None:
        self._work, self._buffer, self._dim, self._world = work, buffer, dim, world

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return _stacked_to_cat(self._buffer, self._dim)


def _stacked_to_cat(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``[world, *shape]`` -> the ranks' tensors concatenated along ``dim``."""
    world = stacked.size(0)
    shape = list(stacked.shape[1:])
    shape[dim] *= world
    if dim == 0:
        return stacked.view(shape)
    return stacked.movedim(0, dim).reshape(shape)


def gather_along(
    x: torch.Tensor, dim: int, group, async_op: bool = False, *, check: bool = True,
    what: str = "all_gather",
):  # fmt: skip
    """Concatenate every rank's ``x`` along ``dim`` (rank-major). One flat all-gather.

    With ``async_op=True`` returns a :class:`GatherHandle` whose ``wait()`` gives the result.
    ``check=False`` skips the agreement check (a backward whose forward checked the shape);
    ``what`` names the operation in its message.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return GatherHandle(None, x.unsqueeze(0), dim, 1) if async_op else x
    if check:
        check_collective("all_gather", x, group, dim=dim, what=what)
    x = x.contiguous()
    if x.dim() == 0:
        x = x.view(1)
    flat = torch.empty((world * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_flat(flat, x, group, async_op=async_op)
    handle = GatherHandle(work if async_op else None, flat.view(world, *x.shape), dim, world)
    return handle if async_op else handle.wait()


class ScatterHandle:
    """A reduce-scatter in flight; :meth:`wait` returns this rank's reduced chunk."""

    def __init__(self, work, out: torch.Tensor, dim: int) -> None:
        self._work, self._out, self._dim = work, out, dim

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._out if self._dim == 0 else self._out.movedim(0, self._dim).contiguous()


def reduce_scatter_along(
    x: torch.Tensor, dim: int, group, async_op: bool = False, *, check: bool = True,
    what: str = "reduce_scatter",
):  # fmt: skip
    """Sum ``x`` over the ranks and keep this rank's chunk along ``dim``. One reduce-scatter
    (``check``, ``what``: as :func:`gather_along`)."""
    world = dist.get_world_size(group)
    if world == 1:
        return ScatterHandle(None, x, 0) if async_op else x
    if check:
        check_collective("reduce_scatter", x, group, dim=dim, what=what)
    _check_divisible(x, dim, world, "reduce-scatter")
    src = (x if dim == 0 else x.movedim(dim, 0)).contiguous()
    out = torch.empty((src.size(0) // world, *src.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter_flat(out, src, group, async_op=async_op)
    handle = ScatterHandle(work if async_op else None, out, dim)
    return handle if async_op else handle.wait()


def all_reduce_(x: torch.Tensor, group, async_op: bool = False, *, what: str = "all_reduce"):
    """Sum ``x`` over the ranks, in place (``x`` must be contiguous), after the agreement check
    (``what`` names the operation in its message).

    Returns the work handle with ``async_op=True``, else None (also while ``torch.compile``
    traces, where the call is synchronous).
    """
    if dist.get_world_size(group) == 1:
        return None
    check_collective("all_reduce", x, group, what=what)
    return dist.all_reduce(x, group=group, async_op=_traceable(async_op))


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce_(grad, ctx.group, what="backward of copy_to_tensor_model_parallel_region")
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if inplace and x.is_contiguous():
            ctx.mark_dirty(x)
            out = x
        else:
            out = x.clone(memory_format=torch.contiguous_format)
        all_reduce_(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    """Split along ``dim``; backward all-gathers along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # the forward ran no collective: this one checks
        what = "backward of a scatter_to_* mapping"
        return gather_along(grad, ctx.dim, ctx.group, what=what), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along ``dim``; backward splits (``reduce_grad=False``) or reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:  # the forward's gather checked this shape
            grad = reduce_scatter_along(grad, ctx.dim, ctx.group, check=False)
            return grad, None, None, None
        return split_along(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Reduce-scatter along ``dim``; backward all-gathers along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # the forward's reduce-scatter checked this shape
        return gather_along(grad, ctx.dim, ctx.group, check=False), None, None


# --------------------------------------------------------------------------------------------
# Public mappings
# --------------------------------------------------------------------------------------------


def _setup(x: torch.Tensor, group, name: str):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
    group = resolve_tensor_parallel_group(group)
    return group, dist.get_world_size(group)


@collective_region("copy_to_tensor_model_parallel_region", group_arg="group")
def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """The paper's ``f``: identity forward, all-reduce of the gradient backward.

    Put it where a replicated activation enters a tensor-parallel region (before a
    column-parallel GEMM). Any shape and dtype.
    """
    group, world = _setup(input_, group, "copy_to_tensor_model_parallel_region")
    if world == 1:
        return input_
    return _CopyToRegion.apply(input_, group)


@collective_region("reduce_from_tensor_model_parallel_region", group_arg="group")
def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group=None, *, inplace: bool = False
) -> torch.Tensor:
    """The paper's ``g``: all-reduce (sum) forward, identity backward.

    Put it where partial results leave a tensor-parallel region (after a row-parallel GEMM).
    ``inplace=True`` reduces into ``input_`` itself (no copy; autograd treats it as an in-place
    op), as the layers do on their fresh GEMM outputs.
    """
    group, world = _setup(input_, group, "reduce_from_tensor_model_parallel_region")
    if world == 1:
        return input_
    return _ReduceFromRegion.apply(input_, group, inplace)


@collective_region("scatter_to_tensor_model_parallel_region", group_arg="group")
def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension; backward all-gathers the last dimension.

    Raises ``ValueError`` when the last dimension does not divide by the group size.
    """
    group, world = _setup(input_, group, "scatter_to_tensor_model_parallel_region")
    if world == 1:
        return input_
    dim = _norm_dim(input_, -1, "scatter_to_tensor_model_parallel_region")
    _check_divisible(input_, dim, world, "scatter_to_tensor_model_parallel_region")
    return _ScatterToRegion.apply(input_, group, dim)


@collective_region("gather_from_tensor_model_parallel_region", group_arg="group")
def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the last dimension (rank-major); backward keeps this rank's chunk."""
    group, world = _setup(input_, group, "gather_from_tensor_model_parallel_region")
    if world == 1:
        return input_
    dim = _norm_dim(input_, -1, "gather_from_tensor_model_parallel_region")
    return _GatherFromRegion.apply(input_, group, dim, False)


@collective_region("scatter_to_sequence_parallel_region", group_arg="group")
def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group=None, seq_dim: int = 0
) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dimension; backward all-gathers it.

    Raises ``ValueError`` when ``input_.size(seq_dim)`` does not divide by the group size.
    """
    group, world = _setup(input_, group, "scatter_to_sequence_parallel_region")
    if world == 1:
        return input_
    dim = _norm_dim(input_, seq_dim, "scatter_to_sequence_parallel_region")
    _check_divisible(input_, dim, world, "scatter_to_sequence_parallel_region")
    return _ScatterToRegion.apply(input_, group, dim)


@collective_region("gather_from_sequence_parallel_region", group_arg="group")
def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group=None,
    seq_dim: int = 0,
) -> torch.Tensor:
    """All-gather the sequence dimension; backward reduce-scatters the gradient.

    Args:
        input_: this rank's sequence chunk, e.g. ``[s/tp, b, h]``.
        tensor_parallel_output_grad: True (default) when the gathered tensor feeds a
            tensor-parallel computation, so each rank holds a partial gradient and the backward
            reduce-scatters. False when every rank computes the same thing with it: the backward
            just keeps this rank's chunk of the gradient (Megatron-Core's meaning).
        seq_dim: the sequence dimension (0 for ``[s, b, h]``, 1 for ``[b, s, h]``).
    """
    group, world = _setup(input_, group, "gather_from_sequence_parallel_region")
    if world == 1:
        return input_
    dim = _norm_dim(input_, seq_dim, "gather_from_sequence_parallel_region")
    return _GatherFromRegion.apply(input_, group, dim, bool(tensor_parallel_output_grad))


@collective_region("reduce_scatter_to_sequence_parallel_region", group_arg="group")
def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group=None, seq_dim: int = 0
) -> torch.Tensor:
    """Sum over the ranks and keep this rank's sequence chunk; backward all-gathers.

    Raises ``ValueError`` when ``input_.size(seq_dim)`` does not divide by the group size.
    """
    group, world = _setup(input_, group, "reduce_scatter_to_sequence_parallel_region")
    if world == 1:
        return input_
    dim = _norm_dim(input_, seq_dim, "reduce_scatter_to_sequence_parallel_region")
    _check_divisible(input_, dim, world, "reduce_scatter_to_sequence_parallel_region")
    return _ReduceScatterToRegion.apply(input_, group, dim)
