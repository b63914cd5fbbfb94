"""Partial capture of a MoE transformer block: the graph-safe head of the block is a graph, the
dynamic rest runs eagerly (Megatron-Core's ``cuda_graph_scope``).

Scopes (what the graph holds):

- ``"attn"``: the attention part; the MoE MLP runs eagerly.
- ``"moe_router"``: attention and the router (probabilities, routing map, auxiliary losses);
  the dispatch, the experts and the combine run eagerly.
- ``"moe_preprocess"``: attention, router and the dispatcher's graph-safe local preprocess
  (:meth:`~mtp.moe.AllToAllTokenDispatcher.dispatch_preprocess`: counts, row map, permuted
  probabilities into the fixed-address workspace, and the permuted rows); the token dispatch
  (dropless ``P > 1``: the count exchange, its host sync and the all-to-all), the experts and
  the combine run eagerly.
- ``"full"``: the whole block; only where the MoE layer is graph-safe (one expert-parallel rank,
  or a ``capacity_factor``: static shapes, no host sync).

Protocol. While capturing (:func:`capturing_scope`), the block raises a
:class:`PartialCaptureSignal` at the scope boundary carrying the tensors computed so far, by
name; the captured callable (:meth:`PartialMoEBlock.captured_part`) catches it and returns them,
so they become the graph's static outputs (with the router's logged ``aux_loss`` / ``z_loss``
when the scope holds the router). At replay :meth:`PartialMoEBlock.forward` replays the graph,
puts its outputs in the block's :class:`TensorStore` (the dispatcher's preprocess state through
:meth:`~mtp.moe.AllToAllTokenDispatcher.restore_preprocess`, the losses back on the router), and
runs the block again: every step whose result is in the store is skipped, the rest runs eagerly
on the stored tensors (which carry the graph's autograd node, so the backward graph runs too).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .capture import GraphedLayer, make_graphed_callables

__all__ = [
    "SCOPES",
    "PartialCaptureSignal",
    "TensorStore",
    "capturing_scope",
    "PartialMoEBlock",
    "capture_blocks",
]

SCOPES = ("attn", "moe_router", "moe_preprocess", "full")
_ROUTER_SCOPES = ("moe_router", "moe_preprocess", "full")
_PRE = "preprocess."  # store prefix of the dispatcher's preprocess tensors
_state = threading.local()


class PartialCaptureSignal(Exception):
    """Raised at the scope boundary during capture; ``outputs`` are the graph's outputs and
    ``names`` their tensor-store names."""

    def __init__(self, scope: str, outputs: dict[str, torch.Tensor]) -> None:
        super().__init__(scope)
        self.scope, self.names, self.outputs = scope, tuple(outputs), tuple(outputs.values())


class TensorStore:
    """Tensors a replayed graph produced, read by the eager rest of the block."""

    def __init__(self) -> None:
        self._data: dict[str, torch.Tensor] = {}

    def set(self, **tensors: torch.Tensor) -> None:
        self._data.update(tensors)

    def get(self, name: str) -> torch.Tensor | None:
        return self._data.get(name)

    def is_empty(self) -> bool:
        return not self._data

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors whose names start with ``prefix``, by the rest of their names."""
        return {k[len(prefix):]: v for k, v in self._data.items() if k.startswith(prefix)}

    def clear(self) -> None:
        self._data.clear()


@contextlib.contextmanager
def capturing_scope(scope: str) -> Iterator[None]:
    """Blocks run inside this context stop at ``scope``'s boundary with a signal."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    previous = getattr(_state, "scope", None)
    _state.scope = scope
    try:
        yield
    finally:
        _state.scope = previous


def _capture_scope() -> str | None:
    return getattr(_state, "scope", None)


def _check_moe(moe, scope: str) -> None:
    if scope == "moe_preprocess" and not hasattr(moe.token_dispatcher, "dispatch_preprocess"):
        raise ValueError(
            "scope='moe_preprocess' needs a dispatcher with dispatch_preprocess() / "
            f"token_dispatch() (token_dispatcher_type='alltoall'), got "
            f"{type(moe.token_dispatcher).__name__}; use scope='moe_router'"
        )
    if scope == "full" and getattr(moe, "ep_size", 1) > 1 and moe.capacity_factor is None:
        raise ValueError(
            "scope='full' captures the whole MoE layer, which is graph-safe only with one "
            "expert-parallel rank or a capacity_factor (dropless EP reads split sizes on the "
            "host); use scope='moe_router' or 'attn'"
        )


class PartialMoEBlock(nn.Module):
    """``out = h + moe(h)`` with ``h = attn(x)`` (``attn`` includes its own residual; None: the
    identity), capturable per :data:`SCOPES`.

    Args:
        attn: a module ``[..., H] -> [..., H]`` or None.
        moe: a :class:`mtp.moe.MoELayer` (used through its ``router``, ``token_dispatcher`` and
            ``experts``).
        scope: one of :data:`SCOPES`.

    After :func:`capture_blocks`, ``forward`` replays the captured part (``self.graphed``) and
    runs the rest eagerly; before, it is the eager block.
    """

    def __init__(self, attn: nn.Module | None, moe: nn.Module, scope: str = "moe_router"):
        super().__init__()
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        _check_moe(moe, scope)
        self.attn, self.moe, self.scope = attn, moe, scope
        self.tensor_store = TensorStore()
        self.graphed: GraphedLayer | None = None
        self._output_names: tuple[str, ...] = ()

    # The steps; each is skipped when the store holds its result.
    def _attention(self, x):
        h = self.tensor_store.get("hidden")
        if h is None:
            h = x if self.attn is None else self.attn(x)
        if _capture_scope() == "attn":
            raise PartialCaptureSignal("attn", {"hidden": h})
        return h

    def _route(self, h):
        probs = self.tensor_store.get("probs")
        if probs is None:
            probs, routing_map = self.moe.router(h.reshape(-1, h.shape[-1]))
        else:
            routing_map = self.tensor_store.get("routing_map")
        if _capture_scope() == "moe_router":
            raise PartialCaptureSignal(
                "moe_router", {"hidden": h, "probs": probs, "routing_map": routing_map}
            )
        return probs, routing_map

    def _dispatch_preprocess(self, h, tokens):
        dispatcher = self.moe.token_dispatcher
        store = self.tensor_store
        permuted = store.get("permuted_tokens")
        if permuted is not None:  # replay: the graph's preprocess back into a metadata object
            permuted_probs = store.get("permuted_probs")
            meta = dispatcher.restore_preprocess(
                tokens.shape[0], permuted, permuted_probs, store.with_prefix(_PRE)
            )
            return permuted, permuted_probs, meta
        probs, routing_map = self._route(h)
        permuted, permuted_probs, meta = dispatcher.dispatch_preprocess(
            tokens, probs, routing_map
        )
        if _capture_scope() == "moe_preprocess":
            outputs = {"hidden": h, "permuted_tokens": permuted, "permuted_probs": permuted_probs}
            for name, t in dispatcher.preprocess_tensors(meta).items():
                outputs[_PRE + name] = t
            raise PartialCaptureSignal("moe_preprocess", outputs)
        return permuted, permuted_probs, meta

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block from wherever the store leaves off (all of it when the store is empty)."""
        h = self._attention(x)
        tokens = h.reshape(-1, h.shape[-1])
        dispatcher = self.moe.token_dispatcher
        if hasattr(dispatcher, "dispatch_preprocess"):
            dispatched, tokens_per_expert, probs, meta = dispatcher.token_dispatch(
                *self._dispatch_preprocess(h, tokens)
            )
        else:
            dispatched, tokens_per_expert, probs, meta = dispatcher.dispatch(
                tokens, *self._route(h)
            )
        out = self.moe.experts(dispatched, tokens_per_expert, probs)
        return h + dispatcher.combine(out, meta).view(h.shape)

    def _with_losses(self, outputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Add the router's logged losses (scopes holding the router) and remember the names."""
        if self.scope in _ROUTER_SCOPES:
            for name in ("aux_loss", "z_loss"):
                value = getattr(self.moe.router, name, None)
                if value is not None:
                    outputs["router." + name] = value
        self._output_names = tuple(outputs)
        return tuple(outputs.values())

    def captured_part(self, x: torch.Tensor):
        """What the graph captures: the block up to the scope boundary (its outputs)."""
        self.tensor_store.clear()
        if self.scope == "full":
            return self._with_losses({"output": self.eager_forward(x)})
        with capturing_scope(self.scope):
            try:
                self.eager_forward(x)
            except PartialCaptureSignal as signal:
                return self._with_losses(dict(zip(signal.names, signal.outputs)))
        raise RuntimeError(f"scope {self.scope!r}: the block ended without reaching its boundary")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.graphed is None:
            return self.eager_forward(x)
        outs = self.graphed(x)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        named = dict(zip(self._output_names, outs))
        for name in ("aux_loss", "z_loss"):  # the logged values of this replay
            if "router." + name in named:
                setattr(self.moe.router, name, named.pop("router." + name).clone())
        if self.scope == "full":
            return named["output"]
        try:
            self.tensor_store.set(**named)
            return self.eager_forward(x)
        finally:
            self.tensor_store.clear()


def capture_blocks(
    blocks: Sequence[PartialMoEBlock],
    sample_input: torch.Tensor,
    *,
    order: Sequence[int] | None = None,
    num_microbatches: int = 1,
    num_layers_per_chunk: Sequence[int] | None = None,
    **kwargs,
):
    """Capture each block's :meth:`~PartialMoEBlock.captured_part` in ``order`` (see
    :func:`mtp.graphs.make_graphed_callables`) and switch the blocks to replay.

    ``sample_input`` (``[..., H]``) gives every block's input shape and dtype; the first
    block's input gets a gradient when ``sample_input.requires_grad`` (a pipeline stage after
    the first), the others always. Returns ``(graphs, plan, buffers)``.
    """
    for i, block in enumerate(blocks):
        if not isinstance(block, PartialMoEBlock):
            raise TypeError(f"blocks[{i}] must be a PartialMoEBlock, got {type(block).__name__}")
    samples = [(sample_input.detach().requires_grad_(sample_input.requires_grad),)] + [
        (sample_input.detach().clone().requires_grad_(True),) for _ in blocks[1:]
    ]
    parts = [_CapturedPart(b) for b in blocks]
    graphs, plan, buffers = make_graphed_callables(
        parts, samples, order=order, num_microbatches=num_microbatches,
        num_layers_per_chunk=num_layers_per_chunk, **kwargs,
    )
    for block, steps in zip(blocks, graphs):
        block.graphed = GraphedLayer(block, steps)
    return graphs, plan, buffers


class _CapturedPart(nn.Module):
    """The captured part of a block as a module (so its parameters get gradients)."""

    def __init__(self, block: PartialMoEBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.captured_part(x)
