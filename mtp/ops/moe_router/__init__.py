"""The fused MoE router (:func:`moe_router`): router logits in; routing probabilities, the
routing map and the auxiliary-loss statistics out, in one launch; the logits' gradient in one.

Custom ops (``torch.ops.mtp.*``, with fake implementations; what ``torch.compile`` traces):

- ``mtp::moe_router(logits, expert_bias, padding_mask, topk, score, renorm, scaling_factor,
  num_groups, group_topk, group_m, stats) -> (probs, routing_map, scores_sum, counts,
  lse_sq_sum)``: ``counts`` is ``[2, E]`` (aux-loss top-k counts, routed counts); the
  statistics are ``[0]`` when ``stats`` (a bit set: 1 aux, 2 z, 4 routed counts) is 0.
- ``mtp::moe_router_backward(logits, routing_map, dprobs, dscores, dz, padding_mask, score,
  renorm, scaling_factor, num_groups) -> dlogits``.

Autograd (:class:`_RouterFunction`) saves the logits and the routing map; the backward recomputes
the scores from the logits. Eager calls run the launchers directly (no dispatcher round trip);
traced calls go through the custom ops. The device code is :mod:`mtp.kernels.moe_router`; the
``"reference"`` backend is :mod:`mtp.ops.moe_router.reference` (aten ops, PyTorch's autograd).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from mtp.kernels import moe_router as _kernels
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import CheckedKeys, autograd_apply, eager, needs_grad
from mtp.ops.moe_router.checks import check_router_inputs, check_routing_config
from mtp.ops.moe_router.reference import (
    RouterOutput,
    compute_routing_scores_for_aux_loss,
    math_dtype,
    moe_router_reference,
    renormalises,
)
from mtp.utils import check_int, empty

__all__ = [
    "RouterOutput",
    "check_routing_config",
    "compute_routing_scores_for_aux_loss",
    "moe_router",
    "moe_router_reference",
]

_BACKENDS = ("triton", "reference")
_AUX, _Z, _COUNTS = 1, 2, 4


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


def _stat_shapes(num_experts: int, stats: int) -> tuple[tuple, tuple, tuple]:
    if not stats:
        return (0,), (0,), (0,)
    return (num_experts,), (2, num_experts), ()


def _forward_impl(logits, expert_bias, padding_mask, topk, score, renorm, scaling_factor,
                  num_groups, group_topk, group_m, stats):  # fmt: skip
    num_tokens, num_experts = logits.shape
    device, math = logits.device, math_dtype(logits.dtype)
    probs = empty((num_tokens, num_experts), dtype=logits.dtype, device=device)
    routing_map = empty((num_tokens, num_experts), dtype=torch.bool, device=device)
    s_shape, c_shape, z_shape = _stat_shapes(num_experts, stats)
    scores = empty(s_shape, dtype=math, device=device)
    counts = empty(c_shape, dtype=math, device=device)
    z = empty(z_shape, dtype=math, device=device)
    _kernels.router_forward(
        logits, probs, routing_map.view(torch.uint8), topk=topk, score=score, renorm=renorm,
        scaling_factor=scaling_factor, num_groups=num_groups, group_topk=group_topk,
        group_m=group_m, expert_bias=expert_bias,
        padding_mask=None if padding_mask is None else padding_mask.view(torch.uint8),
        stats=(scores, counts, z) if stats else None, aux=bool(stats & _AUX),
        zloss=bool(stats & _Z), counts=bool(stats & _COUNTS),
    )  # fmt: skip
    return probs, routing_map, scores, counts, z


@torch.library.custom_op("mtp::moe_router", mutates_args=())
def _router_op(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    topk: int,
    score: int,
    renorm: bool,
    scaling_factor: float,
    num_groups: int,
    group_topk: int,
    group_m: int,
    stats: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(logits, expert_bias, padding_mask, topk, score, renorm, scaling_factor,
                         num_groups, group_topk, group_m, stats)  # fmt: skip


@_router_op.register_fake
def _(logits, expert_bias, padding_mask, topk, score, renorm, scaling_factor, num_groups,
      group_topk, group_m, stats):  # fmt: skip
    math = math_dtype(logits.dtype)
    s_shape, c_shape, z_shape = _stat_shapes(logits.shape[1], stats)
    return (
        logits.new_empty(logits.shape),
        logits.new_empty(logits.shape, dtype=torch.bool),
        logits.new_empty(s_shape, dtype=math),
        logits.new_empty(c_shape, dtype=math),
        logits.new_empty(z_shape, dtype=math),
    )


def _backward_impl(logits, routing_map, dprobs, dscores, dz, padding_mask, score, renorm,
                   scaling_factor, num_groups):  # fmt: skip
    dlogits = empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _kernels.router_backward(
        logits, routing_map.view(torch.uint8), dprobs, dscores, dz,
        None if padding_mask is None else padding_mask.view(torch.uint8), dlogits,
        score=score, renorm=renorm, scaling_factor=scaling_factor, num_groups=num_groups,
    )  # fmt: skip
    return dlogits


@torch.library.custom_op("mtp::moe_router_backward", mutates_args=())
def _router_backward_op(
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    dprobs: torch.Tensor | None,
    dscores: torch.Tensor | None,
    dz: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    score: int,
    renorm: bool,
    scaling_factor: float,
    num_groups: int,
) -> torch.Tensor:
    return _backward_impl(logits, routing_map, dprobs, dscores, dz, padding_mask, score, renorm,
                          scaling_factor, num_groups)  # fmt: skip


@_router_backward_op.register_fake
def _(logits, routing_map, dprobs, dscores, dz, padding_mask, score, renorm, scaling_factor,
      num_groups):  # fmt: skip
    return logits.new_empty(logits.shape)


class _RouterFunction(torch.autograd.Function):
    """Forward through ``mtp::moe_router``, backward through ``mtp::moe_router_backward``.
    Differentiable outputs: ``probs``, ``scores_sum`` and ``lse_sq_sum``; the backward is not
    itself differentiable (a double backward raises; the ``"reference"`` backend has one)."""

    @staticmethod
    def forward(ctx, logits, expert_bias, padding_mask, plan, stats):
        run = _forward_impl if eager(logits) else torch.ops.mtp.moe_router
        probs, routing_map, scores, counts, z = run(logits, expert_bias, padding_mask, *plan,
                                                    stats)  # fmt: skip
        ctx.save_for_backward(logits, routing_map, padding_mask)
        ctx.mark_non_differentiable(routing_map, counts)
        ctx.set_materialize_grads(False)
        ctx.plan = plan
        return probs, routing_map, scores, counts, z

    @staticmethod
    @once_differentiable
    def backward(ctx, dprobs, _dmap, dscores, _dcounts, dz):
        # without the statistics, ``scores``/``z`` are empty: a traced backward (AOT autograd
        # materialises every gradient) hands in zeros of that empty shape, read as no gradient
        dscores = None if dscores is None or dscores.numel() == 0 else dscores
        dz = None if dz is None or dz.numel() == 0 else dz
        if dprobs is None and dscores is None and dz is None:
            return None, None, None, None, None
        logits, routing_map, padding_mask = ctx.saved_tensors
        _topk, score, renorm, scaling_factor, num_groups, _gk, _gm = ctx.plan
        run = _backward_impl if eager(logits) else torch.ops.mtp.moe_router_backward
        dlogits = run(logits, routing_map, dprobs, dscores, dz, padding_mask, score, renorm,
                      scaling_factor, num_groups)  # fmt: skip
        return dlogits, None, None, None, None


_ROUTER_APPLY = autograd_apply(_RouterFunction)  # the eager path's (C) apply


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _plan_of(num_experts, topk, score_function, pre_softmax, norm_topk_prob, num_groups,
             group_topk, group_score, scaling_factor) -> tuple:  # fmt: skip
    """The kernels' constants: ``(topk, score, renorm, scaling_factor, num_groups, group_topk,
    group_m)``, after the configuration checks."""
    check_routing_config(
        num_experts, topk, score_function, num_groups=num_groups, group_topk=group_topk,
        norm_topk_prob=norm_topk_prob, group_score=group_score, pre_softmax=pre_softmax,
        scaling_factor=scaling_factor,
    )  # fmt: skip
    groups = num_groups or 1
    group_m = 0
    if group_topk:
        per_group = 2 if group_score == "top2" else topk // group_topk
        group_m = min(per_group, num_experts // groups)
    return (
        topk,
        _kernels.SCORES[(score_function, bool(pre_softmax))],
        renormalises(score_function, pre_softmax, topk, norm_topk_prob),
        float(scaling_factor or 0.0),
        groups,
        int(group_topk or 0),
        group_m,
    )


#: :func:`_plan_of` once per configuration in eager calls (Dynamo traces the plain function).
_plan = functools.lru_cache(maxsize=256)(_plan_of)
_CHECKED = CheckedKeys()


def _tensor_key(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.dtype, t.device, t.stride())


def _resolve(backend: str, logits: torch.Tensor, num_groups: int | None) -> str:
    name = resolve_backend("moe_router", backend, logits.device, _BACKENDS)
    if name != "triton":
        return name
    width = _kernels.padded_experts(logits.shape[1], num_groups or 1)
    if width <= _kernels.MAX_EXPERTS:
        return name
    if backend == "auto":
        return "reference"
    raise ValueError(
        f"moe_router: backend='triton' holds a token's experts in registers: at most "
        f"{_kernels.MAX_EXPERTS} (padded to powers of two per group), got num_experts="
        f"{logits.shape[1]} (padded {width}); use backend='reference' or 'auto'"
    )


def moe_router(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    norm_topk_prob: bool | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score: str = "topk",
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    aux_statistics: bool = False,
    z_statistics: bool = False,
    routed_counts: bool = False,
    backend: str = "auto",
) -> RouterOutput:
    """Top-k routing of router logits with Megatron-Core's semantics, fused.

    Args:
        logits: ``[T, E]`` float32 / float16 / bfloat16 / float64 (math in float32; float64 for
            float64 logits).
        topk: experts per token, ``1 <= topk <= E``.
        score_function: ``"softmax"`` or ``"sigmoid"``. Softmax with ``pre_softmax=False``
            chooses the top-k logits and softmaxes them; with ``pre_softmax=True`` it softmaxes
            all logits and chooses the top-k probabilities; sigmoid chooses the top-k
            ``sigmoid(logits)``.
        norm_topk_prob: divide the chosen probabilities by their sum (``+ 1e-20``); None is
            Megatron's rule (sigmoid with ``topk > 1``).
        num_groups, group_topk, group_score: group-limited routing: only the ``group_topk``
            best of ``num_groups`` expert groups are eligible; a group scores the sum of its
            best ``topk // group_topk`` (``"topk"``, Megatron) or best two (``"top2"``,
            DeepSeek-V3) selection values.
        scaling_factor: multiplies the probabilities (``moe_router_topk_scaling_factor``).
        expert_bias: ``[E]`` added to the selection values only (aux-loss-free balancing).
        padding_mask: ``[T]`` bool, True = a token left out of the statistics (still routed).
        aux_statistics: return the load-balancing statistics: the per-expert sums of the
            aux-loss scores (softmax of the logits, or their sigmoid normalised per token; not
            biased, not group-limited) and the tokens whose top-k of those scores holds each
            expert (Megatron's ``compute_routing_scores_for_aux_loss``).
        z_statistics: return ``sum(logsumexp(logits[t])**2)`` (the router z-loss numerator).
        routed_counts: return the tokens routed to each expert.
        backend: ``"auto"`` (``triton`` on CUDA, ``reference`` elsewhere; ``MTP_BACKEND``
            overrides), ``"triton"`` or ``"reference"`` (aten ops, PyTorch's autograd).

    Returns:
        :class:`RouterOutput`. Gradients flow into ``logits`` from ``probs``, ``scores_sum`` and
        ``lse_sq_sum``; the bias and the map have none.

    Ties: every top-k takes NaN as the largest value and breaks ties by the lowest expert index
    (``torch.topk``, which the reference uses, leaves ties to its algorithm: on the CPU
    ``topk([1, 3, 3, 2, 3, 0], 2)`` gives experts 2 and 4). Without ties the choice is the
    reference's; selection values that are computed (softmax, sigmoid) can differ from
    PyTorch's in the last bit, so near-ties within rounding may go either way.

    Launches (triton): forward 1 (the statistics' last program sums the per-program partials,
    deterministically), backward 1; no host sync. Bytes: forward reads the logits and writes
    ``probs`` and the map (``T * E * (2 s + 1)``), plus ``(3 E + 1)`` partials per program of
    at least ``MIN_STAT_ROWS`` rows with statistics; backward reads the logits, the map and
    ``dprobs`` and writes ``dlogits`` (``T * E * (3 s + 1)``). Memory: autograd keeps the
    logits and the map.
    """
    direct = eager(logits, expert_bias, padding_mask)
    key = (topk, _tensor_key(logits), _tensor_key(expert_bias), _tensor_key(padding_mask)) \
        if direct and isinstance(topk, int) else None
    if key is None or key not in _CHECKED:
        check_int("topk", topk, 1)
        check_router_inputs(logits, expert_bias, padding_mask)
        if key is not None:
            _CHECKED.add(key)
    planner = _plan if direct else _plan_of
    plan = planner(logits.shape[1], topk, score_function, bool(pre_softmax), norm_topk_prob,
                   num_groups, group_topk, group_score, scaling_factor)  # fmt: skip
    name = _resolve(backend, logits, num_groups)
    if name == "reference":
        return moe_router_reference(
            logits, topk, padding_mask=padding_mask, aux_statistics=aux_statistics,
            z_statistics=z_statistics, routed_counts=routed_counts,
            score_function=score_function, pre_softmax=pre_softmax,
            norm_topk_prob=norm_topk_prob, num_groups=num_groups, group_topk=group_topk,
            group_score=group_score, scaling_factor=scaling_factor, expert_bias=expert_bias,
        )  # fmt: skip
    stats = (_AUX if aux_statistics else 0) | (_Z if z_statistics else 0) | (
        _COUNTS if routed_counts else 0)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    pad = None if padding_mask is None else padding_mask.reshape(-1).contiguous()
    bias = None if expert_bias is None else expert_bias.contiguous()
    if needs_grad(logits):
        apply = _ROUTER_APPLY if direct else _RouterFunction.apply
        probs, routing_map, scores, counts, z = apply(logits, bias, pad, plan, stats)
    else:
        run = _forward_impl if direct else torch.ops.mtp.moe_router
        probs, routing_map, scores, counts, z = run(logits, bias, pad, *plan, stats)
    return RouterOutput(
        probs, routing_map,
        scores if aux_statistics else None, counts[0] if aux_statistics else None,
        counts[1] if routed_counts else None, z if z_statistics else None,
    )  # fmt: skip
