"""The MoE dispatch fused into the experts' first GEMM (one expert-parallel rank).

Where the experts run :func:`mtp.ops.grouped_mlp` on the Triton backend, the layer need not
write a permuted copy of its tokens: :func:`gathered_dispatch` builds the row map (one launch:
the row of each (token, expert) pair, the per-expert counts and the token-major map) and the
experts' fc1 reads its rows, and their ``[T, E]`` probabilities, through it
(``grouped_mlp(..., gather_index=row_id_map, token_map=...)``). The combine is the dispatcher's
usual one (:func:`mtp.ops.unpermute` over the token map: a fixed-order, weighted-free sum of
each token's rows, the probabilities being applied in fc1's epilogue).

Forward: router, row map, fc1, fc2, combine. Backward: the combine's gather, fc2's data
gradient (with the activation's backward, the probability partials and fc1's output rewritten
for fc2's weight gradient), the two weight gradients, fc1's data gradient, one token-major sum of
the rows' gradients (with the ``[T, E]`` probability gradient), the router's backward.
Nothing is read on the host: graph-safe with or without a capacity.
"""

from __future__ import annotations

import torch

from mtp.moe.comm import permute_backend
from mtp.moe.dispatcher_base import AllToAllDispatchMetadata
from mtp.moe.preprocess import check_routing, local_preprocess_with_map, store_preprocess
from mtp.utils import is_capturing

__all__ = ["gathered_dispatch", "gathers"]


def gathers(layer, tokens: torch.Tensor) -> bool:
    """Whether :class:`~mtp.moe.MoELayer` ``layer`` runs its dispatch inside the experts' fc1
    for ``tokens``: one expert-parallel and expert-tensor-parallel rank, the all-to-all
    dispatcher on the Triton permute backend, and fused Triton experts that scale by the
    probability before fc2 (Megatron's order). FP8 experts gather too: their ``grouped_mlp``
    quantises the tokens once at their source rows and fc1 reads the FP8 rows through the
    row map (:mod:`mtp.ops.grouped_mlp_fp8`)."""
    experts = layer.experts
    return (
        layer.ep_size == 1
        and layer.etp_size == 1
        and layer.token_dispatcher_type == "alltoall"
        and not experts.probs_after_fc2
        and experts._fused(tokens)
        and permute_backend(layer.backend, tokens.device) == "triton"
    )


def gathered_dispatch(dispatcher, hidden_states: torch.Tensor, probs: torch.Tensor,
                      routing_map: torch.Tensor):  # fmt: skip
    """``(tokens_per_expert [E] int64, metadata)`` of a dispatch whose rows the experts read
    through ``metadata.preprocess.row_id_map`` and ``metadata.token_map`` (see the module doc);
    None when the row map has no token map (not the Triton backend). ``metadata`` goes to the
    dispatcher's ``combine`` as a plain dispatch's does."""
    num_tokens, hidden = hidden_states.shape
    ws = dispatcher._workspace_for(hidden_states, probs)
    check_routing(routing_map, probs, ws, validate=False)
    backend = permute_backend(dispatcher.backend, hidden_states.device)
    res, token_map = local_preprocess_with_map(routing_map, probs, ws, backend, fused=True)
    if token_map is None or res.permuted_probs is not None:
        return None
    if is_capturing():  # a graph replays into the workspace's fixed addresses
        store_preprocess(res, ws)
    meta = AllToAllDispatchMetadata(ws, res, backend, num_tokens, hidden, token_map)
    return res.tokens_per_expert, meta
