"""The mixture-of-experts layer: :class:`MoELayer` (router -> preprocess -> dispatch -> experts
-> combine), a drop-in replacement for a transformer block's MLP.

Graph safety: with one expert-parallel rank, or with a ``capacity_factor`` (any number of
ranks), the whole forward (routing, auxiliary losses, preprocess, permutation, the all-to-alls,
the grouped GEMMs, the combine) has static shapes and no host synchronisation when the grouped
GEMM reads its counts on the device (``backend="auto"``: triton on CUDA, torch's grouped_mm on
the CPU; ``"triton"``; ``"torch"``; not the per-expert loop backends): one CUDA
graph can capture the layer, where Megatron-Core's partial capture has to stop before the
dispatch (``moe_preprocess``) and run the rest eagerly. While a graph is captured (real, or
simulated by :func:`mtp.testing.assert_graph_safe`) the output is written into the workspace's
``output`` buffer, so it has a fixed address like every other buffer of the layer. Dropless with
more than one rank synchronises once per layer (the split sizes of the token all-to-all, see
:mod:`mtp.moe.token_dispatcher`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mtp.dtypes import dtype_name
from mtp.moe.allgather_dispatcher import AllGatherTokenDispatcher
from mtp.moe._checks import check_group
from mtp.moe.config import MoEConfig
from mtp.moe.experts import GroupedMLP
from mtp.moe.gathered import gathered_inputs, gathers, gathers_received
from mtp.moe.router import TopKRouter
from mtp.moe.shared_experts import SharedExpertMLP
from mtp.moe.token_dispatcher import AllToAllTokenDispatcher
from mtp.moe.workspace import MoEWorkspace
from mtp.parallel import parallel_state
from mtp.parallel.dims import ParallelDims
from mtp.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    split_along,
)
from mtp.utils import is_capturing, is_fake

__all__ = ["MoELayer"]

logger = logging.getLogger("mtp")

from mtp.dtypes import KERNEL_FLOATS as _FLOAT_DTYPES  # noqa: E402
_DISPATCHERS = {"alltoall": AllToAllTokenDispatcher, "allgather": AllGatherTokenDispatcher}


class _IntoStatic(torch.autograd.Function):
    """Copy ``y`` into the fixed ``buffer`` and return a view of it (the graph's static output);
    the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, y, buffer, shape):
        buffer.copy_(y)
        return buffer.view(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(-1, grad.shape[-1]), None, None


def _resolve_dims(ep_group, expert_tensor_parallel_group, tp_group) -> ParallelDims:
    """The layer's groups from the flat arguments. With ``ep_group=None`` and an initialised
    ``mtp.parallel`` state, the groups not given come from it (Megatron's defaults:
    ``expert_tensor_parallel_size`` = tp unless set)."""
    for name, group in (
        ("ep_group", ep_group),
        ("expert_tensor_parallel_group", expert_tensor_parallel_group),
        ("tp_group", tp_group),
    ):
        check_group(name, group)
    if ep_group is None and parallel_state.model_parallel_is_initialized():
        ep_group = parallel_state.get_expert_model_parallel_group()
        if expert_tensor_parallel_group is None:
            expert_tensor_parallel_group = parallel_state.get_expert_tensor_parallel_group()
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
    return ParallelDims(tp_group=tp_group, ep_group=ep_group,
                        etp_group=expert_tensor_parallel_group)  # fmt: skip


class MoELayer(nn.Module):
    """A mixture-of-experts MLP, expert-parallel over ``ep_group``, optionally with expert
    tensor parallelism, tensor/sequence parallelism and a shared expert.

    Two ways to build it: ``MoELayer(config=MoEConfig(...), dims=ParallelDims(...))`` (the
    nested :class:`~mtp.moe.config.MoEConfig`, each part checked where it is made, and the groups
    as one :class:`~mtp.parallel.dims.ParallelDims`), or the flat form below, which builds both
    (:meth:`MoEConfig.from_flat`; ``self.config`` and ``self.dims`` hold them either way).

    Args:
        hidden_size: ``H``.
        ffn_hidden_size: ``F``, each expert's intermediate size.
        num_experts: ``E``, all experts; rank ``r`` of the EP group holds
            ``[r * E / P, (r + 1) * E / P)``.
        topk: experts per token.
        ep_group: expert-parallel process group. None: the ``mtp.parallel`` expert group when
            :func:`mtp.parallel.initialize_model_parallel` ran (and then the expert-TP and TP
            groups default to ``mtp.parallel``'s too), else a single rank.
        expert_tensor_parallel_group: expert tensor parallelism (``Q`` ranks): each holds
            ``F / Q`` of every local expert's features (``fc1`` column-, ``fc2`` row-parallel);
            the dispatcher all-gathers the rows over the group and reduce-scatters the partial
            outputs. ``mtp.parallel``'s default is ``expert_tensor_parallel_size = tp``.
        tp_group: the dense tensor-parallel group (Megatron's TP x EP): the ranks of the group
            route disjoint tokens (sequence parallel), the router and shared expert are
            replicated there and their gradients summed over it in the backward.
        sequence_parallel: with ``tp_group``: True when the input already is this rank's
            sequence chunk (``[s / tp, b, h]``, Megatron's sequence parallelism; the output is
            too); False (default) when every TP rank holds the same ``[..., H]`` input: the layer
            keeps a ``1 / tp`` share of the tokens (the flattened token count must divide by
            ``tp``), and all-gathers the output.
        capacity_factor: None is dropless; else each expert keeps at most
            ``C = min(ceil(T * topk / E * capacity_factor), T)`` tokens (dropped by
            ``drop_policy`` in the router) in ``C`` fixed slots: static shapes, no host sync.
            Every EP rank must then see the same token count.
        activation: ``"gelu"``, ``"swiglu"``, ``"clamped_swiglu"`` (GPT-OSS) or ``"relu2"``;
            ``activation_limit``/``activation_alpha`` for ``"clamped_swiglu"``.
        probs_after_fc2: scale the expert output after ``fc2`` and its bias (GPT-OSS / Hugging
            Face) instead of before ``fc2`` (Megatron), see :class:`~mtp.moe.GroupedMLP`.
        gradient_accumulation_fusion: the experts' weight gradients go straight into their fp32
            ``main_grad`` (see :class:`~mtp.moe.GroupedMLP`).
        bias_activation_fusion: on the ``triton`` backend, the experts' bias, activation and
            probability scaling run in the grouped GEMMs' epilogues, forward and backward (see
            :class:`~mtp.moe.GroupedMLP`); False keeps them as separate kernels.
        fp8_recipe: None, ``"blockwise"`` or ``"mxfp8"`` (or an :class:`~mtp.ops.Fp8Recipe`):
            the routed experts' grouped GEMMs in FP8, master weights and gradients in
            ``params_dtype`` (see :class:`~mtp.moe.GroupedMLP`; :meth:`set_fp8_recipe`).
        backend: kernels of the router, the permutation, activation and grouped GEMMs
            (``"auto"``, ``"triton"``, ``"reference"``, or a grouped GEMM backend such as
            ``"sequential"``; the router and the permutation take such a name as ``"auto"``).
        bias: per-expert biases in the experts.
        token_dispatcher_type: ``"alltoall"`` (Megatron's default) or ``"allgather"``
            (:class:`~mtp.moe.AllGatherTokenDispatcher`: every rank gathers all tokens and
            keeps its experts' rows; static shapes; for small EP).
        shared_expert_intermediate_size: adds a :class:`~mtp.moe.SharedExpertMLP` of this
            size (same activation) that every token goes through; ``shared_expert_gate``: its
            output is scaled by ``sigmoid(x @ gate_weight.T)`` (Qwen2-MoE). It runs after the
            dispatch is issued and before the routed experts.
        score_function, pre_softmax, norm_topk_prob, aux_loss_coeff, load_balancing_type,
        z_loss_coeff, expert_bias, router_bias, drop_policy, num_groups, group_topk,
        group_score, scaling_factor, input_jitter_eps, router_dtype, layer_number, num_layers:
            the router's (:class:`~mtp.moe.TopKRouter`).
        check_ranks: the dispatcher's rank-agreement check (see
            :class:`~mtp.moe.AllToAllTokenDispatcher`).
        params_dtype, device: of the parameters.
        perform_initialization: initialise the weights: the router ``normal(0, 0.02)``, then the
            experts as ``nn.Linear`` pairs (see :meth:`GroupedMLP.reset_parameters`); every EP
            rank draws all ``E`` pairs and keeps its own slice (and expert-TP shard), so from one
            seed the ranks hold the slices of the same single-process layer; then the shared
            expert.

    ``forward(hidden_states [..., H], padding_mask=None) -> [..., H]`` (any leading dims:
    ``[s, b, h]``, ``[b, s, h]``, ``[T, h]``; ``padding_mask``: see the router). The auxiliary
    losses ride on the autograd graph (``loss.backward()`` includes them, see
    :class:`~mtp.moe.MoEAuxLossAutoScaler`); their detached values are ``self.aux_loss`` and
    ``self.z_loss``. The workspace is built for the first input's token count and rebuilt (with
    an INFO log line) when it changes.

    Gradients: each rank's parameter gradients are those of its own tokens; the usual
    data-parallel reduction completes them (dense parameters: router, shared expert, over the
    data-parallel group; expert parameters, marked ``allreduce = False``, over the
    expert-data-parallel group). Nothing is scaled by hand.
    """

    def __init__(
        self,
        hidden_size: int | MoEConfig | None = None,
        ffn_hidden_size: int | None = None,
        num_experts: int | None = None,
        topk: int | None = None,
        *,
        config: MoEConfig | None = None,
        dims: ParallelDims | None = None,
        ep_group: dist.ProcessGroup | None = None,
        expert_tensor_parallel_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        **flat: Any,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, MoEConfig):
            config, hidden_size = hidden_size, None
        if config is None:
            config = MoEConfig.from_flat(hidden_size, ffn_hidden_size, num_experts, topk, **flat)
        elif not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        elif any(v is not None for v in (hidden_size, ffn_hidden_size, num_experts, topk)) or flat:
            raise TypeError("MoELayer: pass either config= or the flat arguments, not both")
        if dims is None:
            dims = _resolve_dims(ep_group, expert_tensor_parallel_group, tp_group)
        elif not isinstance(dims, ParallelDims):
            raise TypeError(f"dims must be a ParallelDims, got {type(dims).__name__}")
        elif any(g is not None for g in (ep_group, expert_tensor_parallel_group, tp_group)):
            raise TypeError("MoELayer: pass the groups in dims= or as arguments, not both")
        c, e = config, config.experts
        if c.num_experts % dims.ep:
            raise ValueError(
                f"num_experts={c.num_experts} must be divisible by the expert-parallel size "
                f"{dims.ep} (each rank holds num_experts / ep_size experts)"
            )
        if e.ffn_hidden_size % dims.etp:
            raise ValueError(
                f"ffn_hidden_size={e.ffn_hidden_size} must be divisible by the expert tensor "
                f"parallel size {dims.etp}"
            )
        self.config, self.dims = config, dims
        self.hidden_size, self.ffn_hidden_size = c.hidden_size, e.ffn_hidden_size
        self.num_experts, self.topk = c.num_experts, c.topk
        self.capacity_factor, self.backend = c.dispatcher.capacity_factor, e.backend
        self.ep_group, self.ep_size = dims.ep_group, dims.ep
        self.etp_group, self.etp_size = dims.etp_group, dims.etp
        self.tp_group, self.tp_size = dims.tp_group, dims.tp
        self.sequence_parallel = c.sequence_parallel
        self.token_dispatcher_type = c.dispatcher.token_dispatcher_type
        factory = dict(params_dtype=c.params_dtype, device=c.device)
        self.router = TopKRouter(c.hidden_size, config=c.router, tp_group=dims.tp_group, **factory)
        kind = _DISPATCHERS[self.token_dispatcher_type]
        self.token_dispatcher = kind(c.dispatcher, dims)
        self.num_local_experts = c.num_experts // dims.ep
        self.local_expert_indices = self.token_dispatcher.local_expert_indices
        self.experts = GroupedMLP(
            self.num_local_experts, c.hidden_size, e.ffn_hidden_size,
            **{f.name: getattr(e, f.name) for f in dataclasses.fields(e)
               if f.name != "ffn_hidden_size"},
            tp_size=dims.etp, tp_rank=dims.etp_rank, perform_initialization=False,
            expert_offset=self.local_expert_indices[0], **factory,
        )  # fmt: skip
        if c.perform_initialization:
            self.experts.reset_parameters(self.local_expert_indices[0], c.num_experts)
        self.shared_experts = None
        if c.shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(
                c.hidden_size, c.shared_expert_intermediate_size, activation=e.activation,
                gate=c.shared_expert_gate, tp_group=dims.tp_group, **factory,
            )  # fmt: skip

    def extra_repr(self) -> str:
        mode = (
            "dropless"
            if self.capacity_factor is None
            else f"capacity_factor={self.capacity_factor}"
        )
        return (
            f"num_experts={self.num_experts}, topk={self.topk}, ep_size={self.ep_size}, "
            f"etp_size={self.etp_size}, tp_size={self.tp_size}, "
            f"local_experts={self.local_expert_indices[0]}..{self.local_expert_indices[-1]}, "
            f"{mode}, dispatcher={self.token_dispatcher_type!r}, backend={self.backend!r}"
        )

    def set_fp8_recipe(self, fp8_recipe) -> None:
        """The routed experts' ``fp8_recipe`` from now on (see :class:`~mtp.moe.GroupedMLP`;
        ``self.config`` follows)."""
        self.experts.set_fp8_recipe(fp8_recipe)
        self.config = dataclasses.replace(self.config, experts=self.experts.config)

    @property
    def workspace(self) -> MoEWorkspace | None:
        """The dispatcher's workspace (None before the first forward)."""
        return self.token_dispatcher.workspace

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Load-balancing loss of the last training forward (coefficient included, detached)."""
        return self.router.aux_loss

    @property
    def z_loss(self) -> torch.Tensor | None:
        """Router z-loss of the last training forward (coefficient included, detached)."""
        return self.router.z_loss

    def _check_inputs(self, x, padding_mask) -> None:
        """Types, shapes and dtypes of ``forward``'s arguments (free: no device work). As
        ``nn.Linear``, the input's dtype must be the parameters' unless autocast is on."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [..., hidden_size={self.hidden_size}], got {tuple(x.shape)}"
            )
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"hidden_states must be float32/float16/bfloat16, got {x.dtype}")
        params = self.experts.weight1.dtype
        if x.dtype != params and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"hidden_states is {dtype_name(x.dtype)} but the layer's parameters are "
                f"{dtype_name(params)}; call layer.to(torch.{dtype_name(x.dtype)}) or cast the "
                f"input (hidden_states.to(torch.{dtype_name(params)})), or run under torch.autocast"
            )
        if padding_mask is None:
            return
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
            got = getattr(padding_mask, "dtype", type(padding_mask).__name__)
            raise TypeError(f"padding_mask must be a bool tensor (True = ignored token), got {got}")
        if padding_mask.shape != x.shape[:-1]:
            raise ValueError(
                f"padding_mask must have hidden_states' leading shape {tuple(x.shape[:-1])} "
                f"(one flag per token), got {tuple(padding_mask.shape)}"
            )

    def forward(
        self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = hidden_states
        self._check_inputs(x, padding_mask)
        shape = x.shape
        split = self.tp_size > 1 and not self.sequence_parallel
        if split and padding_mask is not None:
            padding_mask = split_along(padding_mask.reshape(-1), 0, self.tp_group)
        if split:
            tokens = x.reshape(-1, self.hidden_size)
            if tokens.shape[0] % self.tp_size:
                raise ValueError(
                    f"hidden_states has {tokens.shape[0]} tokens, not divisible by the tensor "
                    f"parallel size {self.tp_size} (sequence_parallel=False splits the tokens "
                    "over the TP ranks)"
                )
            tokens = scatter_to_sequence_parallel_region(tokens, self.tp_group)
            router_in = tokens
            if x.dim() == 3 and x.shape[0] % self.tp_size == 0:  # [s/tp, b, h] for seq_aux_loss
                router_in = tokens.view(x.shape[0] // self.tp_size, x.shape[1], x.shape[2])
        else:
            tokens = x.reshape(-1, self.hidden_size)
            router_in = x
        if padding_mask is not None and padding_mask.shape != router_in.shape[:-1]:
            padding_mask = padding_mask.reshape(router_in.shape[:-1])  # this rank's share
        probs, routing_map = self.router(router_in, padding_mask)
        output = self._experts(tokens, probs, routing_map)
        if split:
            output = gather_from_sequence_parallel_region(
                output, tensor_parallel_output_grad=False, group=self.tp_group
            )
        ws = self.token_dispatcher.workspace
        if (
            is_capturing()
            and ws is not None
            and ws.num_tokens == tokens.shape[0]
            and output.shape[0] == tokens.shape[0]
            and not is_fake(output)
        ):
            return _IntoStatic.apply(output, ws.static_output(), shape)
        return output.view(shape)

    def _experts(self, tokens, probs, routing_map) -> torch.Tensor:
        """Dispatch, the shared and the routed experts, combine: ``[T, H]``. The experts read
        their rows through the row map where they can (:mod:`mtp.moe.gathered`), else from
        the dispatched copy."""
        fused = None
        if gathers(self, tokens) or gathers_received(self, tokens):
            fused = gathered_inputs(self, tokens, probs, routing_map)
        if fused is not None:
            *rows, meta = fused
            shared = None if self.shared_experts is None else self.shared_experts(tokens)
            expert_output = self.experts.forward_gathered(*rows)
        else:
            dispatched, tokens_per_expert, permuted_probs, meta = self.token_dispatcher.dispatch(
                tokens, probs, routing_map
            )
            shared = None if self.shared_experts is None else self.shared_experts(tokens)
            expert_output = self.experts(dispatched, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.combine(expert_output, meta)
        return output if shared is None else output + shared

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a single-process layer's ``state_dict`` (all ``E`` experts, unsharded): this rank
        takes the router, the shared expert and its own experts' slices (and expert-TP shards).
        Returns ``load_state_dict``'s result for the non-expert part."""
        prefix = "experts."
        experts = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        own = {k: v for k, v in state_dict.items() if not k.startswith("experts.")}
        for key, value in experts.items():
            if value.shape[0] != self.num_experts:
                raise ValueError(
                    f"experts.{key}: expected {self.num_experts} experts in dim 0, got "
                    f"{tuple(value.shape)}"
                )
        if "weight1" not in experts or "weight2" not in experts:
            if strict:
                raise ValueError("state_dict lacks experts.weight1 / experts.weight2")
        else:
            self.experts.load_full_weights(
                experts["weight1"], experts["weight2"], experts.get("bias1"), experts.get("bias2"),
                expert_offset=self.local_expert_indices[0],
            )
        result = self.load_state_dict(own, strict=False)
        missing = [k for k in result.missing_keys if not k.startswith("experts.")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"load_full_state_dict: missing keys {missing}, unexpected keys "
                f"{result.unexpected_keys}"
            )
        return result
