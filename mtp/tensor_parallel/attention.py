"""Tensor-parallel self-attention (Megatron-LM figure 3b): the fused QKV projection is split by
heads (column-parallel), each rank attends over its own heads, and the output projection is
row-parallel. One all-reduce forward, one backward."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.parallel.agreement import collective_region
from mtp.parallel.random import get_cuda_rng_tracker

from .layers import ColumnParallelLinear, RowParallelLinear
from .utils import (
    InitMethod,
    check_float_input,
    check_layer_args,
    check_positive_int,
    divide,
    group_rank_and_size,
)

__all__ = ["ParallelSelfAttention"]


class ParallelSelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention split by heads over the tp group.

    ``linear_qkv`` is a :class:`ColumnParallelLinear` ``h -> (nh + 2 nkv) d`` whose full weight
    stacks ``[q; k; v]`` (the nanoGPT / Hugging Face layout: rows ``[:nh d]`` are the queries,
    then the keys, then the values); each block is split by heads, so rank ``r`` holds query
    heads ``[r nh/tp, (r+1) nh/tp)`` and the matching key/value heads. Core attention is
    ``torch.nn.functional.scaled_dot_product_attention``; ``linear_proj`` is a
    :class:`RowParallelLinear` ``nh d -> h``. With the same seed this is exactly the
    single-device attention built from two ``nn.Linear`` layers.

    Args:
        hidden_size: ``h`` (divisible by ``num_heads``).
        num_heads: query heads ``nh`` (divisible by tp); head size ``d = h / nh``.
        num_kv_heads: key/value heads ``nkv`` for grouped-query attention (divides ``nh``
            and is divisible by tp); default ``nh``.
        bias: biases in both projections.
        causal: causal mask (each position attends to itself and earlier positions).
        attention_dropout: dropout on the attention probabilities while training, drawn from
            the ``"model-parallel-rng"`` stream (a different mask per tp rank, as each rank
            holds different heads): call :func:`mtp.parallel.model_parallel_manual_seed` first.
        softmax_scale: default ``1 / sqrt(d)``.
        skip_bias_add: return ``(output, proj_bias)`` with the bias not added.
        sequence_parallel, seq_dim: the layout: ``seq_dim=0`` for ``[s, b, h]`` (Megatron),
            1 for ``[b, s, h]``; with sequence parallel the input and output are sequence chunks.
        init_method, output_layer_init_method, perform_initialization, group, dtype, device: as
            for :class:`mtp.tensor_parallel.ParallelMLP`.

    Forward: ``hidden_states`` ``[s, b, h]`` (or ``[b, s, h]``); optional ``attention_mask``
    broadcastable to ``[b, 1, s, s]``, or ``[b, num_heads, s, s]`` with every head's mask (each
    rank keeps its heads'), ``s`` being the full sequence (bool: True = attend; floating: added
    to the scores; other dtypes and shapes raise ``TypeError``/``ValueError``), combined with
    the causal mask when ``causal``. Returns the same shape as the input.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        causal: bool = True,
        attention_dropout: float = 0.0,
        softmax_scale: float | None = None,
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
        name = "ParallelSelfAttention"
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for arg, value in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
        ):
            check_positive_int(name, arg, value)
        check_layer_args(
            name,
            flags={
                "bias": bias,
                "causal": causal,
                "skip_bias_add": skip_bias_add,
                "sequence_parallel": sequence_parallel,
                "perform_initialization": perform_initialization,
            },
            seq_dim=seq_dim,
            init_methods={
                "init_method": init_method,
                "output_layer_init_method": output_layer_init_method,
            },
            group=group,
            dtype=dtype,
            device=device,
        )
        if softmax_scale is not None and not (
            isinstance(softmax_scale, (int, float))
            and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale)
            and softmax_scale > 0
        ):
            raise ValueError(
                f"{name}: softmax_scale must be a finite positive number or None, got "
                f"{softmax_scale!r}"
            )
        if hidden_size % num_heads:
            raise ValueError(
                f"ParallelSelfAttention: hidden_size ({hidden_size}) must be divisible by "
                f"num_heads ({num_heads})"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"ParallelSelfAttention: num_heads ({num_heads}) must be divisible by "
                f"num_kv_heads ({num_kv_heads})"
            )
        if seq_dim not in (0, 1):
            raise ValueError(f"ParallelSelfAttention: seq_dim must be 0 or 1, got {seq_dim}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(
                f"ParallelSelfAttention: attention_dropout must be in [0, 1), got "
                f"{attention_dropout}"
            )
        group, tp_rank, tp = group_rank_and_size(group)
        self.group, self.tp_size, self.tp_rank = group, tp, tp_rank
        self.num_heads_per_partition = divide(num_heads, tp, "ParallelSelfAttention num_heads")
        self.num_kv_heads_per_partition = divide(
            num_kv_heads, tp, "ParallelSelfAttention num_kv_heads"
        )
        d = hidden_size // num_heads
        common = {
            "bias": bias,
            "sequence_parallel": sequence_parallel,
            "seq_dim": seq_dim,
            "perform_initialization": perform_initialization,
            "group": group,
            "dtype": dtype,
            "device": device,
        }
        self.linear_qkv = ColumnParallelLinear(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * d,
            gather_output=False,
            stride=[num_heads * d, num_kv_heads * d, num_kv_heads * d],
            init_method=init_method,
            **common,
        )
        self.linear_proj = RowParallelLinear(
            num_heads * d,
            hidden_size,
            input_is_parallel=True,
            skip_bias_add=skip_bias_add,
            init_method=output_layer_init_method or init_method,
            **common,
        )
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.causal, self.seq_dim = d, causal, seq_dim
        self.attention_dropout = attention_dropout
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    def _to_heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """``[s, b, heads d]`` / ``[b, s, heads d]`` -> ``[b, heads, s, d]``."""
        t = t.unflatten(-1, (heads, self.head_dim))
        return t.permute(1, 2, 0, 3) if self.seq_dim == 0 else t.transpose(1, 2)

    def _check_mask(self, mask: object, b: int, s: int) -> torch.Tensor | None:
        """``attention_mask`` checked against ``[b, 1 or num_heads, s, s]``; a per-head mask
        is narrowed to this rank's heads."""
        if mask is None:
            return None
        name = "ParallelSelfAttention: attention_mask"
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(
                f"{name} must be bool (True = attend) or floating (added to the scores), got "
                f"{mask.dtype}; convert an integer 0/1 mask with .bool()"
            )
        heads = mask.size(-3) if mask.dim() >= 3 else 1
        target = (b, heads if heads == self.num_heads else 1, s, s)
        try:
            ok = 2 <= mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, target) == target
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"{name} of shape {tuple(mask.shape)} does not broadcast to [b, 1, s, s] = "
                f"{[b, 1, s, s]} (or [b, num_heads, s, s] = {[b, self.num_heads, s, s]})"
            )
        if heads == self.num_heads and heads > 1:  # this rank's heads
            n = self.num_heads_per_partition
            mask = mask.narrow(-3, self.tp_rank * n, n)
        return mask

    def _mask(self, attention_mask: torch.Tensor | None, s: int, like: torch.Tensor):
        if attention_mask is None:
            return None
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(like.dtype)
        if not self.causal:
            return attention_mask
        causal = torch.ones(s, s, dtype=torch.bool, device=like.device).tril()
        if attention_mask.dtype == torch.bool:
            return attention_mask & causal
        return attention_mask.masked_fill(~causal, float("-inf"))

    @collective_region("ParallelSelfAttention.forward")
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
        name = "ParallelSelfAttention"
        check_float_input(name, "hidden_states", hidden_states, self.linear_qkv.weight)
        if hidden_states.dim() != 3:
            raise ValueError(
                f"ParallelSelfAttention: hidden_states must be 3-D ([s, b, h] or [b, s, h]), "
                f"got shape {tuple(hidden_states.shape)}"
            )
        s_local = hidden_states.size(self.seq_dim)
        s = s_local * self.tp_size if self.linear_qkv.sequence_parallel else s_local
        attention_mask = self._check_mask(attention_mask, hidden_states.size(1 - self.seq_dim), s)
        qkv = self.linear_qkv(hidden_states)
        nq, nkv = self.num_heads_per_partition, self.num_kv_heads_per_partition
        d = self.head_dim
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q, k, v = self._to_heads(q, nq), self._to_heads(k, nkv), self._to_heads(v, nkv)
        if nkv != nq:
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)
        mask = self._mask(attention_mask, q.size(2), q)
        dropout = self.attention_dropout if self.training else 0.0
        kwargs = {
            "attn_mask": mask,
            "dropout_p": dropout,
            "is_causal": self.causal and mask is None,
            "scale": self.softmax_scale,
        }
        if dropout > 0.0:
            with get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, heads, s, d] -> [s, b, heads d] / [b, s, heads d]
        context = context.permute(2, 0, 1, 3) if self.seq_dim == 0 else context.transpose(1, 2)
        return self.linear_proj(context.flatten(-2))

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, tp={self.tp_size}, causal={self.causal}"
        )
