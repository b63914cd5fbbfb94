"""Top-k router with Megatron-Core semantics: :class:`TopKRouter` and its functional pieces.

What it computes (as Megatron-Core's ``TopKRouter`` and ``moe_utils`` do, argument names kept):

- ``logits = input @ weight.T`` (``[T, E]``, in ``router_dtype``, default the input dtype).
- Scores and top-k (:func:`topk_softmax_with_capacity`):

  - ``"softmax"``: ``pre_softmax=False`` takes the top-k logits and softmaxes them (fp32);
    ``pre_softmax=True`` softmaxes all logits, then takes the top-k probabilities.
  - ``"sigmoid"``: top-k of ``sigmoid(logits)``, renormalised to sum 1 when ``topk > 1``.
  - ``expert_bias`` (aux-loss-free balancing, DeepSeek-V3): added to the scores used for
    *selection* only; the returned probabilities are the unbiased scores of the chosen experts.
    Megatron-Core allows it with ``"sigmoid"`` only; here it also works with ``"softmax"``
    (added to the softmax probabilities with ``pre_softmax``, to the logits without).
  - ``scaling_factor`` multiplies the probabilities; ``num_groups``/``group_topk`` restrict the
    choice to the best expert groups (device/node-limited routing).

- Capacity (``capacity_factor``): ``capacity = ceil(T * topk / E * capacity_factor)`` slots per
  expert (Megatron's ``get_capacity``), at most ``T``. An expert routed more tokens keeps
  ``capacity`` of them and drops the rest (their probability becomes 0 and ``routing_map``
  False): ``drop_policy="probs"`` keeps the highest probabilities, ties going to the lower token
  index; ``"position"`` keeps the first tokens in token order. (Megatron picks with an unsorted
  ``topk``, which leaves ties to the kernel; the rule here is deterministic.)
- Load-balancing loss (:func:`switch_load_balancing_loss_func`, Switch/GShard form):
  ``coeff * E / (topk * T**2) * sum_e(sum_t scores[t, e] * n_e)``, ``scores`` the full softmax
  (or normalised sigmoid) over all experts, ``n_e`` the tokens whose unbiased top-k includes
  ``e``. Router z-loss (:func:`z_loss_func`): ``coeff * mean_t(logsumexp(logits[t])**2)``.

Both losses are computed on the device (no host sync, no host-to-device copy), in training mode
with gradients enabled, and reach the trainer's loss the way Megatron-Core does it: through
:class:`MoEAuxLossAutoScaler`, an identity on an activation (the probabilities for the
load-balancing loss, the logits for the z-loss) whose backward also feeds ``d(aux)/d(aux) =
scale`` into the loss's graph. ``loss.backward()`` on the main loss therefore trains the router
with the auxiliary losses without any plumbing in the trainer; call
``MoEAuxLossAutoScaler.set_loss_scale(scale)`` when the main loss is scaled (fp16 loss scaling,
division by the number of micro-batches) so both get the same scale. The values are kept,
detached, for logging: ``router.aux_loss`` and ``router.z_loss`` (coefficient included, as
Megatron's functions return them; ``None`` when not computed).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.utils import check_int

__all__ = [
    "MoEAuxLossAutoScaler",
    "TopKRouter",
    "compute_routing_scores_for_aux_loss",
    "get_capacity",
    "get_updated_expert_bias",
    "switch_load_balancing_loss_func",
    "topk_softmax_with_capacity",
    "z_loss_func",
]

logger = logging.getLogger("mtp")

_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_DROP_POLICIES = ("probs", "position")


# --------------------------------------------------------------------------------------------
# Auxiliary losses
# --------------------------------------------------------------------------------------------


_LOSS_SCALE: list = [None]  # MoEAuxLossAutoScaler's scale (a module global: torch.compile reads it)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also gives ``aux_loss`` the gradient ``scale``.

    ``MoEAuxLossAutoScaler.apply(activation, aux_loss)`` returns ``activation``; when the main
    loss is back-propagated through it, ``aux_loss`` receives ``main_loss_backward_scale``
    (default 1) as its gradient, so the auxiliary loss is optimised as if it had been added to
    the main loss. Same name and behaviour as Megatron-Core's; the default scale is made with
    ``torch.ones_like`` on the device (no host-to-device copy).
    """

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        # The scale is read here (not in backward) so that torch.compile traces it as a graph
        # input; it is a one-element tensor, so later set_loss_scale() calls still apply.
        scale = _LOSS_SCALE[0]
        grad_aux = torch.ones_like(aux_loss)
        if scale is not None:
            grad_aux = grad_aux * scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        ctx.save_for_backward(grad_aux)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad_aux,) = ctx.saved_tensors
        return grad_output, grad_aux

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the gradient the auxiliary losses receive (match the main loss's scale).

        Args:
            scale: a one-element tensor (kept; later calls copy into it, so a captured graph
                that read it sees the new value).
        """
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
        if _LOSS_SCALE[0] is None:
            _LOSS_SCALE[0] = scale
        else:
            _LOSS_SCALE[0].copy_(scale)
        MoEAuxLossAutoScaler.main_loss_backward_scale = _LOSS_SCALE[0]

    @staticmethod
    def reset_loss_scale() -> None:
        """Back to the default gradient 1 for the auxiliary losses."""
        _LOSS_SCALE[0] = None
        MoEAuxLossAutoScaler.main_loss_backward_scale = None


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, as Megatron-Core computes it.

    ``loss = coeff * E / (topk * T**2) * sum_e(P_e * n_e)`` with ``P_e = sum_t probs[t, e]``.

    Args:
        probs: ``[T, E]`` scores over all experts (softmax, or normalised sigmoid).
        tokens_per_expert: ``[E]`` tokens routed to each expert (any number dtype).
        total_num_tokens: ``T``.
        topk, num_experts, moe_aux_loss_coeff: ``k``, ``E`` and the coefficient.

    Returns:
        A 0-D tensor in ``probs``' dtype (fp32 for the router's scores), on the device.
    """
    aggregated = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * max(total_num_tokens, 1) ** 2)
    return torch.sum(aggregated * tokens_per_expert.to(aggregated.dtype)) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean_t(logsumexp(logits[t])**2)``, a 0-D tensor."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    math_dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.mean(torch.square(torch.logsumexp(logits.to(math_dtype), dim=-1))) * z_loss_coeff


def get_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None
) -> int:
    """Slots per expert: ``ceil(num_tokens / num_experts * capacity_factor)`` (Megatron-Core's
    ``get_capacity``; ``num_tokens`` is ``T * topk`` there), at least ``min_capacity``."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor,
    expert_bias: torch.Tensor,
    expert_bias_update_rate: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3, arXiv:2408.15664): ``bias + rate *
    sign(mean(n) - n)``, ``n`` the token counts summed over ``group`` (all-reduced in place when
    a group is given). Returns the new bias; no host sync."""
    with torch.no_grad():
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(tokens_per_expert, group=group)
        counts = tokens_per_expert.to(torch.float32)
        offset = counts.mean(dim=-1, keepdim=True) - counts
        return expert_bias + torch.sign(offset).to(expert_bias.dtype) * expert_bias_update_rate


# --------------------------------------------------------------------------------------------
# Top-k selection and capacity
# --------------------------------------------------------------------------------------------


def _group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best of ``num_groups`` expert groups (a group
    scores the sum of its best ``topk // group_topk`` experts), as in Megatron-Core."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return _group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=1)


def _capacity_mask(
    probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, drop_policy: str
) -> torch.Tensor:
    """``[T, E]`` bool: the (at most) ``capacity`` tokens each expert keeps."""
    if drop_policy == "position":
        # Routed tokens first, in token order, then the unrouted ones (padding): exactly
        # ``capacity`` rows per expert, of which the routed ones are its first routed tokens.
        key = (~routing_map).to(torch.int8)
    else:
        # "probs": highest probabilities first, ties to the lower token (stable sort).
        key = -probs.float()
    order = torch.sort(key, dim=0, stable=True).indices[:capacity]
    return torch.zeros_like(routing_map).scatter(0, order, True)


def topk_softmax_with_capacity(
    logits: torch.Tensor,
    topk: int,
    capacity_factor: float | None = None,
    pad_to_capacity: bool = False,
    drop_policy: str = "probs",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    deterministic_mode: bool = False,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with optional capacity (Megatron-Core's function of the same name).

    Args:
        logits: ``[T, E]`` router logits.
        topk: experts per token.
        capacity_factor: drop tokens beyond ``get_capacity(T * topk, E, capacity_factor)``
            (at most ``T``) per expert, by ``drop_policy`` (see the module docstring).
        pad_to_capacity: Megatron's padded map: ``routing_map`` marks exactly ``capacity``
            tokens per expert (unrouted ones with probability 0). mtp's layers leave it False
            and pad with empty slots instead (``permute(..., drop_and_pad=True)``).
        drop_policy: ``"probs"`` or ``"position"``.
        use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias:
            see the module docstring. ``deterministic_mode`` is accepted for compatibility
            (the computation is always deterministic).

    Returns:
        ``(probs [T, E] in logits' dtype (0 off the routing), routing_map [T, E] bool,
        tokens_per_expert [E] int64 before dropping)``. Static shapes, no host sync.
    """
    del deterministic_mode
    num_tokens, num_experts = logits.shape
    check_routing_config(
        num_experts, topk, score_function, capacity_factor, drop_policy, num_groups, group_topk
    )
    bias = None if expert_bias is None else expert_bias.float()
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            select = scores if bias is None else scores + bias
            _, top_indices = _topk(select, topk, num_groups, group_topk)
            probs = torch.gather(scores, 1, top_indices)
        else:
            select = logits if bias is None else logits.float() + bias
            _, top_indices = _topk(select, topk, num_groups, group_topk)
            probs = torch.softmax(torch.gather(logits, 1, top_indices), dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        select = scores if bias is None else scores + bias
        _, top_indices = _topk(select, topk, num_groups, group_topk)
        probs = torch.gather(scores, 1, top_indices)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is None:
        return routing_probs, routing_map, tokens_per_expert
    capacity = min(get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens)
    keep = _capacity_mask(routing_probs, routing_map, capacity, drop_policy)
    final_map = keep if pad_to_capacity else routing_map & keep
    return routing_probs * final_map, final_map, tokens_per_expert


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores over all experts (fp32 softmax, or sigmoid normalised per token) and the
    ``[T, E]`` map of their (unbiased) top-k, as Megatron-Core feeds the load-balancing loss.

    Returns ``(routing_map, scores)`` (Megatron's order)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(
            f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}"
        )
    top_indices = torch.topk(scores, k=topk, dim=1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


def check_routing_config(
    num_experts: int,
    topk: int,
    score_function: str = "softmax",
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    num_groups: int | None = None,
    group_topk: int | None = None,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad routing argument."""
    check_int("num_experts", num_experts, 1)
    check_int("topk", topk, 1)
    if topk > num_experts:
        raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}"
        )
    if drop_policy not in _DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {_DROP_POLICIES}, got {drop_policy!r}")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise TypeError(
                f"capacity_factor must be a number or None, got {type(capacity_factor).__name__}"
            )
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk must be given together (group-limited routing)")
    if num_groups is not None:
        check_int("num_groups", num_groups, 1)
        check_int("group_topk", group_topk, 1)
        if num_experts % num_groups:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by num_groups={num_groups}"
            )
        if (
            group_topk > num_groups
            or topk % group_topk
            or topk // group_topk > num_experts // num_groups
        ):
            raise ValueError(
                f"group_topk={group_topk} must divide topk={topk}, be <= num_groups={num_groups}, "
                "and topk // group_topk must fit in one group"
            )


class TopKRouter(nn.Module):
    """Route each token to its top-k experts (Megatron-Core ``TopKRouter`` semantics).

    Args:
        hidden_size: ``H``.
        num_experts: ``E`` (all experts, over every expert-parallel rank).
        topk: experts per token (``moe_router_topk``).
        score_function: ``"softmax"`` or ``"sigmoid"`` (``moe_router_score_function``).
        pre_softmax: softmax before the top-k (``moe_router_pre_softmax``).
        aux_loss_coeff: load-balancing loss coefficient (``moe_aux_loss_coeff``); 0 disables.
        z_loss_coeff: router z-loss coefficient (``moe_z_loss_coeff``); 0 disables.
        expert_bias: aux-loss-free balancing (``moe_router_enable_expert_bias``): a float32
            ``expert_bias`` buffer steers the selection, ``local_tokens_per_expert`` counts the
            routed tokens in training forwards, and :meth:`update_expert_bias` (call it after
            the optimizer step, outside any captured graph) moves the bias.
        capacity_factor: drop tokens beyond each expert's capacity (see the module docstring);
            None is dropless.
        drop_policy: ``"probs"`` or ``"position"`` (``moe_token_drop_policy``).
        num_groups, group_topk: group-limited routing (``moe_router_num_groups``,
            ``moe_router_group_topk``).
        scaling_factor: multiplies the routing probabilities (``moe_router_topk_scaling_factor``).
        router_dtype: dtype of the logits and scores (``moe_router_dtype``: ``torch.float32``
            or ``torch.float64``); None uses the input dtype.
        init_std: the weight starts as ``normal(0, init_std)`` (Megatron's ``init_method``).
        params_dtype, device: of the ``[E, H]`` weight.

    ``forward(input [..., H]) -> (probs [T, E], routing_map [T, E] bool)``, ``T`` the product of
    the leading dims. ``probs`` is in the logits' dtype and zero off the routing. The auxiliary
    losses ride on the autograd graph (see :class:`MoEAuxLossAutoScaler`); their detached
    values are in ``self.aux_loss`` / ``self.z_loss``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        score_function: str = "softmax",
        pre_softmax: bool = False,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        expert_bias: bool = False,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        num_groups: int | None = None,
        group_topk: int | None = None,
        scaling_factor: float | None = None,
        router_dtype: torch.dtype | None = None,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        check_routing_config(
            num_experts, topk, score_function, capacity_factor, drop_policy, num_groups, group_topk
        )
        if router_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(
                f"router_dtype must be None, torch.float32 or torch.float64, got {router_dtype}"
            )
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.score_function, self.pre_softmax = score_function, bool(pre_softmax)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.num_groups, self.group_topk = num_groups, group_topk
        self.scaling_factor, self.router_dtype = scaling_factor, router_dtype
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=params_dtype, device=device)
        )
        self.init_std = init_std
        self.enable_expert_bias = bool(expert_bias)
        if self.enable_expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, self.init_std)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, topk={self.topk}, "
            f"score_function={self.score_function!r}, capacity_factor={self.capacity_factor}"
        )

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for ``num_tokens`` tokens (None when dropless)."""
        if self.capacity_factor is None:
            return None
        return min(
            get_capacity(num_tokens * self.topk, self.num_experts, self.capacity_factor), num_tokens
        )

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` logits in ``router_dtype`` (default: the input dtype)."""
        dtype = self.router_dtype or input.dtype
        x = input.reshape(-1, input.shape[-1])
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def _losses_enabled(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (and capacity) routing of ``[T, E]`` logits, with the auxiliary losses."""
        num_tokens = logits.shape[0]
        self.aux_loss = self.z_loss = None
        if self.z_loss_coeff > 0 and self._losses_enabled():
            z_loss = z_loss_func(logits, self.z_loss_coeff)
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
            self.z_loss = z_loss.detach()
        probs, routing_map, _ = topk_softmax_with_capacity(
            logits,
            self.topk,
            capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy,
            use_pre_softmax=self.pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
        )
        if self.aux_loss_coeff > 0 and self._losses_enabled():
            aux_map, scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function
            )
            aux_loss = switch_load_balancing_loss_func(
                scores,
                aux_map.sum(dim=0),
                num_tokens,
                self.topk,
                self.num_experts,
                self.aux_loss_coeff,
            )
            probs = MoEAuxLossAutoScaler.apply(probs, aux_loss)
            self.aux_loss = aux_loss.detach()
        if self.enable_expert_bias and self._losses_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if input.dim() < 1 or input.shape[-1] != self.hidden_size:
            raise ValueError(
                f"input must be [..., hidden_size={self.hidden_size}], got {tuple(input.shape)}"
            )
        return self.routing(self.gating(input))

    @torch.no_grad()
    def update_expert_bias(
        self, expert_bias_update_rate: float = 1e-3, group: dist.ProcessGroup | None = None
    ) -> None:
        """Move ``expert_bias`` towards balance from the counts since the last call, then reset
        them. ``group``: the ranks whose tokens share this router (Megatron all-reduces over
        tensor x data x context parallel); None uses the local counts. No host sync."""
        if not self.enable_expert_bias:
            raise RuntimeError("update_expert_bias() needs TopKRouter(..., expert_bias=True)")
        new_bias = get_updated_expert_bias(
            self.local_tokens_per_expert, self.expert_bias, expert_bias_update_rate, group
        )
        self.expert_bias.copy_(new_bias)
        self.local_tokens_per_expert.zero_()
