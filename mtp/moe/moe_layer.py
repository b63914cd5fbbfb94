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

import logging

import torch
import torch.distributed as dist
from torch import nn

from mtp.moe.experts import GroupedMLP
from mtp.moe.router import TopKRouter, check_routing_config
from mtp.moe.token_dispatcher import AllToAllTokenDispatcher
from mtp.moe.workspace import MoEWorkspace
from mtp.utils import is_capturing, is_fake

__all__ = ["MoELayer"]

logger = logging.getLogger("mtp")

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _resolve_groups(ep_group, expert_tensor_parallel_group):
    """The EP group to use, and the check that expert tensor parallelism is 1."""
    etp_size = _group_size(expert_tensor_parallel_group)
    if ep_group is None:
        from mtp import parallel

        if parallel.model_parallel_is_initialized():
            ep_group = parallel.get_expert_model_parallel_group()
            if expert_tensor_parallel_group is None:
                etp_size = parallel.get_expert_tensor_parallel_world_size()
    if etp_size > 1:
        raise ValueError(
            f"expert tensor parallelism is not supported by mtp.moe (expert tensor parallel size "
            f"{etp_size}): initialize the parallel groups with expert_tensor_parallel_size=1 "
            "(experts are split over expert_model_parallel_size ranks instead)"
        )
    if _group_size(ep_group) == 1:
        return None
    return ep_group


class MoELayer(nn.Module):
    """A mixture-of-experts MLP, expert-parallel over ``ep_group``.

    Args:
        hidden_size: ``H``.
        ffn_hidden_size: ``F``, each expert's intermediate size.
        num_experts: ``E``, all experts; rank ``r`` of the EP group holds
            ``[r * E / P, (r + 1) * E / P)``.
        topk: experts per token.
        ep_group: expert-parallel process group. None: the ``mtp.parallel`` expert group when
            :func:`mtp.parallel.initialize_model_parallel` ran, else a single rank.
        capacity_factor: None is dropless; else each expert keeps at most
            ``C = min(ceil(T * topk / E * capacity_factor), T)`` tokens (dropped by
            ``drop_policy`` in the router) in ``C`` fixed slots: static shapes, no host sync.
            Every EP rank must then see the same token count.
        activation: ``"gelu"`` or ``"swiglu"``.
        backend: kernels of the permutation, activation and grouped GEMMs (``"auto"``,
            ``"triton"``, ``"reference"``, or a grouped GEMM backend such as ``"sequential"``).
        bias: per-expert biases in the experts.
        score_function, pre_softmax, aux_loss_coeff, z_loss_coeff, expert_bias, drop_policy,
        num_groups, group_topk, scaling_factor, router_dtype: the router's
            (:class:`~mtp.moe.TopKRouter`).
        expert_tensor_parallel_group: must be None or of size 1 (expert tensor parallelism is
            rejected with a ``ValueError``; so is an initialised ``mtp.parallel`` state with
            ``expert_tensor_parallel_size > 1``).
        params_dtype, device: of the parameters.
        perform_initialization: initialise the weights: the router ``normal(0, 0.02)``, then the
            experts as ``nn.Linear`` pairs (see :meth:`GroupedMLP.reset_parameters`); every EP
            rank draws all ``E`` pairs and keeps its own, so from one seed the ranks hold the
            slices of the same single-process layer and stay in step for later layers.

    ``forward(hidden_states [..., H]) -> [..., H]`` (any leading dims: ``[s, b, h]``,
    ``[b, s, h]``, ``[T, h]``). The auxiliary losses ride on the autograd graph
    (``loss.backward()`` includes them, see :class:`~mtp.moe.MoEAuxLossAutoScaler`); their
    detached values are ``self.aux_loss`` and ``self.z_loss``. The workspace is built for the
    first input's token count and rebuilt (with an INFO log line) when it changes.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        ep_group: dist.ProcessGroup | None = None,
        capacity_factor: float | None = None,
        activation: str = "gelu",
        backend: str = "auto",
        bias: bool = False,
        score_function: str = "softmax",
        pre_softmax: bool = False,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        expert_bias: bool = False,
        drop_policy: str = "probs",
        num_groups: int | None = None,
        group_topk: int | None = None,
        scaling_factor: float | None = None,
        router_dtype: torch.dtype | None = None,
        expert_tensor_parallel_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        perform_initialization: bool = True,
    ) -> None:
        super().__init__()
        check_routing_config(
            num_experts, topk, score_function, capacity_factor, drop_policy, num_groups, group_topk
        )
        ep_group = _resolve_groups(ep_group, expert_tensor_parallel_group)
        ep_size = _group_size(ep_group)
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel size "
                f"{ep_size} (each rank holds num_experts / ep_size experts)"
            )
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.topk = num_experts, topk
        self.capacity_factor, self.backend = capacity_factor, backend
        self.ep_group, self.ep_size = ep_group, ep_size
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            topk,
            score_function=score_function,
            pre_softmax=pre_softmax,
            aux_loss_coeff=aux_loss_coeff,
            z_loss_coeff=z_loss_coeff,
            expert_bias=expert_bias,
            capacity_factor=capacity_factor,
            drop_policy=drop_policy,
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=scaling_factor,
            router_dtype=router_dtype,
            params_dtype=params_dtype,
            device=device,
        )
        self.token_dispatcher = AllToAllTokenDispatcher(
            ep_group, num_experts, topk, capacity_factor=capacity_factor, backend=backend
        )
        self.num_local_experts = num_experts // ep_size
        self.local_expert_indices = self.token_dispatcher.local_expert_indices
        self.experts = GroupedMLP(
            self.num_local_experts,
            hidden_size,
            ffn_hidden_size,
            activation=activation,
            bias=bias,
            backend=backend,
            params_dtype=params_dtype,
            device=device,
            perform_initialization=False,
        )
        if perform_initialization:
            self.experts.reset_parameters(self.local_expert_indices[0], num_experts)

    def extra_repr(self) -> str:
        mode = (
            "dropless"
            if self.capacity_factor is None
            else f"capacity_factor={self.capacity_factor}"
        )
        return (
            f"num_experts={self.num_experts}, topk={self.topk}, ep_size={self.ep_size}, "
            f"local_experts={self.local_expert_indices[0]}..{self.local_expert_indices[-1]}, "
            f"{mode}, backend={self.backend!r}"
        )

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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [..., hidden_size={self.hidden_size}], got {tuple(x.shape)}"
            )
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"hidden_states must be float32/float16/bfloat16, got {x.dtype}")
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        probs, routing_map = self.router(tokens)
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch(
            tokens, probs, routing_map
        )
        expert_output = self.experts(dispatched, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.combine(expert_output)
        ws = self.token_dispatcher.workspace
        if (
            is_capturing()
            and ws is not None
            and ws.num_tokens == tokens.shape[0]
            and not is_fake(output)
        ):
            return _IntoStatic.apply(output, ws.static_output(), shape)
        return output.view(shape)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a single-process layer's ``state_dict`` (all ``E`` experts): this rank takes the
        router and its own experts' slices. Returns ``load_state_dict``'s result."""
        first, local = self.local_expert_indices[0], self.num_local_experts
        own = {}
        for key, value in state_dict.items():
            if key.startswith("experts."):
                if value.shape[0] != self.num_experts:
                    raise ValueError(
                        f"{key}: expected {self.num_experts} experts in dim 0, got "
                        f"{tuple(value.shape)}"
                    )
                value = value[first : first + local]
            own[key] = value
        return self.load_state_dict(own, strict=strict)
