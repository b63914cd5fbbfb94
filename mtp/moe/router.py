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
with gradients enabled, from the statistics the routing op :func:`mtp.ops.moe_router` returns
with the probabilities (one fused kernel on CUDA: per-expert score sums and counts,
``sum(logsumexp**2)``), and reach the trainer's loss the way Megatron-Core does it: through
:class:`MoEAuxLossAutoScaler`, an identity on the probabilities whose backward also feeds
``d(aux)/d(aux) = scale`` into the loss's graph (Megatron-Core attaches the z-loss to the
logits, which only feed the probabilities: the same gradients). ``loss.backward()`` on the main
loss therefore trains the router with the auxiliary losses without any plumbing in the trainer;
call ``MoEAuxLossAutoScaler.set_loss_scale(scale)`` when the main loss is scaled (fp16 loss
scaling, division by the number of micro-batches) so both get the same scale. The values are kept,
detached, for logging: ``router.aux_loss`` and ``router.z_loss`` (coefficient included, as
Megatron's functions return them; ``None`` when not computed).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.moe.config import RouterConfig
from mtp.moe.load_balancing import save_to_aux_losses_tracker, sequence_load_balancing_loss_func
from mtp.moe.routing import (  # noqa: F401 - re-exported
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    drop_to_capacity,
    get_capacity,
    get_updated_expert_bias,
    load_balancing_loss_from_sums,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from mtp.moe._checks import check_device, check_float_dtype, check_group
from mtp.ops.moe_router import RouterOutput, moe_router
from mtp.parallel.params import mark_tensor_parallel_grad_reduced
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


class TopKRouter(nn.Module):
    """Route each token to its top-k experts (Megatron-Core ``TopKRouter`` semantics).

    Args:
        hidden_size: ``H``.
        num_experts: ``E`` (all experts, over every expert-parallel rank).
        topk: experts per token (``moe_router_topk``).
        score_function: ``"softmax"`` or ``"sigmoid"`` (``moe_router_score_function``).
        pre_softmax: softmax before the top-k (``moe_router_pre_softmax``).
        norm_topk_prob: renormalise the chosen probabilities (see
            :func:`topk_softmax_with_capacity`; None: Megatron's rule).
        aux_loss_coeff: load-balancing loss coefficient(s) (``moe_aux_loss_coeff``; a list with
            a list of ``load_balancing_type``); 0 disables.
        load_balancing_type: ``"aux_loss"`` (Switch, per micro-batch), ``"seq_aux_loss"`` (per
            sequence of a ``[s, b, h]`` input, averaged over ``b``), ``"global_aux_loss"`` (token
            counts averaged over the micro-batches since :meth:`reset_global_aux_loss_tracker`),
            or a list of them (``moe_router_load_balancing_type``).
        z_loss_coeff: router z-loss coefficient (``moe_z_loss_coeff``); 0 disables.
        expert_bias: aux-loss-free balancing (``moe_router_enable_expert_bias``): a float32
            ``expert_bias`` buffer steers the selection, ``local_tokens_per_expert`` counts the
            routed tokens in training forwards, and :meth:`update_expert_bias` (call it after
            the optimizer step, outside any captured graph) moves the bias. DeepSeek-V3's
            ``e_score_correction_bias``.
        router_bias: a learnt bias ``[E]`` on the logits (GPT-OSS's router ``nn.Linear`` bias).
        capacity_factor: drop tokens beyond each expert's capacity (see the module docstring);
            None is dropless.
        drop_policy: ``"probs"`` or ``"position"`` (``moe_token_drop_policy``).
        num_groups, group_topk: group-limited routing (``moe_router_num_groups``,
            ``moe_router_group_topk``; DeepSeek-V3's ``n_group``, ``topk_group``).
        group_score: ``"topk"`` (Megatron: a group scores its best ``topk // group_topk``) or
            ``"top2"`` (DeepSeek-V3: its best two).
        scaling_factor: multiplies the routing probabilities (``moe_router_topk_scaling_factor``,
            DeepSeek-V3's ``routed_scaling_factor``).
        input_jitter_eps: in training, multiply the input by ``U(1 - eps, 1 + eps)`` noise
            (``moe_input_jitter_eps``); None disables.
        router_dtype: dtype of the logits and scores (``moe_router_dtype``: ``torch.float32``
            or ``torch.float64``); None uses the input dtype.
        backend: of the routing op :func:`mtp.ops.moe_router`: ``"auto"`` (the fused Triton
            kernel on CUDA, aten ops elsewhere), ``"triton"`` or ``"reference"``; a grouped
            GEMM backend name (a :class:`~mtp.moe.MoELayer`'s) means ``"auto"``.
        tp_group: the group over which the tokens of one sequence are split (sequence parallel
            inside a tensor-parallel group): the weight's gradient is summed over it in the
            backward (each rank sees its own tokens; the parameters are marked
            ``tensor_parallel_grad_reduced``, see :mod:`mtp.parallel.params`), and the
            load-balancing statistics are computed over all its tokens (Megatron's
            ``tp_cp_group``). None: no such group.
        aux_loss_group: where ``"global_aux_loss"`` sums its token counts (Megatron: tensor x
            data x context parallel); None: ``tp_group``.
        layer_number, num_layers: when given, the losses are recorded in the per-layer tracker
            (:func:`mtp.moe.load_balancing.save_to_aux_losses_tracker`).
        init_std: the weight starts as ``normal(0, init_std)`` (Megatron's ``init_method``).
        params_dtype, device: of the ``[E, H]`` weight.

    ``forward(input [..., H], padding_mask=None) -> (probs [T, E], routing_map [T, E] bool)``,
    ``T`` the product of the leading dims. ``probs`` is in the logits' dtype and zero off the
    routing. ``padding_mask`` (bool, the input's leading shape, True = ignored token): such
    tokens are still routed (their output is whatever the experts give; mask them in the loss)
    but take no part in the load-balancing losses, the z-loss or the expert-bias counts. The
    auxiliary losses ride on the autograd graph (see :class:`MoEAuxLossAutoScaler`); their
    detached values are in ``self.aux_loss`` (all load-balancing types summed) / ``self.z_loss``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int | None = None,
        topk: int | None = None,
        *,
        config: RouterConfig | None = None,
        tp_group: dist.ProcessGroup | None = None,
        aux_loss_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        **flat,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        if config is None:
            config = RouterConfig(num_experts, topk, **flat)
        elif num_experts is not None or topk is not None or flat:
            raise TypeError("TopKRouter: pass either config= or the routing arguments, not both")
        elif not isinstance(config, RouterConfig):
            raise TypeError(f"config must be a RouterConfig, got {type(config).__name__}")
        check_float_dtype("params_dtype", params_dtype)
        check_device("device", device)
        check_group("tp_group", tp_group)
        check_group("aux_loss_group", aux_loss_group)
        self.config = c = config
        self.load_balancing = c.load_balancing
        self.hidden_size, self.num_experts, self.topk = hidden_size, c.num_experts, c.topk
        self.score_function, self.pre_softmax = c.score_function, c.pre_softmax
        self.norm_topk_prob, self.group_score = c.norm_topk_prob, c.group_score
        self.aux_loss_coeff = sum(self.load_balancing.values())
        self.z_loss_coeff = float(c.z_loss_coeff)
        self.capacity_factor, self.drop_policy = c.capacity_factor, c.drop_policy
        self.num_groups, self.group_topk = c.num_groups, c.group_topk
        self.scaling_factor, self.router_dtype = c.scaling_factor, c.router_dtype
        self.input_jitter_eps = c.input_jitter_eps
        self.backend = c.backend if c.backend in ("triton", "reference") else "auto"
        self.tp_group = tp_group
        self.aux_loss_group = aux_loss_group if aux_loss_group is not None else tp_group
        self.layer_number, self.num_layers = c.layer_number, c.num_layers
        num_experts, router_bias, expert_bias = c.num_experts, c.router_bias, c.expert_bias
        init_std = c.init_std
        kw = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        if router_bias:
            self.bias = nn.Parameter(torch.zeros(num_experts, **kw))
        else:
            self.register_parameter("bias", None)
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
        if "global_aux_loss" in self.load_balancing:
            self.register_buffer(
                "global_tokens_per_expert",
                torch.zeros(num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
            self.register_buffer(
                "ga_steps", torch.zeros((), dtype=torch.float32, device=device), persistent=False
            )
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        if self._tp_size() > 1:  # gating() sums their gradients over tp_group in the backward
            for p in self.parameters():
                mark_tensor_parallel_grad_reduced(p)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, self.init_std)
            if self.bias is not None:
                self.bias.zero_()

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

    def _tp_size(self) -> int:
        return 1 if self.tp_group is None else dist.get_world_size(self.tp_group)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` logits in ``router_dtype`` (default: the input dtype)."""
        dtype = self.router_dtype or input.dtype
        x = input.reshape(-1, input.shape[-1])
        weight, bias = self.weight, self.bias
        if self._tp_size() > 1:
            from mtp.parallel.mappings import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight, self.tp_group)
            if bias is not None:
                bias = copy_to_tensor_model_parallel_region(bias, self.tp_group)
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    def apply_input_jitter(self, input: torch.Tensor) -> torch.Tensor:
        """``input * U(1 - eps, 1 + eps)`` in training with ``input_jitter_eps`` (Switch)."""
        if self.input_jitter_eps is None or not self.training:
            return input
        eps = self.input_jitter_eps
        noise = torch.empty_like(input).uniform_(1.0 - eps, 1.0 + eps)
        return input * noise

    def _losses_enabled(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _track(self, name: str, loss: torch.Tensor, coeff: float) -> None:
        if self.layer_number is not None and coeff > 0:
            save_to_aux_losses_tracker(
                name, loss / coeff, self.layer_number, self.num_layers, self.tp_group
            )

    def _load_balancing_losses(self, out: RouterOutput, logits, valid, num_tokens, seq_length):
        """The enabled load-balancing losses (coefficients included), summed: a 0-D tensor.
        ``out``: the router's statistics; ``num_tokens``: the valid tokens (an int, or a device
        count with a padding mask)."""
        total = None
        for kind, coeff in self.load_balancing.items():
            if kind == "aux_loss":
                counts, tokens = out.aux_tokens_per_expert, num_tokens
                if self._tp_size() > 1:  # the statistics of all the group's tokens
                    counts = _all_reduced(counts, self.tp_group)
                    tokens = tokens * self._tp_size() if valid is None else _all_reduced(
                        tokens, self.tp_group)  # fmt: skip
                loss = load_balancing_loss_from_sums(
                    out.scores_sum, counts, tokens, self.topk, self.num_experts, coeff
                )
            elif kind == "seq_aux_loss":  # per-sequence sums: from the per-token scores (aten)
                aux_map, scores = compute_routing_scores_for_aux_loss(
                    logits, self.topk, self.score_function
                )
                if valid is not None:
                    scores = scores * valid.unsqueeze(1).to(scores.dtype)
                    aux_map = aux_map & valid.unsqueeze(1)
                loss = sequence_load_balancing_loss_func(
                    scores, aux_map, seq_length, self.topk, coeff, self.tp_group
                )
            else:
                loss = self._global_aux_loss(out, logits.shape[0], coeff)
            self._track(kind, loss, coeff)
            total = loss if total is None else total + loss
        return total

    def _global_aux_loss(self, out: RouterOutput, num_tokens: int, coeff: float):
        group = self.aux_loss_group
        counts = out.aux_tokens_per_expert.float()
        size = 1
        if group is not None and dist.get_world_size(group) > 1:
            counts = _all_reduced(counts, group)
            size = dist.get_world_size(group)
        with torch.no_grad():
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
        average = self.global_tokens_per_expert / self.ga_steps
        return load_balancing_loss_from_sums(
            out.scores_sum, average, num_tokens * size, self.topk, self.num_experts, coeff
        )

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new averaging window for ``"global_aux_loss"`` (e.g. each optimizer step)."""
        if "global_aux_loss" in self.load_balancing:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def routing(
        self,
        logits: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        seq_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (and capacity) routing of ``[T, E]`` logits, with the auxiliary losses.

        ``padding_mask``: ``[T]`` bool, True = ignored token; ``seq_length``: ``s`` of a
        ``[s, b]`` token layout (``"seq_aux_loss"``; default ``T``, one sequence).

        One :func:`mtp.ops.moe_router` call (the fused kernel on CUDA) gives the probabilities,
        the map and the statistics of the losses; the losses are a few aten ops on ``[E]``
        tensors; capacity dropping follows in aten ops."""
        num_tokens = logits.shape[0]
        mask = None if padding_mask is None else padding_mask.reshape(-1)
        valid = None if mask is None else ~mask
        # plain attributes: set in __dict__ (nn.Module.__setattr__ looks for parameters first)
        self.__dict__["aux_loss"] = self.__dict__["z_loss"] = None
        losses = self._losses_enabled()
        balancing = self.load_balancing if losses else {}
        with_z = losses and self.z_loss_coeff > 0
        count = losses and self.enable_expert_bias
        out = moe_router(
            logits, self.topk, score_function=self.score_function, pre_softmax=self.pre_softmax,
            norm_topk_prob=self.norm_topk_prob, num_groups=self.num_groups,
            group_topk=self.group_topk, group_score=self.group_score,
            scaling_factor=self.scaling_factor, expert_bias=self.expert_bias, padding_mask=mask,
            aux_statistics=any(kind != "seq_aux_loss" for kind in balancing),
            z_statistics=with_z, routed_counts=count and self.capacity_factor is None,
            backend=self.backend,
        )  # fmt: skip
        probs, routing_map = out.probs, out.routing_map
        if self.capacity_factor is not None:
            routing_map = drop_to_capacity(probs, routing_map, self.topk, self.capacity_factor,
                                           self.drop_policy)  # fmt: skip
            probs = probs * routing_map
        valid_tokens = num_tokens if valid is None else valid.sum()
        if with_z:
            # Each rank of tp_group holds a share of the tokens: the mean over all of them is
            # the sum of the per-rank means divided by the group size.
            coeff = self.z_loss_coeff / self._tp_size()
            if valid is None:
                z_loss = out.lse_sq_sum * (coeff / max(num_tokens, 1))
            else:
                z_loss = out.lse_sq_sum * coeff / valid_tokens.clamp(min=1)
            probs = MoEAuxLossAutoScaler.apply(probs, z_loss)
            self.z_loss = z_loss.detach()
            self._track("z_loss", z_loss, self.z_loss_coeff)
        if balancing:
            aux_loss = self._load_balancing_losses(
                out, logits, valid, valid_tokens, seq_length or num_tokens
            )
            probs = MoEAuxLossAutoScaler.apply(probs, aux_loss)
            self.aux_loss = aux_loss.detach()
        if count:
            with torch.no_grad():
                if out.tokens_per_expert is not None:
                    self.local_tokens_per_expert += out.tokens_per_expert
                else:  # the tokens kept after dropping
                    counted = routing_map if valid is None else routing_map & valid.unsqueeze(1)
                    self.local_tokens_per_expert += counted.sum(dim=0)
        return probs, routing_map

    def forward(
        self, input: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if not input.is_floating_point():
            raise TypeError(
                f"input must be a floating-point tensor (the router's weight is "
                f"{self.weight.dtype}), got {input.dtype}"
            )
        if input.dim() < 1 or input.shape[-1] != self.hidden_size:
            raise ValueError(
                f"input must be [..., hidden_size={self.hidden_size}], got {tuple(input.shape)}"
            )
        if padding_mask is not None:
            if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
                raise TypeError("padding_mask must be a bool tensor (True = ignored token)")
            if tuple(padding_mask.shape) != tuple(input.shape[:-1]):
                raise ValueError(
                    f"padding_mask must have the input's leading shape {tuple(input.shape[:-1])},"
                    f" got {tuple(padding_mask.shape)}"
                )
        seq_length = input.shape[0] if input.dim() == 3 else None
        if "seq_aux_loss" in self.load_balancing and input.dim() != 3 and self.training:
            raise ValueError(
                "load_balancing_type 'seq_aux_loss' needs a [s, b, h] input (the sequences), got "
                f"{tuple(input.shape)}"
            )
        input = self.apply_input_jitter(input)
        return self.routing(self.gating(input), padding_mask, seq_length)

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


def _all_reduced(value: torch.Tensor, group) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value
