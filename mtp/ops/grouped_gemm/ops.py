"""The custom ops of :func:`mtp.ops.grouped_gemm` (each with its fake, the only registrations of
the grouped GEMM), their bodies as plain functions, and the autograd formula of every option.

Two paths run the same bodies: the custom ops (``torch.ops.mtp.grouped_gemm_out``, ``_wgrad``,
``_dact``: what torch.compile, FakeTensor tracing and functorch see; each call derives its own
routing metadata from the counts) and the eager path, which calls the bodies directly with the
:class:`~mtp.kernels.grouped_gemm_details.routing.Routing` of the op call (tile maps and expert
rows derived once, shared by every GEMM of the call, forward and backward). The helpers below
take ``routing``: None means the custom ops.
"""

from __future__ import annotations

import torch

from mtp.ops._eager import eager
from mtp.ops.grouped_gemm.backends import (
    GROUPED_GEMM_BACKENDS,
    activation_reference,
    add_expert_bias_,
    expert_bias_sums,
    triton_dgrad_act,
    triton_forward,
    triton_forward_act,
    triton_wgrad,
)
from mtp.ops.grouped_gemm.checks import ACTIVATIONS, GATED
from mtp.utils import empty

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "GroupedGemmFunction",
    "activation_width",
    "bias_grad",
    "dact",
    "forward",
    "run_dact",
    "run_out",
    "run_wgrad",
    "weight_grad",
]



def activation_width(n: int, activation: str | None) -> int:
    """Columns of the result: ``N``, or ``N / 2`` after a gated activation."""
    return n // 2 if activation in GATED else n


# --------------------------------------------------------------------------------------------
# Custom ops: the device work, opaque to torch.compile (fakes below each)
# --------------------------------------------------------------------------------------------


def run_out(x, w, counts, out, trans_b, backend, bias, h, probs, activation, limit, alpha,
            routing=None, gather=None, row_probs=None, scatter=None) -> None:  # fmt: skip
    """The body of ``mtp::grouped_gemm_out`` (``routing``: the eager path's)."""
    if scatter is not None:  # the triton backend's scattered fc2 (grouped_mlp checks it)
        triton_forward(x, w, counts, trans_b, out, bias, routing, scatter)
        return
    if gather is not None:  # the triton backend's gathered fc1 (grouped_mlp checks it)
        triton_forward_act(x, w, counts, trans_b, h, out, activation,
                           None if bias is None else bias.contiguous(), probs, limit, alpha,
                           routing, gather, row_probs)  # fmt: skip
        return
    impl = GROUPED_GEMM_BACKENDS[backend]
    if activation == "none":
        if impl.fused_epilogues:
            impl.forward(x, w, counts, trans_b, out, bias, routing)
            return
        impl.forward(x, w, counts, trans_b, out)
        if bias is not None:
            add_expert_bias_(out, bias, counts)
        return
    if impl.fused_epilogues:
        triton_forward_act(x, w, counts, trans_b, h, out, activation,
                           None if bias is None else bias.contiguous(),
                           None if probs is None else probs.contiguous(), limit, alpha,
                           routing)  # fmt: skip
        return
    impl.forward(x, w, counts, trans_b, h)
    if bias is not None:
        add_expert_bias_(h, bias, counts)
    out.copy_(activation_reference(h, activation, probs, limit, alpha))


@torch.library.custom_op("mtp::grouped_gemm_out", mutates_args=("out", "h", "row_probs"))
def _forward_op(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    trans_b: bool,
    backend: str,
    bias: torch.Tensor | None,
    h: torch.Tensor | None,
    probs: torch.Tensor | None,
    activation: str,
    limit: float,
    alpha: float,
    gather: torch.Tensor | None,
    row_probs: torch.Tensor | None,
    scatter: torch.Tensor | None,
) -> None:
    """``out = x @ w[e] (+ bias[e])`` per expert; with an ``activation``: ``h`` gets that
    pre-activation and ``out = act(h) * probs``. Zeros past ``sum(tokens_per_expert)``. With
    ``gather`` (``[M]``, triton, an activation) row ``r`` reads ``x[gather[r]]`` and the
    probability ``probs[gather[r] (, e)]``, which ``row_probs`` receives. With ``scatter``
    (``[M]``, triton, no activation) row ``r`` is stored at ``out[scatter[r]]``.

    No argument has a default: torch 2.11's in-place kernel of a custom op finds a mutated
    argument by its position in a list whose trailing defaults were dropped (``h`` at 7 was
    out of range whenever ``h, probs, ...`` were all defaults: IndexError on the H200)."""
    run_out(x, w, tokens_per_expert, out, trans_b, backend, bias, h, probs, activation, limit,
            alpha, None, gather, row_probs, scatter)


@_forward_op.register_fake
def _(x, w, tokens_per_expert, out, trans_b, backend, bias, h, probs, activation, limit, alpha,
      gather, row_probs, scatter):
    return None


def run_wgrad(a, b, counts, out, backend, accumulate=False, routing=None, gather=None) -> None:
    """The body of ``mtp::grouped_gemm_wgrad`` (``routing``: the eager path's)."""
    if gather is not None:
        triton_wgrad(a, b, counts, out, accumulate, routing, gather)
        return
    impl = GROUPED_GEMM_BACKENDS[backend]
    if impl.fused_epilogues:
        impl.wgrad(a, b, counts, out, accumulate, routing)
    elif not accumulate:
        impl.wgrad(a, b, counts, out)
    else:
        out.add_(impl.wgrad(a, b, counts, None))


@torch.library.custom_op("mtp::grouped_gemm_wgrad", mutates_args=("out",))
def _wgrad_op(
    a: torch.Tensor,
    b: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    backend: str,
    accumulate: bool = False,
    gather: torch.Tensor | None = None,
) -> None:
    """``out[e] = a_e^T b_e`` (``[E, P, Q]`` for ``a [M, P]``, ``b [M, Q]``); ``accumulate``:
    ``out[e] += ...`` (in the epilogue, fp32, where the backend fuses it); ``gather`` (``[M]``,
    triton): row ``r`` of ``a`` is ``a[gather[r]]``."""
    run_wgrad(a, b, tokens_per_expert, out, backend, accumulate, None, gather)


@_wgrad_op.register_fake
def _(a, b, tokens_per_expert, out, backend, accumulate=False, gather=None):
    return None


def run_dact(dy, w, counts, h, probs, activation, limit, alpha, routing=None, recompute=False):
    """The body of ``mtp::grouped_gemm_dact`` (``routing``: the eager path's)."""
    dh = empty(h.shape, dtype=h.dtype, device=h.device)
    F = w.shape[1]
    y = empty((h.shape[0], F if recompute else 0), dtype=h.dtype, device=h.device)
    part = triton_dgrad_act(dy, w, counts, h, dh, activation, probs, limit, alpha, routing,
                            y if recompute else None)  # fmt: skip
    if part is None:
        return dh, dy.new_empty((0,), dtype=torch.float32), y
    return dh, part.sum(0), y  # fixed order over the column tiles: deterministic


@torch.library.custom_op("mtp::grouped_gemm_dact", mutates_args=())
def _dact_op(
    dy: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None,
    activation: str,
    limit: float,
    alpha: float,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh, dprobs, y)``: ``dh = (dy @ w[e]^T) * probs * act'(h)`` (``w [E, F, K]``: the weight
    of the GEMM after the activation), ``dL/dprobs`` (fp32; empty without ``probs``) and, with
    ``recompute``, ``y = act(h) * probs`` (``[M, F]``, the forward's output again, bit-equal;
    ``[M, 0]`` without)."""
    return run_dact(dy, w, counts, h, probs, activation, limit, alpha, None, recompute)


@_dact_op.register_fake
def _(dy, w, counts, h, probs, activation, limit, alpha, recompute=False):
    M, F = dy.shape[0], w.shape[1]
    return (h.new_empty(h.shape), dy.new_empty((0 if probs is None else M,), dtype=torch.float32),
            h.new_empty((M, F if recompute else 0)))


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


def forward(x, w, counts, out, bias, probs, trans_b, backend, act, limit, alpha, routing=None,
            gather=None, row_probs=None, scatter=None):  # fmt: skip
    """``(y, h)``: the forward into ``out`` (or a new buffer); ``h`` the pre-activation. With
    ``gather`` (``[M]``) the rows are ``x[gather]``, with ``scatter`` row ``r`` goes to
    ``y[scatter[r]]`` (see ``mtp::grouped_gemm_out``)."""
    n = w.shape[1] if trans_b else w.shape[2]
    M = x.shape[0] if gather is None else gather.shape[0]
    y = out if out is not None else empty((M, n // 2 if act in GATED else n), dtype=x.dtype,
                                          device=x.device)  # fmt: skip
    h = None if act is None else empty((M, n), dtype=x.dtype, device=x.device)
    if routing is None:
        torch.ops.mtp.grouped_gemm_out(x, w, counts, y, trans_b, backend, bias, h, probs,
                                       act or "none", limit, alpha, gather, row_probs,
                                       scatter)  # fmt: skip
    else:
        run_out(x, w, counts, y, trans_b, backend, bias, h, probs, act or "none", limit, alpha,
                routing, gather, row_probs, scatter)  # fmt: skip
    return y, h


def dact(dy, w, counts, h, probs, act, limit, alpha, routing=None, recompute=False):
    """``(dh, dprobs, y)`` of ``mtp::grouped_gemm_dact`` (``routing``: the eager path's)."""
    if routing is None:
        return torch.ops.mtp.grouped_gemm_dact(dy, w, counts, h, probs, act, limit, alpha,
                                               recompute)  # fmt: skip
    return run_dact(dy, w, counts, h, probs, act, limit, alpha, routing, recompute)


def bias_grad(dy: torch.Tensor, counts: torch.Tensor, backend: str, routing=None) -> torch.Tensor:
    """fp32 ``[E, N]``: the sum of ``dy``'s rows of each expert. Fused backends: their weight
    gradient with a column of ones as the left operand (``1_e^T dy_e``: one launch, fp32
    accumulation, exact zeros for empty experts, no copy of ``dy``); otherwise a segment sum."""
    E, (M, N) = counts.shape[0], dy.shape
    if not GROUPED_GEMM_BACKENDS[backend].fused_epilogues:
        return expert_bias_sums(dy, counts)
    ones = torch.ones((1, 1), dtype=dy.dtype, device=dy.device).expand(M, 1)
    out = torch.empty((E, 1, N), dtype=torch.float32, device=dy.device)
    _wgrad(ones, dy, counts, out, backend, False, routing)
    return out.view(E, N)


def _wgrad(a, b, counts, out, backend, accumulate, routing, gather=None) -> None:
    if routing is None:
        torch.ops.mtp.grouped_gemm_wgrad(a, b, counts, out, backend, accumulate, gather)
    else:
        run_wgrad(a, b, counts, out, backend, accumulate, routing, gather)


def weight_grad(w, a, b, counts, backend: str, accumulate: bool,
                routing=None, gather=None) -> torch.Tensor | None:  # fmt: skip
    """``dW[e] = a_e^T b_e`` (``gather``: row ``r`` of ``a`` is ``a[gather[r]]``). With
    ``accumulate``: added to ``w.main_grad`` instead, and the gradient autograd returns is a
    placeholder when ``w`` has Megatron's ``grad_added_to_main_grad`` flag (set here; the
    data-parallel hook drops it), else None."""
    if not accumulate:
        dw = empty((counts.shape[0], a.shape[1], b.shape[1]), dtype=a.dtype, device=a.device)
        _wgrad(a, b, counts, dw, backend, False, routing, gather)
        return dw
    _wgrad(a, b, counts, w.main_grad, backend, True, routing, gather)
    if hasattr(w, "grad_added_to_main_grad"):  # a DDP hook waits for a gradient
        w.grad_added_to_main_grad = True
        return torch.empty_like(w)  # never read: the hook sees the flag and drops it
    return None


def _activation_backward(h, dy, probs, act, limit, alpha, need_probs: bool):
    """``(dL/dh, dL/dprobs)`` of ``y = act(h) * probs`` by a PyTorch pass (the standalone
    activation epilogue; :func:`mtp.ops.grouped_mlp` fuses it into the next GEMM instead)."""
    with torch.enable_grad():
        hh = h.detach().requires_grad_()
        pp = None if probs is None else probs.detach().requires_grad_(need_probs)
        y = activation_reference(hh, act, pp, limit, alpha)
        inputs = [hh, pp] if need_probs else [hh]
        grads = torch.autograd.grad(y, inputs, dy)
    return grads[0], (grads[1] if need_probs else None)


class GroupedGemmFunction(torch.autograd.Function):
    """Every option of :func:`mtp.ops.grouped_gemm`: forward through ``mtp::grouped_gemm_out``,
    backward through the same op (data gradient) and ``mtp::grouped_gemm_wgrad`` (weight and
    bias); with a ``routing`` (the eager path) through their bodies directly.

    ``apply(x, w, bias, probs, out, counts, call)`` with ``call = (trans_b, backend, act, limit,
    alpha, accumulate, routing)`` (one argument: autograd's cost grows with their number)."""

    @staticmethod
    def forward(ctx, x, w, bias, probs, out, counts, call):
        trans_b, backend, act, limit, alpha, _, routing = call
        y, h = forward(x, w, counts, out, bias, probs, trans_b, backend, act, limit, alpha,
                       routing)  # fmt: skip
        if out is not None:
            ctx.mark_dirty(out)
        if act is None:  # no h, no probs: fewer saved tensors, less autograd work
            ctx.save_for_backward(x, w, counts)
        else:
            ctx.save_for_backward(x, w, counts, h, probs)
        ctx.call = call
        if bias is not None or probs is not None:
            ctx.dtypes = (None if bias is None else bias.dtype,
                          None if probs is None else probs.dtype)  # fmt: skip
        return y

    @staticmethod
    def backward(ctx, dy):
        trans_b, backend, act, limit, alpha, accumulate, routing = ctx.call
        if act is None:
            (x, w, counts), h, probs = ctx.saved_tensors, None, None
        else:
            x, w, counts, h, probs = ctx.saved_tensors
        if routing is not None and not eager(dy):
            routing = None  # traced (compiled autograd, a mode): the custom ops
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        dx = dw = db = dp = None
        if act is not None:  # dy is dL/d(act(h) * probs): make it dL/dh
            dy, dp = _activation_backward(h, dy, probs, act, limit, alpha, need[3])
            dp = None if dp is None else dp.to(ctx.dtypes[1])
        if need[2]:
            db = bias_grad(dy, counts, backend, routing).to(ctx.dtypes[0])
        if need[0]:  # dx = dy @ w[e]^T: the same grouped GEMM with the weight read the other way
            dx, _ = forward(dy, w, counts, None, None, None, not trans_b, backend, None,
                            limit, alpha, routing)  # fmt: skip
        if need[1]:  # dw[e] = x_e^T dy_e ([K, N]); with trans_b the weight is [N, K]: dy_e^T x_e
            a, b = (dy, x) if trans_b else (x, dy)
            dw = weight_grad(w, a, b, counts, backend, accumulate, routing)
        return dx, dw, db, dp, None, None, None
