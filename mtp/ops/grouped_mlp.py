"""The expert MLP of an MoE layer: two calls of the one grouped GEMM with the epilogues chained
across them (:func:`grouped_mlp`).

``out[rows of e] = (act(x_e @ w1[e] + b1[e]) * p) @ w2[e] + b2[e]`` for each expert ``e`` (``p``:
each row's routing probability, applied before fc2 as in Megatron-Core), zeros past
``sum(tokens_per_expert)``.

``backend="triton"``: two launches forward and four grouped GEMMs backward (plus the per-expert
bias sums), nothing else on ``[M, F]`` tensors:

* forward: fc1 is :func:`mtp.ops.grouped_gemm` with its bias, activation and probability
  epilogue (``mtp::grouped_gemm_out`` stores the pre-activation ``h`` for the backward and
  ``y = act(h) * p``), then fc2 with its bias. Autograd keeps ``x`` and ``h`` (and the rows'
  probabilities), not ``y``;
* backward: fc2's data gradient with the activation's backward and ``dL/dp`` in its epilogue
  (``mtp::grouped_gemm_dact`` writes ``dh`` directly, ``dL/dy`` is never stored, and rewrites
  ``y = act(h) * p`` for fc2's weight gradient), the two weight gradients, fc1's data gradient
  and the per-expert bias sums.

Row gather (``gather_index=``, ``token_map=``; the MoE dispatch's gather fused into fc1): ``x``
holds source rows (the tokens) and row ``r`` of the expert-major order is ``x[gather_index[r]]``
(``-1``: an empty row), with probability ``probs[gather_index[r], e]`` of a ``[S, E]``
``probs``. fc1 reads its rows through the index (no permuted copy of ``x`` is written; fc1 and
fc1's weight gradient take the pointer kernels); fc1's data gradient is the per-source-row sum
of its rows' gradients, in one launch with the probabilities' ``[S, E]`` gradient
(:mod:`mtp.kernels.moe_token_major`'s combine over ``token_map``: fixed order, no atomics).

Row scatter (``scatter_index=``): fc2's epilogue stores row ``r`` at ``out[scatter_index[r]]``
(a permutation: an expert-parallel receive buffer's rows go back in the order they arrived in,
no reordered copy); the backward reads the output gradient through the same index (one row
gather) before fc2's data gradient.

The chain is what a single ``grouped_gemm`` call cannot do (its backward would store ``dL/dy``
and run the activation's derivative as a separate pass). ``backend="reference"`` is two
``grouped_gemm`` calls on the per-expert loop backend, for comparison and CPUs without the Triton
interpreter.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mtp import settings
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import autograd_apply, eager, needs_grad
from mtp.ops.grouped_gemm import (
    ACTIVATIONS,
    GROUPED_GEMM_BACKENDS,
    clamped_swiglu,
    grouped_gemm,
    prepare_call,
)
from mtp.ops.grouped_gemm import eager_path as _eager_gemm
from mtp.ops.grouped_gemm.checks import (
    COUNT_DTYPES,
    FLOAT_DTYPES,
    check_arguments,
    check_backend,
    check_rows,
    check_index_values,
    check_main_grad,
)
from mtp.ops.grouped_gemm.ops import bias_grad, dact, forward, weight_grad
from mtp.ops.grouped_mlp_fp8 import fp8_mlp
from mtp.ops.moe_permute.token_map import TokenMap, permute_grads
from mtp.utils import check_tensor, empty, validation_mode

__all__ = ["grouped_mlp", "clamped_swiglu", "GROUPED_MLP_ACTIVATIONS"]

#: Activations fused into the epilogues (``"gelu"``: exact erf GeLU).
GROUPED_MLP_ACTIVATIONS = ACTIVATIONS
_BACKENDS = ("triton", "reference")


def _fused_forward(x, w1, w2, counts, probs, b1, b2, act, routing, gather=None, scatter=None):
    """``(out, h, p)``: fc1 with its epilogue (``h`` the pre-activation, ``y = act(h) * p``),
    then fc2 with its bias (row ``r`` stored at ``out[scatter[r]]`` with ``scatter``); ``p`` the
    rows' probabilities (``probs``, or with ``gather`` the fp32 ``[M]`` fc1 wrote)."""
    act, limit, alpha = act
    p = probs
    if gather is not None and probs is not None:
        p = empty((gather.shape[0],), dtype=torch.float32, device=x.device)
    y, h = forward(x, w1, counts, None, b1, probs, False, "triton", act, limit, alpha, routing,
                   gather, None if gather is None else p)  # fmt: skip
    out, _ = forward(y, w2, counts, None, b2, None, False, "triton", None, limit, alpha, routing,
                     scatter=scatter)  # fmt: skip
    return out, h, p


class _FusedGroupedMLP(torch.autograd.Function):
    """Both GEMMs and the fused backward: ``apply(x, w1, w2, probs, b1, b2, counts, gather,
    token_rows, token_experts, token_count, scatter, call)`` with ``call = ((activation, limit,
    alpha), accumulate, routing)``; ``routing`` (the eager path's, else None: the custom ops) is
    shared by all of their launches; ``gather`` and the token map are None without a row
    gather, ``scatter`` without a row scatter (then the backward reads ``dout`` through it)."""

    @staticmethod
    def forward(ctx, x, w1, w2, probs, b1, b2, counts, gather, rows, experts, count, scatter,
                call):  # fmt: skip
        act, accumulate, routing = call
        out, h, p = _fused_forward(x, w1, w2, counts, probs, b1, b2, act, routing, gather,
                                   scatter)  # fmt: skip
        ctx.save_for_backward(x, w1, w2, counts, p, h, gather, rows, experts, count, scatter)
        ctx.call = call
        ctx.probs_width = 1 if probs is None or probs.dim() == 1 else probs.shape[1]
        ctx.probs_1d = probs is not None and probs.dim() == 1
        ctx.dtypes = (None if probs is None else probs.dtype, None if b1 is None else b1.dtype,
                      None if b2 is None else b2.dtype)  # fmt: skip
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, w1, w2, counts, p, h, gather, rows, experts, count, scatter = ctx.saved_tensors
        act, accumulate, routing = ctx.call
        need = ctx.needs_input_grad
        p_dtype, b1_dtype, b2_dtype = ctx.dtypes
        if routing is not None and not eager(dout):
            routing = None  # traced (compiled autograd, a mode): the custom ops
        dout = dout.contiguous() if scatter is None else _gather_rows(dout, scatter)
        dx = dw1 = dw2 = dp = db1 = db2 = None
        if need[5]:
            db2 = bias_grad(dout, counts, "triton", routing).to(b2_dtype)
        if not any(need[:5]):
            return dx, dw1, dw2, dp, db1, db2, *(None,) * 7
        dh, dprobs, y = dact(dout, w2, counts, h, p, *act, routing, recompute=need[2])
        if need[2]:
            dw2 = weight_grad(w2, y, dout, counts, "triton", accumulate, routing)
        if need[4]:
            db1 = bias_grad(dh, counts, "triton", routing).to(b1_dtype)
        if need[1]:
            dw1 = weight_grad(w1, x, dh, counts, "triton", accumulate, routing, gather)
        dx_rows = None
        if need[0]:
            dx_rows, _ = forward(dh, w1, counts, None, None, None, True, "triton", None,
                                 *act[1:], routing)  # fmt: skip
        if gather is None:
            dx, dp = dx_rows, (dprobs.to(p_dtype) if need[3] else None)
        elif need[0] or need[3]:  # per source row: its rows' sums, and the [S, E] probs grad
            meta = (x.shape[1], ctx.probs_width, x.dtype, p_dtype or x.dtype)
            # each (source row, expert) has one row: its gradient rounded once, as unfused
            dprobs = dprobs.to(p_dtype) if need[3] else dprobs
            dx, dp = permute_grads((rows, experts, count), meta, need[0], need[3], dx_rows,
                                   dprobs)  # fmt: skip
            if dp is not None and ctx.probs_1d:  # [S] probs: the map's one column of experts
                dp = dp.view(-1)
        return dx, dw1, dw2, dp, db1, db2, *(None,) * 7


_APPLY = autograd_apply(_FusedGroupedMLP)


def _gather_rows(dout, index):
    """``dout[index[r]]`` per row ``r`` (zeros where ``index[r] < 0``): a scattered fc2's output
    gradient, back in its rows' order (one launch, no atomics)."""
    return torch.ops.mtp.moe_gather_rows(dout, index, None)


def _check_activation(weight1, activation) -> None:
    if activation not in GROUPED_MLP_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {GROUPED_MLP_ACTIVATIONS}, got {activation!r}"
        )
    if activation in ("swiglu", "clamped_swiglu") and weight1.dim() == 3 and weight1.shape[2] % 2:
        raise ValueError(
            f"weight1 [E, H, 2F] holds the gate and up columns for {activation!r}: its last dim "
            f"must be even, got {tuple(weight1.shape)}"
        )


def _check(x, weight1, weight2, probs, bias2, activation: str, gather=None,
           token_map=None, scatter=None) -> None:  # fmt: skip
    if scatter is not None:
        rows = x.shape[0] if gather is None else gather.shape[0]
        check_tensor("scatter_index", scatter, ndim=1, dtypes=COUNT_DTYPES, device=x.device)
        if scatter.shape[0] != rows:
            raise ValueError(f"scatter_index must be [{rows}] (one per grouped row), got "
                             f"{tuple(scatter.shape)}")  # fmt: skip
    gated = activation in ("swiglu", "clamped_swiglu")
    E, H, F = weight1.shape[0], x.shape[1], weight1.shape[2] // (2 if gated else 1)
    check_tensor("weight2", weight2, ndim=3, dtypes=(x.dtype,), device=x.device)
    if tuple(weight2.shape) != (E, F, H):
        raise ValueError(f"weight2 must be [{E}, {F}, {H}] (experts, F, H) for weight1 "
                         f"{tuple(weight1.shape)}, got {tuple(weight2.shape)}")  # fmt: skip
    if bias2 is not None:
        check_tensor("bias2", bias2, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        if tuple(bias2.shape) != (E, H):
            raise ValueError(f"bias2 must be [{E}, {H}], got {tuple(bias2.shape)}")
    check_rows(x, weight1, probs, gather, token_map)


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
    validate: bool | str = True,
    gather_index: torch.Tensor | None = None,
    token_map: TokenMap | None = None,
    scatter_index: torch.Tensor | None = None,
    fp8_recipe=None,
    fp8_weight_cache=None,
) -> torch.Tensor:
    """The experts' MLP with fused epilogues (see the module doc).

    Args:
        x: ``[M, H]`` float32/float16/bfloat16, rows grouped by expert (with ``gather_index``:
            ``[S, H]`` source rows, any order).
        weight1: ``[E, H, W]`` in ``x``'s dtype; ``W = 2F`` for ``"swiglu"`` (columns
            ``[0, F)`` are the gate, through SiLU, ``[F, 2F)`` the up projection: Megatron's
            ``chunk(2, -1)`` layout), ``W = F`` for ``"gelu"`` (erf) / ``"gelu_tanh"``.
        weight2: ``[E, F, H]`` in ``x``'s dtype.
        tokens_per_expert: ``[E]`` int32/int64 on ``x``'s device.
        probs: ``[M]`` routing probabilities (any float dtype) multiplying ``act(h)`` before
            fc2, or None. Its gradient is ``sum_f dL/dy * act(h)`` (fp32, fixed order). With
            ``gather_index``: ``[S, E]``, row ``r`` of expert ``e`` weighs
            ``probs[gather_index[r], e]`` (the router's probabilities, not permuted), or ``[S]``,
            row ``r`` weighs ``probs[gather_index[r]]`` (e.g. an expert-parallel receive
            buffer's probabilities; then ``token_map`` has one column, of expert 0).
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
        validate: the counts' data check, as :func:`mtp.ops.grouped_gemm`'s (on the device by
            default, ``"sync"`` for typed errors, False off).
        gather_index: ``[M]`` int32/int64, the source row of each grouped row (``-1``: an empty
            row, zeros in and a probability of 0), e.g. the ``row_id_map`` of
            :func:`mtp.ops.moe_permute.moe_permute_row_map`; fc1 reads ``x`` through it.
        token_map: with ``gather_index``, its :class:`~mtp.ops.moe_permute.TokenMap` (built
            with it; not checked against it): the backward sums each source row's gradients
            and writes the probabilities' gradient with it. Its values are checked (in
            ``[-1, S)``) under ``validate``.
        scatter_index: ``[M]`` int32/int64, a permutation of the output's rows: grouped row
            ``r`` is stored at ``out[scatter_index[r]]`` by fc2's epilogue (e.g. an
            expert-parallel receive buffer's rows straight back in the order they arrived in),
            and the backward reads the output gradient through it (checked to be one, each row
            in ``[-1, M)`` and stored once, under ``validate``).
        fp8_recipe: ``"blockwise"``, ``"mxfp8"`` or an :class:`~mtp.ops.Fp8Recipe`: both GEMMs
            in FP8 with the tokens quantised once (at their source rows with
            ``gather_index``) and fc1 writing its activation quantised
            (:mod:`mtp.ops.grouped_mlp_fp8`); the weights in any float dtype (the master
            weights: their gradients in that dtype), no biases.
        fp8_weight_cache: with ``fp8_recipe``, an :class:`~mtp.ops.Fp8WeightCache` (the
            weights quantised once per optimizer step).

    Returns:
        ``[M, H]`` in ``x``'s dtype; rows past ``sum(tokens_per_expert)`` are zero (with
        ``scatter_index``: the rows they are stored at).
        Differentiable in ``x``, the weights, biases and ``probs`` (once).
    """
    args = (x, weight1, weight2, tokens_per_expert, probs, bias1, bias2, activation,
            float(activation_limit), float(activation_alpha), bool(gradient_accumulation_fusion),
            backend, validate, gather_index, token_map, scatter_index)  # fmt: skip
    if fp8_recipe is not None or fp8_weight_cache is not None:
        if scatter_index is not None:
            raise ValueError("scatter_index is not supported with fp8_recipe (the FP8 MLP "
                             "stores its rows in order); scatter the output after the call")
        return fp8_mlp(*args[:-1], fp8_recipe, fp8_weight_cache)
    if eager(x, weight1, weight2, tokens_per_expert, probs, bias1, bias2, gather_index,
             scatter_index):  # fmt: skip
        return _eager(*args)
    name = resolve_backend("grouped_mlp", backend, x.device, _BACKENDS)
    _check_activation(weight1, activation)
    rows = gather_index.shape[0] if isinstance(gather_index, torch.Tensor) else None
    _, counts = prepare_call(x, weight1, tokens_per_expert, False, None, name, validate, bias1,
                             activation, rows)  # fmt: skip
    _check(x, weight1, weight2, probs, bias2, activation, gather_index, token_map, scatter_index)
    if gather_index is not None or scatter_index is not None:
        check_index_values(gather_index, x.shape[0], scatter_index, rows or x.shape[0], validate)
    return _run(name, *args[:3], counts, *args[4:11], None, gather_index, token_map,
                scatter_index)  # fmt: skip


def _gathered_reference(x, probs, gather, counts):
    """The rows and probabilities a row gather reads, materialised (the reference backend)."""
    keep = (gather >= 0).unsqueeze(1)
    rows = torch.where(keep, x.index_select(0, gather.clamp(min=0).long()), 0)
    if probs is None:
        return rows, None
    src = gather.clamp(min=0).long()
    if probs.dim() == 1:
        return rows, torch.where(keep.squeeze(1), probs[src], 0)
    ends = torch.cumsum(counts.to(gather.device), 0)
    r = torch.arange(gather.shape[0], device=gather.device)
    expert = torch.searchsorted(ends, r, right=True).clamp(max=probs.shape[1] - 1)
    return rows, torch.where(keep.squeeze(1), probs[src, expert], 0)


def _scattered_reference(out, scatter):
    """``res[scatter[r]] = out[r]`` (rows with ``scatter[r] < 0`` dropped; the reference
    backend)."""
    keep = scatter >= 0
    res = out.new_zeros(out.shape)
    return res.index_put((scatter[keep].long(),), out[keep])


def _run(name, x, weight1, weight2, counts, probs, bias1, bias2, activation, limit, alpha,
         accumulate, routing, gather=None, token_map=None, scatter=None):  # fmt: skip
    """The call on checked arguments (``routing``: the eager path's, else None)."""
    if accumulate:
        for w in (weight1, weight2):
            if w.requires_grad:
                check_main_grad(w)
    if name == "reference":
        if gather is not None:
            x, probs = _gathered_reference(x, probs, gather, counts)
        kw = dict(backend="reference", validate=False, gradient_accumulation_fusion=accumulate)
        y = grouped_gemm(x, weight1, counts, bias=bias1, activation=activation, probs=probs,
                         activation_limit=limit, activation_alpha=alpha, **kw)  # fmt: skip
        out = grouped_gemm(y, weight2, counts, bias=bias2, **kw)
        return out if scatter is None else _scattered_reference(out, scatter)
    probs = None if probs is None else probs.contiguous()
    bias1 = None if bias1 is None else bias1.contiguous()
    bias2 = None if bias2 is None else bias2.contiguous()
    act = (activation, limit, alpha)
    tm = (None, None, None) if token_map is None else (
        token_map.rows, token_map.experts, token_map.count)
    if routing is None:
        return _FusedGroupedMLP.apply(x, weight1, weight2, probs, bias1, bias2, counts, gather,
                                      *tm, scatter, (act, accumulate, None))  # fmt: skip
    if not needs_grad(x, weight1, weight2, probs, bias1, bias2):
        return _fused_forward(x, weight1, weight2, counts, probs, bias1, bias2, act, routing,
                              gather, scatter)[0]  # fmt: skip
    return _APPLY(x, weight1, weight2, probs, bias1, bias2, counts, gather, *tm, scatter,
                  (act, accumulate, routing))


def _eager(x, weight1, weight2, tokens_per_expert, probs, bias1, bias2, activation, limit, alpha,
           accumulate, backend, validate, gather, token_map, scatter):  # fmt: skip
    """:func:`grouped_mlp` on the eager path: the free checks once per key, the routing
    metadata of the counts derived once for both GEMMs and the backward (its status word is the
    counts' device-side check), no custom op."""
    mode = settings.current().validate if validate is True else validation_mode(validate)
    name = _eager_gemm.backend_name("grouped_mlp", backend, x.device, _BACKENDS)
    t = tokens_per_expert
    key = ("grouped_mlp", name, activation, x.shape, x.dtype, x.device, weight1.shape,
           weight1.dtype, weight1.device, weight2.shape, weight2.dtype, weight2.device, t.shape,
           t.dtype, t.device, probs is None or (probs.shape, probs.dtype, probs.device),
           bias1 is None or (bias1.shape, bias1.dtype, bias1.device),
           bias2 is None or (bias2.shape, bias2.dtype, bias2.device),
           gather is None or (gather.shape, gather.dtype, gather.device, token_map.__class__,
                              _map_key(token_map)),
           scatter is None or (scatter.shape, scatter.dtype, scatter.device))  # fmt: skip
    impl = GROUPED_GEMM_BACKENDS[name]
    if not _eager_gemm.seen(key):
        _check_activation(weight1, activation)
        check_arguments(x, weight1, t, False, None, bias1, activation)
        check_backend(name, impl, x, weight1, t)
        _check(x, weight1, weight2, probs, bias2, activation, gather, token_map, scatter)
        _eager_gemm.remember(key)
    rows = None if gather is None else gather.shape[0]
    counts, routing = _eager_gemm.counts_and_routing(t, x, weight1.shape[0], impl, mode, rows)
    if gather is not None or scatter is not None:
        check_index_values(gather, x.shape[0], scatter, rows or x.shape[0], mode)
    out = _run(name, x, weight1, weight2, counts, probs, bias1, bias2, activation, limit, alpha,
               accumulate, routing, gather, token_map, scatter)  # fmt: skip
    if routing.head is None:
        routing.validate()
    return out


def _map_key(token_map) -> tuple | None:
    """The shapes, dtypes and devices of a token map's tensors (None when it is not one)."""
    if not isinstance(token_map, TokenMap):
        return None
    return tuple((t.shape, t.dtype, t.device, t.stride())
                 for t in (token_map.rows, token_map.experts, token_map.count))
