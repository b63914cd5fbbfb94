"""Mixture-of-experts layers with expert parallelism and a graph-safe, fixed-address preprocess.

- :class:`TopKRouter`: top-k routing with Megatron-Core semantics, load-balancing and z-losses
  on the device (attached to the autograd graph by :class:`MoEAuxLossAutoScaler`), capacity
  dropping and aux-loss-free expert bias.
- :class:`MoEWorkspace`: every buffer of the preprocess and dispatch, allocated once.
- :func:`preprocess`: counts, row map, permuted probs and EP split sizes into the workspace;
  static shapes, no host sync.
- :class:`GroupedMLP`: the local experts as two grouped GEMMs.
- :class:`AllToAllTokenDispatcher`: dispatch/combine over the expert-parallel group (and the
  expert-tensor-parallel group); :class:`AllGatherTokenDispatcher`: the all-gather variant.
- :class:`SharedExpertMLP`: the dense shared expert (optional sigmoid gate).
- :mod:`mtp.moe.hf_weights`: Hugging Face expert weights <-> :class:`GroupedMLP`.
- :class:`MoELayer`: all of the above as one module, configured by a :class:`MoEConfig`
  (:class:`RouterConfig`, :class:`ExpertsConfig`, :class:`DispatcherConfig`) and given its
  groups as a :class:`mtp.parallel.ParallelDims` (or the flat keyword form).
"""

from mtp.moe.allgather_dispatcher import AllGatherDispatchMetadata, AllGatherTokenDispatcher
from mtp.moe.config import DispatcherConfig, ExpertsConfig, MoEConfig, RouterConfig
from mtp.moe.dispatcher_base import AllToAllDispatchMetadata
from mtp.moe.experts import GroupedMLP, activation_function, clamped_swiglu
from mtp.moe.hf_weights import grouped_to_hf, hf_to_grouped
from mtp.moe.load_balancing import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    save_to_aux_losses_tracker,
    sequence_load_balancing_loss_func,
    track_moe_metrics,
)
from mtp.moe.moe_layer import MoELayer
from mtp.moe.preprocess import MoEPreprocessResult, preprocess
from mtp.moe.router import (
    MoEAuxLossAutoScaler,
    TopKRouter,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    get_updated_expert_bias,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from mtp.moe.shared_experts import SharedExpertMLP
from mtp.moe.token_dispatcher import AllToAllTokenDispatcher
from mtp.parallel.errors import RankMismatchError
from mtp.moe.workspace import MoEWorkspace, WorkspaceMismatchError

__all__ = [
    "AllGatherDispatchMetadata",
    "AllGatherTokenDispatcher",
    "AllToAllDispatchMetadata",
    "DispatcherConfig",
    "ExpertsConfig",
    "MoEConfig",
    "RouterConfig",
    "AllToAllTokenDispatcher",
    "RankMismatchError",
    "SharedExpertMLP",
    "activation_function",
    "clamped_swiglu",
    "clear_aux_losses_tracker",
    "get_moe_layer_wise_logging_tracker",
    "grouped_to_hf",
    "hf_to_grouped",
    "save_to_aux_losses_tracker",
    "sequence_load_balancing_loss_func",
    "track_moe_metrics",
    "GroupedMLP",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoEPreprocessResult",
    "MoEWorkspace",
    "TopKRouter",
    "WorkspaceMismatchError",
    "compute_routing_scores_for_aux_loss",
    "get_capacity",
    "get_updated_expert_bias",
    "preprocess",
    "switch_load_balancing_loss_func",
    "topk_softmax_with_capacity",
    "z_loss_func",
]
