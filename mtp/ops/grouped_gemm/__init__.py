"""Grouped GEMM for MoE experts, one entry point: ``y[rows of e] = epilogue(x[rows of e] @ w[e])``
with ragged groups (``docs/grouped_gemm.md`` walks the whole path).

The path of a call, top to bottom:

1. :func:`grouped_gemm` (here): argument checks, the ``validate`` rule, the backend choice
   (``backend=``, ``MTP_BACKEND`` when ``"auto"``; see :mod:`mtp.ops.grouped_gemm.backends`
   for the table) and the epilogue options: ``bias``, ``activation`` (GeLU, SwiGLU, clamped
   SwiGLU) with routing ``probs``, ``gradient_accumulation_fusion`` (the weight gradient added
   to ``w.main_grad``), and ``out=`` (a fixed output buffer for CUDA graphs).
2. Autograd (here): one :class:`torch.autograd.Function` for every option, over the custom ops.
3. Custom ops (here, each with its fake, the only registrations of the grouped GEMM):
   ``mtp::grouped_gemm_out`` (every forward and data gradient, epilogues included),
   ``mtp::grouped_gemm_wgrad`` (weight gradients, accumulating or not, and the bias
   gradient's per-expert sums), ``mtp::grouped_gemm_dact`` (the data gradient of the GEMM after
   an activation with the activation's backward in its epilogue: :func:`mtp.ops.grouped_mlp`).
4. The backend; for ``triton`` the config of :func:`mtp.ops.grouped_gemm.config.make_config`
   (TMA or pointer kernels, tiles, grid) and the launchers and kernels of
   :mod:`mtp.kernels.grouped_gemm_details`.

``auto`` is ``triton`` on CUDA and ``reference`` on CPU. Backends that read the counts on the
host (``sequential``, ``multistream``, ``reference``) copy them once per call; the backward
reuses the copy.
"""

from __future__ import annotations

import torch

from mtp.ops._backend import resolve_backend
from mtp.ops.grouped_gemm.backends import (
    GROUPED_GEMM_BACKENDS,
    GroupedGemmBackend,
    _reference_forward,
    activation_reference,
    add_expert_bias_,
    clamped_swiglu,
    expert_bias_sums,
    torch_grouped_mm,
    triton_dgrad_act,
    triton_forward_act,
)
from mtp.ops.grouped_gemm.checks import (
    FLOAT_DTYPES,
    check_count_values,
    check_inputs,
    check_main_grad,
    n_of,
)
from mtp.ops.grouped_gemm.config import TUNED_BACKENDS, device_arch, measured_backend
from mtp.utils import check_tensor, empty, validation_mode

__all__ = [
    "ACTIVATIONS",
    "GROUPED_GEMM_BACKENDS",
    "GroupedGemmBackend",
    "clamped_swiglu",
    "grouped_gemm",
    "grouped_gemm_accumulate_wgrad",
    "grouped_gemm_reference",
    "grouped_gemm_wgrad",
    "torch_grouped_mm",
]

#: Activations of the epilogue (``"gelu"``: exact erf GeLU; the gated ones read ``2F`` columns).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "clamped_swiglu")
GATED = ("swiglu", "clamped_swiglu")


def activation_width(n: int, activation: str | None) -> int:
    """Columns of the result: ``N``, or ``N / 2`` after a gated activation."""
    return n // 2 if activation in GATED else n


# --------------------------------------------------------------------------------------------
# Custom ops: the device work, opaque to torch.compile (fakes below each)
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("mtp::grouped_gemm_out", mutates_args=("out", "h"))
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
) -> None:
    """``out = x @ w[e] (+ bias[e])`` per expert; with an ``activation``: ``h`` gets that
    pre-activation and ``out = act(h) * probs``. Zeros past ``sum(tokens_per_expert)``.

    No argument has a default: torch 2.11's in-place kernel of a custom op finds a mutated
    argument by its position in a list whose trailing defaults were dropped (``h`` at 7 was
    out of range whenever ``h, probs, ...`` were all defaults: IndexError on the H200)."""
    impl = GROUPED_GEMM_BACKENDS[backend]
    counts = tokens_per_expert
    if activation == "none":
        if impl.fused_epilogues:
            impl.forward(x, w, counts, trans_b, out, bias)
            return
        impl.forward(x, w, counts, trans_b, out)
        if bias is not None:
            add_expert_bias_(out, bias, counts)
        return
    contiguous = [None if t is None else t.contiguous() for t in (bias, probs)]
    if impl.fused_epilogues:
        triton_forward_act(x, w, counts, trans_b, h, out, activation, *contiguous, limit, alpha)
        return
    impl.forward(x, w, counts, trans_b, h)
    if bias is not None:
        add_expert_bias_(h, bias, counts)
    out.copy_(activation_reference(h, activation, probs, limit, alpha))


@_forward_op.register_fake
def _(x, w, tokens_per_expert, out, trans_b, backend, bias, h, probs, activation, limit, alpha):
    return None


@torch.library.custom_op("mtp::grouped_gemm_wgrad", mutates_args=("out",))
def _wgrad_op(
    a: torch.Tensor,
    b: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    backend: str,
    accumulate: bool = False,
) -> None:
    """``out[e] = a_e^T b_e`` (``[E, P, Q]`` for ``a [M, P]``, ``b [M, Q]``); ``accumulate``:
    ``out[e] += ...`` (in the epilogue, fp32, where the backend fuses it)."""
    impl = GROUPED_GEMM_BACKENDS[backend]
    if not accumulate:
        impl.wgrad(a, b, tokens_per_expert, out)
    elif impl.fused_epilogues:
        impl.wgrad(a, b, tokens_per_expert, out, True)
    else:
        out.add_(impl.wgrad(a, b, tokens_per_expert, None))


@_wgrad_op.register_fake
def _(a, b, tokens_per_expert, out, backend, accumulate=False):
    return None


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, dprobs)``: ``dh = (dy @ w[e]^T) * probs * act'(h)`` (``w [E, F, K]``: the weight of
    the GEMM after the activation) and ``dL/dprobs`` (fp32; empty without ``probs``)."""
    dh = empty(h.shape, dtype=h.dtype, device=h.device)
    part = triton_dgrad_act(dy, w, counts, h, dh, activation, probs, limit, alpha)
    if part is None:
        return dh, dy.new_empty((0,), dtype=torch.float32)
    return dh, part.sum(0)  # fixed order over the column tiles: deterministic


@_dact_op.register_fake
def _(dy, w, counts, h, probs, activation, limit, alpha):
    n = 0 if probs is None else dy.shape[0]
    return h.new_empty(h.shape), dy.new_empty((n,), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


def _forward(x, w, counts, out, bias, probs, trans_b, backend, act, limit, alpha):
    """``(y, h)``: the forward into ``out`` (or a new buffer); ``h`` the pre-activation."""
    n = n_of(w, trans_b)
    y = out if out is not None else empty((x.shape[0], activation_width(n, act)),
                                          dtype=x.dtype, device=x.device)  # fmt: skip
    h = None if act is None else empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    torch.ops.mtp.grouped_gemm_out(x, w, counts, y, trans_b, backend, bias, h, probs,
                                   act or "none", limit, alpha)  # fmt: skip
    return y, h


def bias_grad(dy: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
    """fp32 ``[E, N]``: the sum of ``dy``'s rows of each expert. Fused backends: their weight
    gradient with a column of ones as the left operand (``1_e^T dy_e``: one launch, fp32
    accumulation, exact zeros for empty experts, no copy of ``dy``); otherwise a segment sum."""
    E, (M, N) = counts.shape[0], dy.shape
    if not GROUPED_GEMM_BACKENDS[backend].fused_epilogues:
        return expert_bias_sums(dy, counts)
    ones = torch.ones((1, 1), dtype=dy.dtype, device=dy.device).expand(M, 1)
    out = torch.empty((E, 1, N), dtype=torch.float32, device=dy.device)
    torch.ops.mtp.grouped_gemm_wgrad(ones, dy, counts, out, backend)
    return out.view(E, N)


def weight_grad(w, a, b, counts, backend: str, accumulate: bool) -> torch.Tensor | None:
    """``dW[e] = a_e^T b_e``. With ``accumulate``: added to ``w.main_grad`` instead, and the
    gradient autograd returns is a placeholder when ``w`` has Megatron's
    ``grad_added_to_main_grad`` flag (set here; the data-parallel hook drops it), else None."""
    if not accumulate:
        dw = empty((counts.shape[0], a.shape[1], b.shape[1]), dtype=a.dtype, device=a.device)
        torch.ops.mtp.grouped_gemm_wgrad(a, b, counts, dw, backend)
        return dw
    torch.ops.mtp.grouped_gemm_wgrad(a, b, counts, w.main_grad, backend, True)
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


class _GroupedGemm(torch.autograd.Function):
    """Every option of :func:`grouped_gemm`: forward through ``mtp::grouped_gemm_out``, backward
    through the same op (data gradient) and ``mtp::grouped_gemm_wgrad`` (weight and bias)."""

    @staticmethod
    def forward(ctx, x, w, counts, out, bias, probs, trans_b, backend, act, limit, alpha,
                accumulate):  # fmt: skip
        y, h = _forward(x, w, counts, out, bias, probs, trans_b, backend, act, limit, alpha)
        if out is not None:
            ctx.mark_dirty(out)
        ctx.save_for_backward(x, w, counts, h, probs)
        ctx.call = (trans_b, backend, act, limit, alpha, accumulate)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (bias, probs))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, counts, h, probs = ctx.saved_tensors
        trans_b, backend, act, limit, alpha, accumulate = ctx.call
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        dx = dw = db = dp = None
        if act is not None:  # dy is dL/d(act(h) * probs): make it dL/dh
            dy, dp = _activation_backward(h, dy, probs, act, limit, alpha, need[5])
            dp = None if dp is None else dp.to(ctx.dtypes[1])
        if need[4]:
            db = bias_grad(dy, counts, backend).to(ctx.dtypes[0])
        if need[0]:  # dx = dy @ w[e]^T: the same grouped GEMM with the weight read the other way
            dx, _ = _forward(dy, w, counts, None, None, None, not trans_b, backend, None,
                             limit, alpha)
        if need[1]:  # dw[e] = x_e^T dy_e ([K, N]); with trans_b the weight is [N, K]: dy_e^T x_e
            a, b = (dy, x) if trans_b else (x, dy)
            dw = weight_grad(w, a, b, counts, backend, accumulate)
        return dx, dw, None, None, db, dp, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _measured_backend(x, w, trans_b) -> str | None:
    """The backend the tuning sweep measured fastest at this shape class (config.TUNED_BACKENDS),
    when it can run these inputs here; None otherwise."""
    if not TUNED_BACKENDS or w.dim() != 3:
        return None
    arch, _ = device_arch(x.device)
    name = measured_backend(arch, x.dtype, x.shape[0], n_of(w, trans_b), x.shape[1], w.shape[0])
    check = GROUPED_GEMM_BACKENDS[name].check if name in GROUPED_GEMM_BACKENDS else None
    try:
        if name is not None and check is not None:
            check(x, w)
    except (TypeError, ValueError):
        return None
    return name


def prepare_call(x, w, tokens_per_expert, trans_b, out, backend, validate, bias=None,
                 activation=None):  # fmt: skip
    """Check the arguments of :func:`grouped_gemm` and resolve them: ``(backend name, counts)``
    with the counts where the backend reads them (the loop backends' one host copy)."""
    validation_mode(validate)  # a bad value raises here, naming the argument
    if isinstance(tokens_per_expert, (list, tuple)):
        tokens_per_expert = torch.tensor(tokens_per_expert, dtype=torch.int64)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")
    n = n_of(w, trans_b) if w.dim() == 3 else 0
    if activation in GATED and n % 2:
        raise ValueError(f"w holds the gate and up columns for {activation!r}: its N ({n}) must "
                         f"be even, got w of shape {tuple(w.shape)}")  # fmt: skip
    check_inputs(x, w, tokens_per_expert, trans_b, out, out_cols=activation_width(n, activation))
    if bias is not None:
        check_tensor("bias", bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        if tuple(bias.shape) != (w.shape[0], n):
            raise ValueError(f"bias must be [{w.shape[0]}, {n}] (experts, N), "
                             f"got {tuple(bias.shape)}")  # fmt: skip
    name = resolve_backend("grouped_gemm", backend, x.device, tuple(GROUPED_GEMM_BACKENDS))
    if backend == "auto" and name == "triton" and bias is None and activation is None:
        name = _measured_backend(x, w, trans_b) or name  # the sweep's fastest, if any
    impl = GROUPED_GEMM_BACKENDS[name]
    if impl.check is not None:
        impl.check(x, w)
    # Loop backends read the sizes on the host: copy them once here (their only sync); the
    # validation and the backward read that copy. Single-launch backends read them on the device.
    if not impl.device_counts and tokens_per_expert.device.type == "meta":
        raise ValueError(
            f"grouped_gemm: backend={name!r} reads tokens_per_expert on the host, but it is a "
            "meta tensor (no values); pass the counts on the CPU, or use a backend that reads "
            "them on the device ('triton', 'torch')"
        )
    tokens_per_expert = tokens_per_expert.contiguous()  # [E] ints: a no-op or a tiny copy
    counts = tokens_per_expert if impl.device_counts else tokens_per_expert.to("cpu")
    check_count_values(counts, x.shape[0], validate)
    return name, (counts.to(x.device) if impl.device_counts else counts)


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    validate: bool | str = True,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    probs: torch.Tensor | None = None,
    activation_limit: float = 7.0,
    activation_alpha: float = 1.702,
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """Grouped GEMM over experts: ``y[rows of e] = act(x[rows of e] @ w[e] + bias[e]) * probs``
    (each epilogue optional).

    Args:
        x: ``[M, K]`` float32/float16/bfloat16; rows grouped by expert (expert 0's rows first).
            ``M`` may exceed ``sum(tokens_per_expert)`` (a buffer sized for the worst case).
        w: ``[E, K, N]``, or ``[E, N, K]`` with ``trans_b=True`` (``nn.Linear`` layout), same
            dtype and device as ``x``.
        tokens_per_expert: ``[E]`` int32/int64 rows per expert, on ``x``'s device or the CPU
            (or a list of ints). Experts with zero tokens are fine (their weight gradient is
            exactly zero). Keep it on the device for CUDA graphs and sync-free backends.
        trans_b: read ``w[e]`` as ``[N, K]`` and multiply by its transpose.
        backend: ``"auto"`` (``triton`` on CUDA, ``reference`` on CPU, or ``MTP_BACKEND``),
            ``"triton"``, ``"cutlass"``, ``"torch"``, ``"multistream"``, ``"sequential"``,
            ``"reference"`` (:mod:`mtp.ops.grouped_gemm.backends`).
        out: optional buffer for the result (``[M, N]``, or ``[M, N / 2]`` after a gated
            activation) in ``x``'s dtype, written completely and returned (keeps the output
            address fixed for CUDA graphs).
        validate: the data check of the counts (non-negative, summing to at most ``M``).
            ``True``: on the device, no host sync (``torch._assert_async``: a device-side
            assert on CUDA, an immediate ``RuntimeError`` on CPU); ``"sync"``: typed
            ``ValueError`` with the values (one host sync); ``False``: off. Skipped while
            tracing or capturing a graph.
        bias: optional per-expert bias ``[E, N]`` (any float dtype), added in fp32 in the
            GEMM's epilogue on the ``triton`` backend (after the GEMM on the others); rows past
            ``sum(tokens_per_expert)`` stay zero. Its gradient is the per-expert sum of the
            rows of ``dL/d(pre-activation)`` (fp32 accumulation, deterministic).
        activation: None, or ``"gelu"`` (erf), ``"gelu_tanh"``, ``"swiglu"`` (``N = 2F``: gate
            columns ``[0, F)`` through SiLU times up ``[F, 2F)``, Megatron's layout) or
            ``"clamped_swiglu"`` (GPT-OSS: gate column ``2j``, up ``2j + 1``, see
            :func:`clamped_swiglu`), applied to ``x @ w[e] + bias[e]`` in the epilogue
            (``triton``). The backward runs the activation's derivative as a PyTorch pass;
            :func:`mtp.ops.grouped_mlp` fuses it into the next GEMM's data gradient instead.
        probs: ``[M]`` routing probabilities (any float dtype) multiplying the activation's
            output (needs ``activation``); differentiable.
        activation_limit, activation_alpha: the clamped SwiGLU's ``limit`` and ``alpha``.
        gradient_accumulation_fusion: add the weight gradient to ``w.main_grad`` (in the
            weight-gradient kernel's epilogue, fp32, on ``triton``) instead of returning it
            (Megatron-Core's option; see :func:`grouped_gemm_accumulate_wgrad`).

    Returns:
        ``y`` in ``x``'s dtype (fp32 accumulation); rows past ``sum(tokens_per_expert)`` are
        zero. Differentiable in ``x``, ``w``, ``bias`` and ``probs``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or devices (naming the argument), counts
            summing past ``M`` (``validate="sync"``), or a backend that cannot run here.
    """
    name, counts = prepare_call(x, w, tokens_per_expert, trans_b, out, backend, validate, bias,
                                activation)  # fmt: skip
    if probs is not None:
        if activation is None:
            raise ValueError("probs multiplies the activation's output: pass activation=... "
                             "(or scale the result yourself)")  # fmt: skip
        check_tensor("probs", probs, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        if probs.shape[0] != x.shape[0]:
            raise ValueError(f"probs must be [{x.shape[0]}] (one per row of x), got "
                             f"{tuple(probs.shape)}")  # fmt: skip
    accumulate = bool(gradient_accumulation_fusion)
    if accumulate and w.requires_grad:
        check_main_grad(w)
    args = (x, w, counts, out, bias, probs, trans_b, name, activation, float(activation_limit),
            float(activation_alpha))  # fmt: skip
    needs_grad = any(t is not None and t.requires_grad for t in (x, w, bias, probs))
    if torch.is_grad_enabled() and needs_grad:
        return _GroupedGemm.apply(*args, accumulate)
    return _forward(*args)[0]


def grouped_gemm_accumulate_wgrad(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool | str = True,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`grouped_gemm` with ``gradient_accumulation_fusion=True`` (Megatron-Core's
    gradient-accumulation fusion for the experts): the backward adds ``x_e^T dy_e`` to
    ``w.main_grad`` (fp32, in the weight-gradient kernel's epilogue on ``triton``: no rounding of
    the gradient to ``w``'s dtype, no extra pass) and ``w`` gets no ``.grad``; with Megatron's
    ``grad_added_to_main_grad`` attribute on ``w`` it is set and a placeholder gradient returned
    (the data-parallel hook drops it, so the bucket's readiness hook still fires).

    Raises:
        ValueError, TypeError: as :func:`grouped_gemm`, and a missing or mis-shaped
            ``main_grad`` (when ``w`` requires grad).
    """
    return grouped_gemm(x, w, tokens_per_expert, backend=backend, validate=validate, bias=bias,
                        gradient_accumulation_fusion=True)  # fmt: skip


def grouped_gemm_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    backend: str,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """The weight gradient alone: ``out[e] (+)= a_e^T b_e`` (``[E, P, Q]`` for ``a [M, P]``,
    ``b [M, Q]``, rows grouped by expert; exact zeros for empty experts) on a resolved
    ``backend`` name, counts already where the backend reads them (as inside a backward)."""
    if out is None:
        out = empty((tokens_per_expert.shape[0], a.shape[1], b.shape[1]), dtype=a.dtype,
                    device=a.device)  # fmt: skip
    torch.ops.mtp.grouped_gemm_wgrad(a, b, tokens_per_expert, out, backend, accumulate)
    return out


def grouped_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch per-expert loop with :func:`grouped_gemm`'s contract (fp32 math, result in
    ``x``'s dtype, zero rows past the routed ones); also accepts float64. Differentiable by
    autograd when ``out`` is None. Reads ``tokens_per_expert`` on the host."""
    check_inputs(x, w, tokens_per_expert, trans_b, out, dtypes=(*FLOAT_DTYPES, torch.float64))
    return _reference_forward(x, w, tokens_per_expert, trans_b, out)
