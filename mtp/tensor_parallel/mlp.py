"""The tensor-parallel MLP: column-parallel fc1 -> bias + activation -> row-parallel fc2
(Megatron-LM figure 3a: one all-reduce forward, one backward)."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.parallel.agreement import collective_region

from .layers import ColumnParallelLinear, RowParallelLinear
from .utils import InitMethod, divide, group_rank_and_size

__all__ = ["ACTIVATIONS", "ParallelMLP", "apply_bias_activation"]

#: Activations by name; ``swiglu`` makes fc1 twice as wide (``silu(gate) * up``).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "relu", "silu")
from mtp.dtypes import KERNEL_FLOATS as _FUSED_DTYPES  # noqa: E402


def _fused_op(name: str) -> Callable | None:
    """``mtp.ops.<name>`` when that fused op exists (it lands with the kernels issue)."""
    try:
        import mtp.ops
    except ImportError:  # the op layer cannot load here (e.g. no triton): plain PyTorch
        return None
    op = getattr(mtp.ops, name, None)
    if isinstance(op, types.ModuleType):  # the submodule, not the function
        op = getattr(op, name, None)
    return op if callable(op) else None


def _bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    fused = _fused_op("bias_gelu")
    if fused is not None and bias is not None and x.dtype in _FUSED_DTYPES:
        return fused(x, bias, approximate=approximate)
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def _bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    fused = _fused_op("bias_swiglu")
    if fused is not None and bias is not None and x.dtype in _FUSED_DTYPES:
        return fused(x, bias)
    y = x if bias is None else x + bias
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_bias_activation(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``activation(x + bias)``; uses the fused ``mtp.ops.bias_gelu`` / ``bias_swiglu`` when
    they are installed (fp32/fp16/bf16), plain PyTorch otherwise.

    ``x``: ``[..., n]`` (``[..., 2m]`` for ``"swiglu"``, whose result is ``[..., m]``);
    ``bias``: ``[n]`` or None. ``activation``: a name from :data:`ACTIVATIONS` or a callable.
    """
    if activation == "gelu":
        return _bias_gelu(x, bias, "none")
    if activation == "gelu_tanh":
        return _bias_gelu(x, bias, "tanh")
    if activation == "swiglu":
        return _bias_swiglu(x, bias)
    y = x if bias is None else x + bias
    if activation == "relu":
        return F.relu(y)
    if activation == "silu":
        return F.silu(y)
    if callable(activation):
        return activation(y)
    raise ValueError(f"activation must be one of {ACTIVATIONS} or a callable, got {activation!r}")


class ParallelMLP(nn.Module):
    """Transformer MLP split over the tensor-parallel group (Megatron-Core's ``MLP``).

    ``linear_fc1`` (:class:`ColumnParallelLinear`, ``hidden -> ffn``, or ``hidden -> 2 ffn``
    for ``swiglu`` with gate and up split separately) feeds its bias to the fused activation;
    ``linear_fc2`` (:class:`RowParallelLinear`, ``ffn -> hidden``) reduces. Numerically the
    single-device ``fc2(act(fc1(x)))`` with ``nn.Linear`` layers built from the same seed (for
    ``swiglu``, fc1's output rows ``[:ffn]`` are the gate and ``[ffn:]`` the up projection).

    Args:
        hidden_size, ffn_hidden_size: ``h`` and the intermediate size (divisible by tp).
        activation: ``"gelu"`` (erf), ``"gelu_tanh"``, ``"swiglu"``, ``"relu"``, ``"silu"``, or
            a callable applied to ``fc1(x) + bias``.
        bias: biases in fc1 and fc2.
        skip_bias_add: return ``(output, fc2_bias)`` with fc2's bias not added.
        sequence_parallel, seq_dim: sequence parallel input/output (see the linear layers).
        init_method: ``fn(weight)`` for fc1 (and fc2 when ``output_layer_init_method`` is None);
            default ``nn.Linear``'s initialisation.
        output_layer_init_method: ``fn(weight)`` for fc2.
        perform_initialization, group, dtype, device: as for the linear layers.

    Forward: ``[..., h]`` (a sequence chunk with ``sequence_parallel``) -> same shape. One
    all-reduce forward and one backward (sequence parallel: all-gather + reduce-scatter
    forward; reduce-scatter + two all-gathers backward).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "gelu",
        bias: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
        perform_initialization: bool = True,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not (callable(activation) or activation in ACTIVATIONS):
            raise ValueError(
                f"ParallelMLP: activation must be one of {ACTIVATIONS} or a callable, got "
                f"{activation!r}"
            )
        group, _, tp = group_rank_and_size(group)
        divide(ffn_hidden_size, tp, "ParallelMLP ffn_hidden_size")
        gated = activation == "swiglu"
        common = {
            "sequence_parallel": sequence_parallel,
            "seq_dim": seq_dim,
            "perform_initialization": perform_initialization,
            "group": group,
            "dtype": dtype,
            "device": device,
        }
        self.activation = activation
        self.linear_fc1 = ColumnParallelLinear(
            hidden_size,
            ffn_hidden_size * (2 if gated else 1),
            bias=bias,
            gather_output=False,
            skip_bias_add=True,
            stride=2 if gated else 1,
            init_method=init_method,
            **common,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size,
            hidden_size,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=skip_bias_add,
            init_method=output_layer_init_method or init_method,
            **common,
        )
        self.group, self.tp_size = self.linear_fc1.group, self.linear_fc1.tp_size

    @collective_region("ParallelMLP.forward")
    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        intermediate = apply_bias_activation(intermediate, bias, self.activation)
        return self.linear_fc2(intermediate)
