"""Sibling column layers that share one input: one collective for the group.

Models such as Llama apply separate ``q_proj``, ``k_proj``, ``v_proj`` (and ``gate_proj``,
``up_proj``) to the same activation. If each column-parallel layer reduced its own input
gradient, a layer would cost five backward all-reduces instead of Megatron's two. Here the
activation enters the tensor-parallel region once, at the parent module (a forward pre-hook),
and the sibling layers are built with ``disable_grad_reduce=True`` (a plain local GEMM):

- without sequence parallel: identity forward, one all-reduce of the summed sibling gradients
  backward (the paper's ``f``);
- with sequence parallel: one all-gather of the sequence chunks forward, one reduce-scatter
  backward.

:func:`mtp.tensor_parallel.parallelize` does this for the plan style ``"shared_input"``; the
Hugging Face plans (:mod:`mtp.integrations.hf`) use it for attention and MLP blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mtp.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = ["enter_tensor_parallel_region", "scatter_module_input", "share_module_input"]


def enter_tensor_parallel_region(
    input_: torch.Tensor, group=None, *, sequence_parallel: bool = False, seq_dim: int = 0
) -> torch.Tensor:
    """The activation every sibling column layer (``disable_grad_reduce=True``) reads.

    ``input_``: the replicated activation ``[..., h]`` (or this rank's sequence chunk along
    ``seq_dim`` with ``sequence_parallel``). Returns the full activation; its backward
    all-reduces (or reduce-scatters) the gradient summed over every use, once.
    """
    if sequence_parallel:
        return gather_from_sequence_parallel_region(input_, True, group, seq_dim)
    return copy_to_tensor_model_parallel_region(input_, group)


def _replace_input(module: nn.Module, args: tuple, kwargs: dict, arg: str, fn) -> tuple:
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get(arg), torch.Tensor):
        return args, {**kwargs, arg: fn(kwargs[arg])}
    raise TypeError(
        f"{type(module).__name__}: the shared tensor-parallel input must be the first positional "
        f"argument or the keyword {arg!r}, got args={len(args)} and kwargs={sorted(kwargs)}"
    )


def share_module_input(
    module: nn.Module,
    group=None,
    *,
    sequence_parallel: bool = False,
    seq_dim: int = 0,
    arg: str = "hidden_states",
) -> Any:
    """Make ``module``'s input (first positional argument, or the keyword ``arg``) enter the
    tensor-parallel region once (:func:`enter_tensor_parallel_region`) before its forward.

    The column layers inside ``module`` must be built with ``disable_grad_reduce=True``.
    Returns the hook handle (``.remove()`` undoes it).
    """

    def hook(mod, args, kwargs):
        return _replace_input(
            mod,
            args,
            kwargs,
            arg,
            lambda x: enter_tensor_parallel_region(
                x, group, sequence_parallel=sequence_parallel, seq_dim=seq_dim
            ),
        )

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def scatter_module_input(
    module: nn.Module, group=None, *, seq_dim: int = 0, arg: str = "hidden_states"
) -> Any:
    """Split ``module``'s input along ``seq_dim`` into this rank's sequence chunk before its
    forward (backward: all-gather). Where a model enters the sequence-parallel region (e.g. its
    first transformer block) when the embedding's output must stay full-length."""

    def hook(mod, args, kwargs):
        return _replace_input(
            mod, args, kwargs, arg, lambda x: scatter_to_sequence_parallel_region(x, group, seq_dim)
        )

    return module.register_forward_pre_hook(hook, with_kwargs=True)
