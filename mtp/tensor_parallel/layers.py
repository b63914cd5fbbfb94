"""Column-parallel and row-parallel linear layers (the vocab-parallel embedding, in
:mod:`mtp.tensor_parallel.embedding`, is importable from here too, as in Megatron-Core).

Shapes follow ``nn.Linear``: any leading dimensions, features last. With
``sequence_parallel=True`` the activations outside the tensor-parallel region are split along
the sequence dimension ``seq_dim`` (0 for Megatron's ``[s, b, h]``, 1 for ``[b, s, h]``): the
column-parallel layer all-gathers its input along it, the row-parallel layer and the embedding
reduce-scatter their output along it.

Initialisation (default): every rank builds the full ("master") weight exactly as a
single-device layer would from the same random state (``nn.Linear`` / ``nn.Embedding``
defaults, or ``init_method``), then keeps its shard. A tensor-parallel model is therefore the
same model at every tp size, and equal to the plain PyTorch model built from the same seed.

Argument checks: constructor arguments of the wrong type raise ``TypeError`` naming them
(sizes must be ints, flags bools, ``dtype`` a floating dtype); inputs that are not floating, or
not of the weight's dtype outside ``torch.autocast``, raise ``TypeError`` naming ``input_``.
Ranks that pass different inputs (rows, hidden size, dtype) raise ``RankMismatchError`` on every
rank: each layer call exchanges one agreement row before its first collective
(:mod:`mtp.parallel.collective_check`). Another exception inside ``forward`` follows
``MTP_ABORT_ON_ERROR`` (see :mod:`mtp.parallel.agreement`): by default the group is aborted so
that it is not used with collectives that no longer match the peers'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.parallel.agreement import collective_region
from mtp.parallel.mappings import (
    all_reduce_,
    gather_along,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

from .embedding import VocabParallelEmbedding, VocabRangeError
from .utils import (
    InitMethod,
    Stride,
    block_sizes,
    check_float_input,
    check_layer_args,
    check_positive_int,
    default_linear_bias_init,
    default_linear_init,
    divide,
    group_rank_and_size,
    master_then_shard,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabRangeError",
    "linear_with_grad_reduction",
]

_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
_custom_bwd = torch.amp.custom_bwd(device_type="cuda")
_COLUMN_BACKWARD = "backward of ColumnParallelLinear"


class _ColumnParallelLinearFn(torch.autograd.Function):
    """``y = (all-gather x) @ W^T + b`` whose backward overlaps communication with the GEMMs.

    Without sequence parallel the input is replicated: backward all-reduces ``dX`` (the
    paper's ``f``) asynchronously while ``dW`` is computed. With sequence parallel only this
    rank's sequence chunk of ``x`` is saved; backward re-gathers it (overlapped with the ``dX``
    GEMM) and reduce-scatters ``dX`` (overlapped with the ``dW`` GEMM), as Megatron-Core does.
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim):
        ctx.group, ctx.sequence_parallel, ctx.seq_dim = group, sequence_parallel, seq_dim
        ctx.save_for_backward(x, weight)
        total = gather_along(x, seq_dim, group) if sequence_parallel else x
        return F.linear(total, weight, bias)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group, sp, seq_dim = ctx.group, ctx.sequence_parallel, ctx.seq_dim
        # with sequence parallel the forward's gather checked x's shape: no second check
        gathering = None
        if sp and need_w:
            gathering = gather_along(x, seq_dim, group, async_op=True, check=False)
        grad_input = grad_out.matmul(weight) if need_x else None
        total = gathering.wait() if gathering is not None else x
        pending = None
        if need_x:
            if sp:
                pending = reduce_scatter_along(grad_input, seq_dim, group, True, check=False)
            else:  # the forward ran no collective: this one checks
                pending = all_reduce_(grad_input, group, True, what=_COLUMN_BACKWARD)
        grad_weight = grad_bias = None
        grad_2d = grad_out.reshape(-1, grad_out.size(-1))
        if need_w:
            grad_weight = grad_2d.t().matmul(total.reshape(-1, total.size(-1)))
        if need_b:
            grad_bias = grad_2d.sum(0)
        if pending is not None:
            if sp:
                grad_input = pending.wait()
            else:
                pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def linear_with_grad_reduction(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup,
    *,
    sequence_parallel: bool = False,
    seq_dim: int = 0,
) -> torch.Tensor:
    """The column-parallel GEMM with its communication (what :class:`ColumnParallelLinear` runs).

    Forward: ``linear(x, W, b)`` on the replicated input, or on the sequence all-gather of
    ``x`` with ``sequence_parallel``. Backward: the gradient of ``x`` is all-reduced (or
    reduce-scattered along ``seq_dim``) over ``group``, overlapped with the weight-gradient GEMM.
    """
    if dist.get_world_size(group) == 1:
        return F.linear(input_, weight, bias)
    if sequence_parallel:
        seq_dim = seq_dim % input_.dim()
    return _ColumnParallelLinearFn.apply(input_, weight, bias, group, sequence_parallel, seq_dim)


def _check_features(
    x: torch.Tensor, expected: int, what: str, layer: str, weight: torch.Tensor
) -> None:
    check_float_input(layer, "input_", x, weight)
    if x.dim() == 0 or x.size(-1) != expected:
        raise ValueError(
            f"{layer}: input_ must have {expected} features in its last dimension ({what}), "
            f"got shape {tuple(x.shape)}"
        )


def _check_seq_dim(x: torch.Tensor, seq_dim: int, layer: str) -> None:
    if not -x.dim() <= seq_dim < x.dim() or seq_dim % x.dim() == x.dim() - 1:
        raise ValueError(
            f"{layer}: seq_dim={seq_dim} is not a leading dimension of the input of shape "
            f"{tuple(x.shape)}"
        )


class _ParallelLinearBase(nn.Module):
    """What the column and row layers share: sizes, group, init, extra_repr."""

    partition_dim: int  # 0: output features are split (column); 1: input features (row)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        skip_bias_add: bool,
        sequence_parallel: bool,
        seq_dim: int,
        stride: Stride,
        init_method: InitMethod | None,
        perform_initialization: bool,
        group,
        dtype,
        device,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, "input_size", input_size)
        check_positive_int(name, "output_size", output_size)
        check_layer_args(
            name,
            flags={
                "bias": bias,
                "skip_bias_add": skip_bias_add,
                "sequence_parallel": sequence_parallel,
                "perform_initialization": perform_initialization,
            },
            seq_dim=seq_dim,
            stride=stride,
            init_methods={"init_method": init_method},
            group=group,
            dtype=dtype,
            device=device,
        )
        self.group, self.tp_rank, self.tp_size = group_rank_and_size(group)
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.stride = stride
        split = output_size if self.partition_dim == 0 else input_size
        what = f"{name} {'output_size' if self.partition_dim == 0 else 'input_size'}"
        self._blocks = block_sizes(split, stride, self.tp_size, what)
        if self.partition_dim == 0:
            self.output_size_per_partition = divide(output_size, self.tp_size, what)
            local = (self.output_size_per_partition, input_size)
        else:
            self.input_size_per_partition = divide(input_size, self.tp_size, what)
            local = (output_size, self.input_size_per_partition)
        factory = {"dtype": dtype, "device": device}
        if perform_initialization:
            weight = master_then_shard(
                (output_size, input_size),
                self.partition_dim,
                self._blocks,
                self.tp_rank,
                self.tp_size,
                init_method or default_linear_init,
                factory,
            )
        else:
            weight = torch.empty(local, **factory)
        self.weight = nn.Parameter(weight)
        set_tensor_model_parallel_attributes(self.weight, True, self.partition_dim, stride)
        if bias:
            self.bias = nn.Parameter(self._make_bias(init_method, perform_initialization, factory))
        else:
            self.register_parameter("bias", None)

    def _make_bias(self, init_method, perform_initialization, factory) -> torch.Tensor:
        column = self.partition_dim == 0
        if not perform_initialization:
            size = self.output_size_per_partition if column else self.output_size
            return torch.empty(size, **factory)
        if init_method is None:  # nn.Linear: uniform(±1/sqrt(fan_in))

            def init(b):
                default_linear_bias_init(b, self.input_size)

        else:  # Megatron-Core: zero bias with an explicit init_method
            init = nn.init.zeros_
        if column:
            return master_then_shard(
                (self.output_size,), 0, self._blocks, self.tp_rank, self.tp_size, init, factory
            )
        return master_then_shard((self.output_size,), 0, [self.output_size], 0, 1, init, factory)

    def _finish(self, output: torch.Tensor, bias_in_output: bool):
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None and not bias_in_output:
            output = output + self.bias
        return output

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"bias={self.bias is not None}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, skip_bias_add={self.skip_bias_add}"
        )


class ColumnParallelLinear(_ParallelLinearBase):
    """``Y = X A + b`` with ``A`` split by columns: rank ``r`` holds output features
    ``[r * out/tp, (r + 1) * out/tp)`` (of every block when ``stride`` fuses several).

    Args:
        input_size, output_size: the full (unsplit) sizes; ``output_size`` must divide by tp.
        bias: add a bias (sharded like the output features).
        gather_output: all-gather the output features so every rank gets ``[..., out]`` (in
            the full layout, fused blocks included); otherwise each rank returns its
            ``[..., out/tp]`` part (to feed a row-parallel layer).
        skip_bias_add: return ``(output, bias)`` without adding the bias, so the next op can
            fuse it (bias-GeLU); the bias is this rank's shard, or the full bias with
            ``gather_output``.
        sequence_parallel: the input is this rank's sequence chunk; it is all-gathered along
            ``seq_dim`` before the GEMM (backward: reduce-scatter). Not with ``gather_output``.
        disable_grad_reduce: the input has already entered the tensor-parallel region (the
            full, replicated activation from :func:`enter_tensor_parallel_region`, shared by
            sibling layers such as q/k/v or gate/up): the layer runs a plain local GEMM, with no
            input all-gather and no gradient reduction of its own (Megatron-Core's name). The
            one reduction for all siblings happens at the shared entry.
        seq_dim: the sequence dimension of the input (0: ``[s, b, h]``; 1: ``[b, s, h]``).
        stride: the output dimension fuses several matrices: an int for that many equal blocks
            (Megatron's partition stride; 3 for a fused ``[q; k; v]``), or the block sizes
            (grouped-query attention). Each block is split over the ranks separately.
        init_method: ``fn(weight)`` filling the full weight in place (bias then starts at
            zero); default ``nn.Linear``'s initialisation of weight and bias.
        perform_initialization: False leaves the parameters uninitialised (to load weights).
        group: the tensor-parallel process group (default: ``mtp.parallel``'s).
        dtype, device: of the parameters.

    Forward: ``input_`` ``[..., input_size]`` (sequence chunk along ``seq_dim`` with sequence
    parallel) -> ``[..., output_size/tp]`` or ``[..., output_size]`` with ``gather_output``;
    ``(output, bias)`` with ``skip_bias_add``. One all-reduce of the input gradient in backward
    (sequence parallel: all-gather forward; all-gather + reduce-scatter backward); none with
    ``disable_grad_reduce``.
    """

    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        stride: Stride = 1,
        init_method: InitMethod | None = None,
        perform_initialization: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        disable_grad_reduce: bool = False,
    ) -> None:
        check_layer_args(
            "ColumnParallelLinear",
            flags={"gather_output": gather_output, "disable_grad_reduce": disable_grad_reduce},
            seq_dim=0,
        )
        if gather_output and sequence_parallel and not disable_grad_reduce:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with "
                "sequence_parallel=True (the output would be gathered along both the sequence "
                "and the feature dimension); feed the output to a RowParallelLinear instead"
            )
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            stride=stride,
            init_method=init_method,
            perform_initialization=perform_initialization,
            group=group,
            dtype=dtype,
            device=device,
        )
        self.gather_output = gather_output
        self.disable_grad_reduce = disable_grad_reduce
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)

    @collective_region("ColumnParallelLinear.forward")
    def forward(self, input_: torch.Tensor):
        _check_features(
            input_, self.input_size, "input_size", "ColumnParallelLinear", self.weight
        )
        if self.sequence_parallel:
            _check_seq_dim(input_, self.seq_dim, "ColumnParallelLinear")
        bias = None if self.skip_bias_add else self.bias
        if self.disable_grad_reduce:
            output = F.linear(input_, self.weight, bias)
        else:
            output = linear_with_grad_reduction(
                input_,
                self.weight,
                bias,
                self.group,
                sequence_parallel=self.sequence_parallel,
                seq_dim=self.seq_dim,
            )
        if not self.gather_output:
            return self._finish(output, bias_in_output=True)
        output = self._gather(output)
        if self.skip_bias_add:  # the bias that goes with the gathered output: the full one
            return output, None if self.bias is None else self._gather(self.bias)
        return output

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather the output features and put fused blocks back in the full layout."""
        t = gather_from_tensor_model_parallel_region(t, self.group)
        if len(self._blocks) == 1 or self.tp_size == 1:
            return t
        # rank-major [r0: a0 b0 | r1: a1 b1] -> block-major [a0 a1 | b0 b1]
        per_rank = t.unflatten(-1, (self.tp_size, -1))
        pieces = per_rank.split([b // self.tp_size for b in self._blocks], dim=-1)
        return torch.cat([p.flatten(-2) for p in pieces], dim=-1)

    def extra_repr(self) -> str:
        extra = f", gather_output={self.gather_output}"
        if self.disable_grad_reduce:
            extra += ", disable_grad_reduce=True"
        return super().extra_repr() + extra


class RowParallelLinear(_ParallelLinearBase):
    """``Y = X A + b`` with ``A`` split by rows: rank ``r`` holds input features
    ``[r * in/tp, (r + 1) * in/tp)``; the partial products are summed over the group and the
    bias is added once, after the reduction.

    Args:
        input_size, output_size: the full sizes; ``input_size`` must divide by tp.
        bias: add a bias (replicated; with ``sequence_parallel`` each rank adds it to its
            sequence chunk, so its gradient is partial: the parameter is marked
            ``sequence_parallel=True`` for :func:`allreduce_sequence_parallel_grads`).
        input_is_parallel: the input is already split by features (the output of a
            :class:`ColumnParallelLinear`); False splits a replicated input here.
        skip_bias_add: return ``(output, bias)`` with the bias not added.
        sequence_parallel: reduce-scatter the output along ``seq_dim`` instead of all-reducing
            (needs ``input_is_parallel=True``).
        seq_dim, stride, init_method, perform_initialization, group, dtype, device: as for
            :class:`ColumnParallelLinear` (``stride`` splits the input dimension).

    Forward: ``[..., input_size/tp]`` (or ``[..., input_size]`` with
    ``input_is_parallel=False``) -> ``[..., output_size]`` (sequence chunk with
    ``sequence_parallel``). One all-reduce forward (or one reduce-scatter), none backward (or
    one all-gather).
    """

    partition_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        stride: Stride = 1,
        init_method: InitMethod | None = None,
        perform_initialization: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_layer_args(
            "RowParallelLinear", flags={"input_is_parallel": input_is_parallel}, seq_dim=0
        )
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (its "
                "input must come split by features from a ColumnParallelLinear)"
            )
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            stride=stride,
            init_method=init_method,
            perform_initialization=perform_initialization,
            group=group,
            dtype=dtype,
            device=device,
        )
        self.input_is_parallel = input_is_parallel
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, False, 0, 1)
            self.bias.sequence_parallel = sequence_parallel

    @collective_region("RowParallelLinear.forward")
    def forward(self, input_: torch.Tensor):
        local_in = self.input_size_per_partition
        expected = local_in if self.input_is_parallel else self.input_size
        what = "input_size / tp" if self.input_is_parallel else "input_size"
        _check_features(input_, expected, what, "RowParallelLinear", self.weight)
        if self.sequence_parallel:
            _check_seq_dim(input_, self.seq_dim, "RowParallelLinear")
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.group)
        partial = F.linear(input_, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(
                partial, self.group, seq_dim=self.seq_dim
            )
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.group, inplace=True)
        return self._finish(output, bias_in_output=False)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"
