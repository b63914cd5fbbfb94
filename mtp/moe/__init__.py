"""Mixture-of-experts layers with expert parallelism and a graph-safe, fixed-address preprocess.

- :class:`TopKRouter`: top-k routing with Megatron-Core semantics, load-balancing and z-losses
  on the device (attached to the autograd graph by :class:`MoEAuxLossAutoScaler`), capacity
  dropping and aux-loss-free expert bias.
- :class:`MoEWorkspace`: every buffer of the preprocess and dispatch, allocated once.
- :func:`preprocess`: counts, row map, permuted probs and EP split sizes into the workspace;
  static shapes, no host sync.
- :class:`GroupedMLP`: the local experts as two grouped GEMMs.
- :class:`AllToAllTokenDispatcher`: dispatch/combine over the expert-parallel group.
- :class:`MoELayer`: all of the above as one module.
"""

from mtp.moe.experts import GroupedMLP
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
from mtp.moe.token_dispatcher import AllToAllTokenDispatcher
from mtp.moe.workspace import MoEWorkspace, WorkspaceMismatchError

__all__ = [
    "AllToAllTokenDispatcher",
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
