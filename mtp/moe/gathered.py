"""The MoE dispatch fused into the experts' first GEMM.

``P > 1`` expert-parallel ranks (:func:`gathers_received`, :func:`gathered_inputs`): the
experts read the received buffer through its expert-major reorder and fc2 writes its rows back
at their received positions (see :meth:`~mtp.moe.AllToAllTokenDispatcher.dispatch_received`);
no reordered copy either way. One rank, below:

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

__all__ = ["gathered_dispatch", "gathered_inputs", "gathers", "gathers_received"]


def gathers(layer, tokens: torch.Tensor) -> bool:
    """Whether :class:`~mtp.moe.MoELayer` ``layer`` runs its dispatch inside the experts' fc1
    for ``tokens``: one expert-parallel and expert-tensor-parallel rank, the all-to-all
    dispatcher on the Triton permute backend, and fused Triton experts that scale by the
    probability before fc2 (Megatron's order). FP8 experts gather too: their ``grouped_mlp``
    quantises the tokens once at their source rows and fc1 reads the FP8 rows through the
    row map (:mod:`mtp.ops.grouped_mlp_fp8`)."""
    return layer.ep_size == 1 and _fused_experts(layer, tokens)


def gathers_received(layer, tokens: torch.Tensor) -> bool:
    """Whether ``layer``'s experts read the rows an expert-parallel all-to-all delivered
    through their reorder index (``P > 1`` ranks, dropless or with a capacity, one
    expert-tensor-parallel rank, the experts as for :func:`gathers`) instead of a reordered
    copy. Not FP8 experts: their fused MLP has no row scatter (they take the reordered copy)."""
    return (layer.ep_size > 1 and getattr(layer.experts, "fp8_recipe", None) is None
            and _fused_experts(layer, tokens))  # fmt: skip


def _fused_experts(layer, tokens: torch.Tensor) -> bool:
    experts = layer.experts
    return (
        layer.etp_size == 1
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


def gathered_inputs(layer, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """``(x, tokens_per_expert, probs, gather_index, token_map, scatter_index, metadata)`` for
    ``layer.experts.forward_gathered`` (the rows read through ``gather_index``), or None where
    the layer dispatches a copy of the rows (see :func:`gathers`, :func:`gathers_received`).
    ``P > 1``: ``x`` is the received buffer (source-rank-major), ``probs`` its ``[R]``
    probabilities and ``gather_index`` its expert-major order, a permutation whose token map
    (:func:`~mtp.moe.ep_exchange.received_token_map`) makes fc1's data gradient a row gather;
    ``scatter_index`` the same order: fc2 writes each row back at its received position (the
    combine's reorder fused into fc2's store; its backward a row gather of the gradient)."""
    if gathers(layer, tokens):
        fused = gathered_dispatch(layer.token_dispatcher, tokens, probs, routing_map)
        if fused is None:
            return None
        counts, meta = fused
        return tokens, counts, probs, meta.preprocess.row_id_map, meta.token_map, None, meta
    if not gathers_received(layer, tokens):
        return None
    # (order and its map None where nothing was received: the empty rows were reordered)
    recv, counts, recv_probs, order, token_map, meta = layer.token_dispatcher.dispatch_received(
        tokens, probs, routing_map)
    return recv, counts, recv_probs, order, token_map, order, meta
