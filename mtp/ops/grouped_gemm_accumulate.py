"""Grouped GEMM whose weight gradient is added to ``w.main_grad``: Megatron-Core's
*gradient-accumulation fusion* for the experts (:func:`grouped_gemm_accumulate_wgrad`).

With half-precision weights a trainer keeps an fp32 ``main_grad`` per parameter (mtp's and
Megatron's ``DistributedDataParallel`` make it a view of the bucket's gradient buffer). Plain
autograd writes the weight gradient in the weight's dtype (bf16: 8 mantissa bits) and then adds
it to ``main_grad`` in a second pass. Here the backward adds ``x_e^T dy_e`` to ``main_grad``
directly:

* ``backend="triton"``: in the weight-gradient kernel's epilogue (the fp32 accumulator plus the
  loaded ``main_grad``, stored once: no bf16 rounding of the gradient, no extra pass or buffer),
  TMA and split-K kernels included;
* other backends: their weight gradient (in ``x``'s dtype) is added with ``main_grad.add_``
  (the same result as unfused autograd; for comparison and CPU use).

The protocol is Megatron's: after adding, the backward sets ``w.grad_added_to_main_grad = True``
and returns a placeholder gradient that the data-parallel hook drops (mtp's
:class:`~mtp.optim.DistributedDataParallel` checks the flag), so the bucket's readiness hook
still fires; a weight without that attribute (no such wrapper) gets no ``.grad`` at all.
"""

from __future__ import annotations

import torch

from mtp.kernels import grouped_gemm as _kernels
from mtp.ops.grouped_gemm import prepare_call
from mtp.ops.grouped_gemm_bias import expert_bias_grad

__all__ = ["accumulate_weight_grad", "check_main_grad", "grouped_gemm_accumulate_wgrad"]


def check_main_grad(w: torch.Tensor) -> None:
    main = getattr(w, "main_grad", None)
    if not isinstance(main, torch.Tensor):
        raise ValueError(
            "w has no main_grad: gradient-accumulation fusion adds the weight gradient to "
            "w.main_grad (wrap the model in mtp.optim.DistributedDataParallel, or set "
            "w.main_grad = torch.zeros_like(w, dtype=torch.float32))"
        )
    if main.shape != w.shape or main.device != w.device or not main.dtype.is_floating_point:
        raise ValueError(
            f"w.main_grad must be a floating tensor of w's shape {tuple(w.shape)} on "
            f"{w.device}, got {main.dtype} {tuple(main.shape)} on {main.device}"
        )


def _accumulate(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts, backend: str):
    """``w.main_grad[e] += x_e^T dy_e``."""
    main = w.main_grad
    if backend == "triton":
        _kernels.grouped_wgrad(x, dy, counts, main, accumulate=True)
    else:
        main.add_(torch.ops.mtp.grouped_gemm_wgrad(x, dy, counts, backend))


def accumulate_weight_grad(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts,
                           backend: str) -> torch.Tensor | None:  # fmt: skip
    """``w.main_grad[e] += x_e^T dy_e``, then the gradient autograd should return for ``w``: a
    placeholder when ``w`` has Megatron's ``grad_added_to_main_grad`` flag (set here; the
    data-parallel hook drops it), else None."""
    _accumulate(w, x, dy, counts, backend)
    if hasattr(w, "grad_added_to_main_grad"):  # a DDP hook waits for a gradient
        w.grad_added_to_main_grad = True
        return torch.empty_like(w)  # never read: the hook sees the flag and drops it
    return None


class _GroupedGemmAccumulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, backend, bias):
        ctx.save_for_backward(x, w, counts)
        ctx.backend = backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.ops.mtp.grouped_gemm(x, w, counts, False, backend, bias)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            db = expert_bias_grad(dy, counts, ctx.backend).to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            dx = torch.ops.mtp.grouped_gemm(dy, w, counts, True, ctx.backend)
        if ctx.needs_input_grad[1]:
            dw = accumulate_weight_grad(w, x, dy, counts, ctx.backend)
        return dx, dw, None, None, db


def grouped_gemm_accumulate_wgrad(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e] (+ bias[e])`` whose backward adds ``dW`` to
    ``w.main_grad``.

    Args:
        x: ``[M, K]`` fp32/fp16/bf16, rows grouped by expert.
        w: ``[E, K, N]`` leaf weight in ``x``'s dtype with a ``main_grad`` of the same shape
            (fp32 usually; any floating dtype).
        tokens_per_expert, backend, validate, bias: as :func:`mtp.ops.grouped_gemm` (the bias
            gets its gradient as usual).

    Returns:
        ``y [M, N]`` in ``x``'s dtype. ``x`` gets its gradient as usual; ``w`` gets none (see the
        module doc): ``w.main_grad[e] += x_e^T dy_e`` instead.

    Raises:
        ValueError, TypeError: as :func:`mtp.ops.grouped_gemm`, and a missing or mis-shaped
            ``main_grad`` (when ``w`` requires grad).
    """
    name, counts = prepare_call(x, w, tokens_per_expert, False, None, backend, validate, bias)
    if w.requires_grad:
        check_main_grad(w)
    needs_grad = any(t is not None and t.requires_grad for t in (x, w, bias))
    if not torch.is_grad_enabled() or not needs_grad:
        return torch.ops.mtp.grouped_gemm(x, w, counts, False, name, bias)
    return _GroupedGemmAccumulate.apply(x, w, counts, name, bias)
