"""Grouped GEMM for MoE experts, one entry point: ``y[rows of e] = epilogue(x[rows of e] @ w[e])``
with ragged groups (``docs/grouped_gemm.md`` walks the whole path).

The path of a call, top to bottom:

1. :func:`grouped_gemm` (here): argument checks, the ``validate`` rule, the backend choice
   (``backend=``, ``MTP_BACKEND`` when ``"auto"``; see :mod:`mtp.ops.grouped_gemm.backends`
   for the table) and the epilogue options: ``bias``, ``activation`` (GeLU, SwiGLU, clamped
   SwiGLU) with routing ``probs``, ``gradient_accumulation_fusion`` (the weight gradient added
   to ``w.main_grad``), and ``out=`` (a fixed output buffer for CUDA graphs).
   On plain tensors outside any trace the eager path (:mod:`mtp.ops.grouped_gemm.eager_path`) does
   it with the checks once per key and runs the autograd function and the custom ops' bodies
   directly (no custom-op layer); compiling and tracing take the custom ops.
2. Autograd (:mod:`mtp.ops.grouped_gemm.ops`): one :class:`torch.autograd.Function` for every
   option, over the custom ops (or, eagerly, their bodies).
3. Custom ops (:mod:`mtp.ops.grouped_gemm.ops`, each with its fake; the FP8 operands' in
   :mod:`mtp.ops.grouped_gemm.fp8`):
   ``mtp::grouped_gemm_out`` (every forward and data gradient, epilogues included),
   ``mtp::grouped_gemm_wgrad`` (weight gradients, accumulating or not, and the bias
   gradient's per-expert sums), ``mtp::grouped_gemm_dact`` (the data gradient of the GEMM after
   an activation with the activation's backward in its epilogue: :func:`mtp.ops.grouped_mlp`).
4. The backend; for ``triton`` (:mod:`mtp.ops.grouped_gemm.plans`: launch plans per key) the
   config of :func:`mtp.ops.grouped_gemm.config.make_config` (TMA or pointer kernels, tiles,
   grid) and the launchers and kernels of :mod:`mtp.kernels.grouped_gemm_details`.

``auto`` is ``triton`` on CUDA and ``reference`` on CPU. Backends that read the counts on the
host (``sequential``, ``multistream``, ``reference``) copy them once per call; the backward
reuses the copy.
"""

from __future__ import annotations

import torch

from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import eager
from mtp.ops.grouped_gemm import eager_path as _eager_path
from mtp.ops.grouped_gemm.backends import (
    GROUPED_GEMM_BACKENDS,
    GroupedGemmBackend,
    _reference_forward,
    clamped_swiglu,
    torch_grouped_mm,
)
from mtp.ops.grouped_gemm.checks import (
    ACTIVATIONS,
    FLOAT_DTYPES,
    check_arguments,
    check_backend,
    check_count_values,
    check_inputs,
    check_main_grad,
    check_probs,
)
from mtp.ops.grouped_gemm.fp8 import fp8_call
from mtp.ops.grouped_gemm.ops import GroupedGemmFunction, forward, run_wgrad
from mtp.ops.quantize import Fp8Recipe, Fp8Tensor, Fp8WeightCache
from mtp.utils import empty, validation_mode

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

# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def prepare_call(x, w, tokens_per_expert, trans_b, out, backend, validate, bias=None,
                 activation=None, rows=None):  # fmt: skip
    """Check the arguments of :func:`grouped_gemm` and resolve them: ``(backend name, counts)``
    with the counts where the backend reads them (the loop backends' one host copy); ``rows``:
    the grouped rows the counts cover (default ``x``'s)."""
    validation_mode(validate)  # a bad value raises here, naming the argument
    if isinstance(tokens_per_expert, (list, tuple)):
        tokens_per_expert = torch.tensor(tokens_per_expert, dtype=torch.int64)
    check_arguments(x, w, tokens_per_expert, trans_b, out, bias, activation)
    name = resolve_backend("grouped_gemm", backend, x.device, tuple(GROUPED_GEMM_BACKENDS))
    if backend == "auto" and name == "triton" and bias is None and activation is None:
        name = _eager_path.tuned_backend(x, w, trans_b) or name  # the sweep's fastest, if any
    impl = GROUPED_GEMM_BACKENDS[name]
    check_backend(name, impl, x, w, tokens_per_expert)
    # Loop backends read the sizes on the host: copy them once here (their only sync); the
    # validation and the backward read that copy. Single-launch backends read them on the device.
    tokens_per_expert = tokens_per_expert.contiguous()  # [E] ints: a no-op or a tiny copy
    counts = tokens_per_expert if impl.device_counts else tokens_per_expert.to("cpu")
    check_count_values(counts, x.shape[0] if rows is None else rows, validate)
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
    fp8_recipe: str | Fp8Recipe | None = None,
    fp8_weight_cache: Fp8WeightCache | None = None,
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
        fp8_recipe: ``"blockwise"``, ``"mxfp8"`` or an :class:`~mtp.ops.quantize.Fp8Recipe`:
            compute in FP8 (e4m3 operands with block scales, fp32 accumulation; the output in
            ``x``'s dtype). A float ``x``/``w`` is quantised inside (the backward quantises
            the output gradient once for both gradient GEMMs); ``x`` may also be a row-wise
            :class:`~mtp.ops.quantize.Fp8Tensor` and ``w`` one quantised along K (then the
            recipe is theirs and ``fp8_recipe`` may be left None). No alignment of the counts
            is asked; ``backend`` ``"triton"`` or ``"reference"``; ``"mxfp8"`` needs an sm_100
            GPU (or the interpreter); no ``bias``/``activation``/``probs`` yet.
            ``docs/grouped_gemm.md`` ("FP8 operands") has the recipes and their errors.
            A float ``w`` may then be of any float dtype (an FP32 master weight is quantised
            as it is; its gradient comes back in its dtype).
        fp8_weight_cache: with ``fp8_recipe``, an :class:`~mtp.ops.quantize.Fp8WeightCache`
            that keeps the quantised ``w`` and reuses it while ``w`` is unchanged (its
            ``_version`` and storage, no ``torch.optim`` step since): the weight is quantised
            once per optimizer step, not per call (always quantised while a CUDA graph is
            captured or when compiling).

    Returns:
        ``y`` in ``x``'s dtype (fp32 accumulation); rows past ``sum(tokens_per_expert)`` are
        zero. Differentiable in ``x``, ``w``, ``bias`` and ``probs``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or devices (naming the argument), counts
            summing past ``M`` (``validate="sync"``), or a backend that cannot run here.
    """
    accumulate = bool(gradient_accumulation_fusion)
    if fp8_recipe is not None or x.__class__ is Fp8Tensor or w.__class__ is Fp8Tensor:
        given = tuple(name for name, v in (("bias", bias), ("activation", activation),
                                           ("probs", probs)) if v is not None)  # fmt: skip
        return fp8_call(x, w, tokens_per_expert, trans_b, backend, out, validate, fp8_recipe,
                        accumulate, given, fp8_weight_cache)  # fmt: skip
    if fp8_weight_cache is not None:
        raise ValueError("fp8_weight_cache is for FP8 operands: pass fp8_recipe too")
    if eager(x, w, tokens_per_expert, out, bias, probs):
        return _eager_path.call(x, w, tokens_per_expert, trans_b, backend, out, validate, bias,
                                activation, probs, activation_limit, activation_alpha,
                                accumulate)  # fmt: skip
    name, counts = prepare_call(x, w, tokens_per_expert, trans_b, out, backend, validate, bias,
                                activation)  # fmt: skip
    check_probs(probs, x, activation)
    if accumulate and w.requires_grad:
        check_main_grad(w)
    limit, alpha = float(activation_limit), float(activation_alpha)
    needs_grad = any(t is not None and t.requires_grad for t in (x, w, bias, probs))
    if torch.is_grad_enabled() and needs_grad:
        return GroupedGemmFunction.apply(x, w, bias, probs, out, counts, (
            trans_b, name, activation, limit, alpha, accumulate, None))
    return forward(x, w, counts, out, bias, probs, trans_b, name, activation, limit, alpha)[0]


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
    if eager(a, b, tokens_per_expert, out):
        run_wgrad(a, b, tokens_per_expert, out, backend, accumulate,
                  Routing(tokens_per_expert, a.shape[0], out.shape[0]))  # fmt: skip
    else:
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
