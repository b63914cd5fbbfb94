"""The expert MLP of an MoE layer with fused epilogues: :func:`grouped_mlp`.

``out[rows of e] = (act(x_e @ w1[e] + b1[e]) * p) @ w2[e] + b2[e]`` for each expert ``e`` (``p``:
each row's routing probability, applied before fc2 as in Megatron-Core), zeros past
``sum(tokens_per_expert)``.

``backend="triton"`` runs two launches forward and four grouped GEMMs backward (plus the
per-expert bias sums) and nothing else on ``[M, F]`` tensors (:mod:`mtp.kernels.grouped_gemm_act`,
with TMA versions in :mod:`mtp.kernels.grouped_gemm_act_tma` for fp16/bf16 on sm_90+; the other
GEMMs are :func:`mtp.ops.grouped_gemm`'s):

* forward: fc1 with bias, activation and probability in its epilogue (stores the
  pre-activation ``h`` for the backward and ``y = act(h) * p``), then fc2 with its bias;
* backward: fc2's data gradient with the activation's backward and ``dL/dp`` in its epilogue
  (writes ``dh`` directly: ``dL/dy`` is never stored), the two weight gradients, fc1's data
  gradient and the per-expert bias sums.

Custom ops: ``mtp::grouped_gemm_act(x, w1, counts, bias, probs, act, limit, alpha) -> (h, y)``
and ``mtp::grouped_gemm_dact(dy, w2, counts, h, probs, act, limit, alpha) -> (dh, dprobs)``,
with fakes (``limit`` / ``alpha``: the clamped SwiGLU's).
``backend="reference"`` composes the unfused ops (per-expert loop GEMMs, fp32 activation) with
the same contract, for comparison and CPUs without the Triton interpreter.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mtp.ops._backend import resolve_backend
from mtp.ops.bias_act import bias_gelu, bias_swiglu
from mtp.ops.grouped_gemm import grouped_gemm, prepare_call
from mtp.ops.grouped_gemm_accumulate import (
    accumulate_weight_grad,
    check_main_grad,
    grouped_gemm_accumulate_wgrad,
)
from mtp.ops.grouped_gemm_bias import expert_bias_grad
from mtp.utils import check_tensor, empty

__all__ = ["grouped_mlp", "clamped_swiglu", "GROUPED_MLP_ACTIVATIONS"]

#: Activations fused into the epilogues (``"gelu"``: exact erf GeLU).
GROUPED_MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "clamped_swiglu")
_GATED = ("swiglu", "clamped_swiglu")
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def clamped_swiglu(h: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """GPT-OSS's SwiGLU on interleaved columns: ``gate = h[..., 0::2].clamp(max=limit)``,
    ``up = h[..., 1::2].clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = h[..., 0::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _width(w1: torch.Tensor, act: str) -> int:
    """``F``: fc1's output columns after the activation."""
    return w1.shape[2] // 2 if act in _GATED else w1.shape[2]


@torch.library.custom_op("mtp::grouped_gemm_act", mutates_args=())
def _act_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    counts: torch.Tensor,
    bias: torch.Tensor | None,
    probs: torch.Tensor | None,
    act: str,
    limit: float,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from mtp.kernels.grouped_gemm_act import grouped_gemm_act

    h = empty((x.shape[0], w1.shape[2]), dtype=x.dtype, device=x.device)
    y = empty((x.shape[0], _width(w1, act)), dtype=x.dtype, device=x.device)
    grouped_gemm_act(x, w1, counts, h, y, act, bias=bias, probs=probs, limit=limit, alpha=alpha)
    return h, y


@_act_op.register_fake
def _(x, w1, counts, bias, probs, act, limit, alpha):
    return x.new_empty(x.shape[0], w1.shape[2]), x.new_empty(x.shape[0], _width(w1, act))


@torch.library.custom_op("mtp::grouped_gemm_dact", mutates_args=())
def _dact_op(
    dy: torch.Tensor,
    w2: torch.Tensor,
    counts: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None,
    act: str,
    limit: float,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from mtp.kernels.grouped_gemm_act import grouped_gemm_dact

    dh = empty(h.shape, dtype=h.dtype, device=h.device)
    part = grouped_gemm_dact(dy, w2.transpose(1, 2), counts, h, dh, act, probs=probs,
                             limit=limit, alpha=alpha)  # fmt: skip
    if part is None:
        return dh, dy.new_empty((0,), dtype=torch.float32)
    return dh, part.sum(0)  # fixed order over the column tiles: deterministic


@_dact_op.register_fake
def _(dy, w2, counts, h, probs, act, limit, alpha):
    n = 0 if probs is None else dy.shape[0]
    return h.new_empty(h.shape), dy.new_empty((n,), dtype=torch.float32)


def _weight_grad(w, a, b, counts, accumulate: bool):
    if accumulate:
        return accumulate_weight_grad(w, a, b, counts, "triton")
    return torch.ops.mtp.grouped_gemm_wgrad(a, b, counts, "triton")


class _FusedGroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, counts, probs, b1, b2, act, accumulate):
        act, limit, alpha = act
        h, y = torch.ops.mtp.grouped_gemm_act(x, w1, counts, b1, probs, act, limit, alpha)
        out = torch.ops.mtp.grouped_gemm(y, w2, counts, False, "triton", b2)
        ctx.save_for_backward(x, w1, w2, counts, probs, h, y)
        ctx.act, ctx.accumulate = (act, limit, alpha), accumulate
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (probs, b1, b2))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, w1, w2, counts, probs, h, y = ctx.saved_tensors
        need = ctx.needs_input_grad
        p_dtype, b1_dtype, b2_dtype = ctx.dtypes
        dout = dout.contiguous()
        dx = dw1 = dw2 = dp = db1 = db2 = None
        if need[6]:
            db2 = expert_bias_grad(dout, counts, "triton").to(b2_dtype)
        if need[2]:
            dw2 = _weight_grad(w2, y, dout, counts, ctx.accumulate)
        if need[0] or need[1] or need[4] or need[5]:
            dh, dprobs = torch.ops.mtp.grouped_gemm_dact(dout, w2, counts, h, probs, *ctx.act)
            if need[4]:
                dp = dprobs.to(p_dtype)
            if need[5]:
                db1 = expert_bias_grad(dh, counts, "triton").to(b1_dtype)
            if need[1]:
                dw1 = _weight_grad(w1, x, dh, counts, ctx.accumulate)
            if need[0]:
                dx = torch.ops.mtp.grouped_gemm(dh, w1, counts, True, "triton")
        return dx, dw1, dw2, None, dp, db1, db2, None, None


def _reference(x, w1, w2, counts, probs, b1, b2, act, accumulate):
    """The unfused chain: grouped GEMM (per-expert loop), fp32 activation, scale, grouped GEMM."""
    act, limit, alpha = act

    def gemm(a, w, bias):
        if accumulate and w.requires_grad and torch.is_grad_enabled():
            return grouped_gemm_accumulate_wgrad(a, w, counts, backend="reference",
                                                 validate=False, bias=bias)  # fmt: skip
        return grouped_gemm(a, w, counts, backend="reference", validate=False, bias=bias)

    h = gemm(x, w1, b1)
    if act == "clamped_swiglu":
        y = clamped_swiglu(h.float(), limit, alpha).to(h.dtype)
    elif act == "swiglu":
        y = bias_swiglu(h, backend="reference")
    else:
        y = bias_gelu(h, approximate="tanh" if act == "gelu_tanh" else "none",
                      backend="reference")  # fmt: skip
    if probs is not None:
        y = (y.float() * probs.float().unsqueeze(-1)).to(y.dtype)
    return gemm(y, w2, b2)


def _check(x, weight1, weight2, probs, bias2, activation: str) -> None:
    if activation not in GROUPED_MLP_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {GROUPED_MLP_ACTIVATIONS}, got {activation!r}"
        )
    if activation in _GATED and weight1.shape[2] % 2:
        raise ValueError(
            f"weight1 [E, H, 2F] holds the gate and up columns for {activation!r}: its last dim "
            f"must be even, got {tuple(weight1.shape)}"
        )
    E, H, F = weight1.shape[0], x.shape[1], _width(weight1, activation)
    check_tensor("weight2", weight2, ndim=3, dtypes=(x.dtype,), device=x.device)
    if tuple(weight2.shape) != (E, F, H):
        raise ValueError(f"weight2 must be [{E}, {F}, {H}] (experts, F, H) for weight1 "
                         f"{tuple(weight1.shape)}, got {tuple(weight2.shape)}")  # fmt: skip
    if bias2 is not None:
        check_tensor("bias2", bias2, ndim=2, dtypes=_FLOAT, device=x.device)
        if tuple(bias2.shape) != (E, H):
            raise ValueError(f"bias2 must be [{E}, {H}], got {tuple(bias2.shape)}")
    if probs is not None:
        check_tensor("probs", probs, ndim=1, dtypes=_FLOAT, device=x.device)
        if probs.shape[0] != x.shape[0]:
            raise ValueError(f"probs must be [{x.shape[0]}] (one per row of x), got "
                             f"{tuple(probs.shape)}")  # fmt: skip


def grouped_mlp(
    x: torch.Tensor,
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    probs: torch.Tensor | None = None,
    bias1: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    *,
    activation: str = "swiglu",
    activation_limit: float = 7.0,
    activation_alpha: float = 1.702,
    gradient_accumulation_fusion: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """The experts' MLP with fused epilogues (see the module doc).

    Args:
        x: ``[M, H]`` float32/float16/bfloat16, rows grouped by expert.
        weight1: ``[E, H, W]`` in ``x``'s dtype; ``W = 2F`` for ``"swiglu"`` (columns
            ``[0, F)`` are the gate, through SiLU, ``[F, 2F)`` the up projection: Megatron's
            ``chunk(2, -1)`` layout), ``W = F`` for ``"gelu"`` (erf) / ``"gelu_tanh"``.
        weight2: ``[E, F, H]`` in ``x``'s dtype.
        tokens_per_expert: ``[E]`` int32/int64 on ``x``'s device (never read on the host
            unless ``validate``, see :func:`mtp.ops.grouped_gemm`).
        probs: ``[M]`` routing probabilities (any float dtype) multiplying ``act(h)`` before
            fc2, or None. Its gradient is ``sum_f dL/dy * act(h)`` (fp32, fixed order).
        bias1, bias2: ``[E, W]`` and ``[E, H]`` per-expert biases, or None.
        activation: ``"swiglu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"clamped_swiglu"`` (GPT-OSS:
            ``W = 2F`` interleaved, gate in column ``2j``, up in ``2j + 1``, see
            :func:`clamped_swiglu`; pointer kernels, no TMA).
        activation_limit, activation_alpha: the clamped SwiGLU's ``limit`` and ``alpha``.
        gradient_accumulation_fusion: add the weight gradients to ``weight1.main_grad`` /
            ``weight2.main_grad`` in the weight-gradient kernels' epilogue (see
            :func:`mtp.ops.grouped_gemm_accumulate_wgrad`).
        backend: ``"auto"`` (``"triton"`` on CUDA, else ``"reference"``; ``MTP_BACKEND``),
            ``"triton"`` (fused) or ``"reference"`` (unfused, loop GEMMs).
        validate: check the counts' values (two numbers read on the host; skipped while
            tracing or capturing).

    Returns:
        ``[M, H]`` in ``x``'s dtype; rows past ``sum(tokens_per_expert)`` are zero.
        Differentiable in ``x``, the weights, biases and ``probs`` (once).
    """
    name = resolve_backend("grouped_mlp", backend, x.device, ("triton", "reference"))
    _, counts = prepare_call(x, weight1, tokens_per_expert, False, None, name, validate, bias1)
    _check(x, weight1, weight2, probs, bias2, activation)
    if gradient_accumulation_fusion:
        for w in (weight1, weight2):
            if w.requires_grad:
                check_main_grad(w)
    accumulate = bool(gradient_accumulation_fusion)
    act = (activation, float(activation_limit), float(activation_alpha))
    if name == "reference":
        return _reference(x, weight1, weight2, counts, probs, bias1, bias2, act, accumulate)
    probs = None if probs is None else probs.contiguous()
    bias1 = None if bias1 is None else bias1.contiguous()
    bias2 = None if bias2 is None else bias2.contiguous()
    return _FusedGroupedMLP.apply(x, weight1, weight2, counts, probs, bias1, bias2, act,
                                  accumulate)  # fmt: skip
