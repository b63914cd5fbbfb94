"""mtp's grouped GEMMs in torchtitan's MoE experts (needs ``torchtitan``).

:class:`GroupedExperts` is torchtitan's ``torchtitan.models.common.moe.GroupedExperts`` with
its ``forward(x, num_tokens_per_expert)`` on mtp's kernels; the parameters stay torchtitan's
(``w1_EFD``, ``w3_EFD [E, F, D]``, ``w2_EDF [E, D, F]``, plain tensors or DTensors), so its
sharding plans and checkpoints are unchanged. Per call, without copying a weight:

- gate and up: two grouped GEMMs reading ``w1`` / ``w3`` transposed (``trans_b``) that write
  the two column halves of one ``[R, 2F]`` buffer;
- :func:`mtp.ops.bias_swiglu` on it (the fused kernel on CUDA);
- down: a grouped GEMM reading ``w2`` transposed.

The maths runs in the input's dtype (torchtitan's stock forward casts the input and the
weights to bf16 on every call); fp32 accumulation in the GEMMs.

::

    from mtp.integrations.torchtitan import apply_to_model
    apply_to_model(model)   # every torchtitan GroupedExperts in model, in place
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torchtitan.models.common.moe import GroupedExperts as _TitanGroupedExperts

from mtp.ops._backend import resolve_backend
from mtp.ops.bias_act import bias_swiglu
from mtp.ops.grouped_gemm import (
    GROUPED_GEMM_BACKENDS,
    grouped_gemm,
    grouped_gemm_wgrad,
    torch_grouped_mm,
)
from mtp.utils import qualified_name

__all__ = ["GroupedExperts", "apply_to_model", "grouped_swiglu_experts"]


def _backend(device: torch.device) -> str:
    """``"torch"`` (grouped_mm, counts read on the device) on the CPU, else the grouped GEMM's
    ``auto`` choice (as :class:`mtp.moe.GroupedMLP`)."""
    if device.type == "cpu" and torch_grouped_mm() is not None:
        return "torch"
    return resolve_backend("grouped_gemm", "auto", device, tuple(GROUPED_GEMM_BACKENDS))


class _GateUp(torch.autograd.Function):
    """``[x_e @ w1[e]^T | x_e @ w3[e]^T]`` into one ``[R, 2F]`` buffer (``w [E, F, D]``)."""

    @staticmethod
    def forward(ctx, x, w1, w3, counts, backend):
        f = w1.shape[1]
        h = x.new_empty(x.shape[0], 2 * f)
        for w, cols in ((w1, slice(None, f)), (w3, slice(f, None))):
            torch.ops.mtp.grouped_gemm_out(x, w, counts, h[:, cols], True, backend, None, None,
                                           None, "none", 7.0, 1.702, None, None,
                                           None)  # fmt: skip
        ctx.save_for_backward(x, w1, w3, counts)
        ctx.backend = backend
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        x, w1, w3, counts = ctx.saved_tensors
        f, backend = w1.shape[1], ctx.backend
        dg, du = dh[:, :f], dh[:, f:]
        need = ctx.needs_input_grad
        dx = dw1 = dw3 = None
        if need[0]:
            dx = grouped_gemm(dg, w1, counts, backend=backend, validate=False)
            dx = dx + grouped_gemm(du, w3, counts, backend=backend, validate=False)
        if need[1]:
            dw1 = grouped_gemm_wgrad(dg, x, counts, backend=backend)
        if need[2]:
            dw3 = grouped_gemm_wgrad(du, x, counts, backend=backend)
        return dx, dw1, dw3, None, None


def grouped_swiglu_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    """``(silu(x_e @ w1[e]^T) * (x_e @ w3[e]^T)) @ w2[e]^T`` per expert ``e``.

    Args:
        x: ``[R, D]`` rows grouped by expert (fp32/fp16/bf16).
        w1, w3: ``[E, F, D]``; w2: ``[E, D, F]`` (torchtitan's layouts), cast to ``x``'s dtype
            (no copy when they already are).
        num_tokens_per_expert: ``[E]`` integer counts on ``x``'s device; rows past their sum
            give zeros.

    Returns:
        ``[R, D]`` in ``x``'s dtype; differentiable in ``x`` and the weights.
    """
    for name, w, shape in (("w1", w1, (w1.shape[0], w1.shape[1], x.shape[1])),
                           ("w3", w3, tuple(w1.shape)),
                           ("w2", w2, (w1.shape[0], x.shape[1], w1.shape[1]))):  # fmt: skip
        if w.dim() != 3 or tuple(w.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} for x {list(x.shape)} and w1 "
                             f"{list(w1.shape)}, got {list(w.shape)}")  # fmt: skip
    if num_tokens_per_expert.shape != (w1.shape[0],):
        raise ValueError(f"num_tokens_per_expert must be [{w1.shape[0]}], got "
                         f"{list(num_tokens_per_expert.shape)}")  # fmt: skip
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    counts = num_tokens_per_expert.to(device=x.device)
    backend = _backend(x.device)
    h = _GateUp.apply(x, w1, w3, counts, backend)
    return grouped_gemm(bias_swiglu(h), w2, counts, trans_b=True, backend=backend,
                        validate=False)  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GroupedExperts(_TitanGroupedExperts):
    """torchtitan's ``GroupedExperts`` (same parameters, config and checkpoints) whose
    ``forward`` runs :func:`grouped_swiglu_experts`."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        return grouped_swiglu_experts(x_RD, w1, w2, w3, num_tokens_per_expert_E)


def apply_to_model(model: nn.Module) -> int:
    """Switch every ``torchtitan.models.common.moe.GroupedExperts`` in ``model`` (exactly that
    class) to :class:`GroupedExperts` in place (its parameters and hooks are kept). Returns how
    many modules were switched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {qualified_name(model)}")
    count = 0
    for module in model.modules():
        if type(module) is _TitanGroupedExperts:
            module.__class__ = GroupedExperts
            count += 1
    return count
