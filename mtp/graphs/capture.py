"""Capture layers as forward/backward graphs in a pipeline order, with one memory pool and
static buffers reused per the order (``make_graphed_callables`` in the style of Transformer
Engine's, with its ``_order`` and ``_reuse_graph_input_output_buffers``).

For each layer ``l`` and microbatch ``m`` a forward graph and a backward graph are captured, in
the order the pipeline will replay them (``+c``: the layers of chunk ``c`` forward, ``-c``: the
same layers backward, last first). Everything a graph reads or writes between replays lives in
static buffers of a *slot* (:func:`mtp.graphs.plan_static_buffers`): the inputs, the outputs, the
gradients of the outputs and of the inputs; forwards whose lives do not overlap share a slot.
The parameters' gradients go through one buffer per layer (consumed by autograd at once).
Everything else (activations saved for the backward) is graph-private memory of the shared pool:
a backward's capture releases its forward's activations back to the pool, so the next capture
reuses them, exactly as the replays will.

On CUDA the graphs are ``torch.cuda.CUDAGraph``. Elsewhere (or with ``graph_factory=StandInGraph``)
a :class:`StandInGraph` records the Python callable and re-runs it at each replay on the same
static buffers, so the whole protocol (slots, capture order, early exits, tensor stores) runs and
is tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from mtp.utils import is_fake

from .planner import BufferPlan, plan_static_buffers

__all__ = [
    "StandInGraph",
    "CudaGraph",
    "StaticBuffers",
    "GraphedStep",
    "GraphedLayer",
    "make_graphed_callables",
]


class StandInGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``.

    ``capture(fn)`` runs ``fn()`` once and remembers it; ``replay()`` runs it again and copies
    the new results into the tensors the capture returned (fixed addresses, like a graph).
    ``replays`` counts the replays.
    """

    def __init__(self, pool=None) -> None:
        self._fn: Callable | None = None
        self._outputs: list | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], list]) -> list:
        self._fn = fn
        self._outputs = list(fn())
        return self._outputs

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("StandInGraph.replay() before capture()")
        new = self._fn()
        with torch.no_grad():
            for old, value in zip(self._outputs, new):
                if old is not None and value is not None and old.data_ptr() != value.data_ptr():
                    old.copy_(value)
        self.replays += 1


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the same ``capture(fn)`` / ``replay()`` interface;
    every graph of one :func:`make_graphed_callables` call shares ``pool``."""

    def __init__(self, pool=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.replays = 0

    def capture(self, fn: Callable[[], list]) -> list:
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = list(fn())
        return outputs

    def replay(self) -> None:
        self.graph.replay()
        self.replays += 1


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    raise TypeError(
        f"a graphed callable must return a tensor or a tuple of tensors, got {type(out).__name__}"
    )


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


class _IntoBuffer(torch.autograd.Function):
    """Copy ``y`` into ``buffer`` and return ``buffer`` (gradient passes through)."""

    @staticmethod
    def forward(ctx, y, buffer):
        buffer.copy_(y)
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class StaticBuffers:
    """The static buffers of one capture: inputs, outputs, output and input gradients per
    ``(layer, slot)``, parameter gradients per layer; :meth:`nbytes` is their total size."""

    def __init__(self) -> None:
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.grad_outputs: dict = {}
        self.grad_inputs: dict = {}
        self.param_grads: dict = {}

    def nbytes(self) -> int:
        seen, total = set(), 0
        for d in (self.inputs, self.outputs, self.grad_outputs, self.grad_inputs,
                  self.param_grads):
            for ts in d.values():
                for t in ts:
                    if t is not None and t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        total += t.numel() * t.element_size()
        return total


class GraphedStep:
    """The graphs of one (layer, microbatch): calling it copies the inputs into the static
    inputs, replays the forward graph and returns the static outputs; autograd's backward
    replays the backward graph. On fake tensors it runs the captured callable directly (shape
    propagation of what the graph computes, for :func:`mtp.testing.assert_graph_safe`)."""

    def __init__(self, fn, layer_idx, microbatch, slot, params, make_graph):
        self.fn, self.layer, self.microbatch, self.slot = fn, layer_idx, microbatch, slot
        self.params = params
        self.fwd_graph, self.bwd_graph = make_graph(), make_graph()
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.static_grad_outputs: list = []
        self.static_grad_inputs: list = []
        self.live: list | None = None  # outputs with their autograd graph (capture / stand-in)

    # -- capture ----------------------------------------------------------------------------
    def capture_forward(self, slots: StaticBuffers, sample) -> None:
        key = (self.layer, self.slot)
        if key not in slots.inputs:
            slots.inputs[key] = [
                torch.zeros_like(t).requires_grad_(_differentiable(t)) for t in sample
            ]
        self.static_inputs = slots.inputs[key]

        def forward():
            with torch.enable_grad():
                outs = _flat(self.fn(*self.static_inputs))
                if key not in slots.outputs:
                    slots.outputs[key] = [torch.empty_like(o) for o in outs]
                bufs = slots.outputs[key]
                if len(bufs) != len(outs):
                    raise RuntimeError(f"layer {self.layer}: output count changed between calls")
                self.live = [
                    _IntoBuffer.apply(o, b) if _differentiable(o) else b.copy_(o)
                    for o, b in zip(outs, bufs)
                ]
            return self.live

        self.static_outputs = self.fwd_graph.capture(forward)
        self.diff_outputs = [i for i, o in enumerate(self.static_outputs) if _differentiable(o)]
        self.diff_inputs = [i for i, t in enumerate(self.static_inputs) if t.requires_grad]

    def capture_backward(self, slots: StaticBuffers) -> None:
        key = (self.layer, self.slot)
        if key not in slots.grad_outputs:
            slots.grad_outputs[key] = [
                torch.zeros_like(self.static_outputs[i]) for i in self.diff_outputs
            ]
        self.static_grad_outputs = slots.grad_outputs[key]
        targets = [self.static_inputs[i] for i in self.diff_inputs] + list(self.params)

        def backward():
            outs = [self.live[i] for i in self.diff_outputs]
            grads = torch.autograd.grad(
                outs, targets, self.static_grad_outputs, allow_unused=True
            ) if outs and targets else [None] * len(targets)
            if key not in slots.grad_inputs:
                slots.grad_inputs[key] = [
                    None if g is None else torch.empty_like(g)
                    for g in grads[: len(self.diff_inputs)]
                ]
            if self.layer not in slots.param_grads:
                slots.param_grads[self.layer] = [
                    None if g is None else torch.empty_like(g)
                    for g in grads[len(self.diff_inputs):]
                ]
            bufs = slots.grad_inputs[key] + slots.param_grads[self.layer]
            with torch.no_grad():
                for b, g in zip(bufs, grads):
                    if b is not None and g is not None:
                        b.copy_(g)
            self.live = None  # the activations go back to the pool
            return bufs

        self.static_grad_inputs = self.bwd_graph.capture(backward)

    # -- replay -----------------------------------------------------------------------------
    def __call__(self, *args):
        if len(args) != len(self.static_inputs):
            raise TypeError(
                f"graphed layer {self.layer} takes {len(self.static_inputs)} tensors, got "
                f"{len(args)}"
            )
        if any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
            return self.fn(*args)
        for i, (a, s) in enumerate(zip(args, self.static_inputs)):
            if not isinstance(a, torch.Tensor) or a.shape != s.shape or a.dtype != s.dtype:
                raise ValueError(
                    f"graphed layer {self.layer} input {i}: expected {tuple(s.shape)} {s.dtype} "
                    f"(the sample's), got "
                    f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}"
                    f"{' ' + str(a.dtype) if isinstance(a, torch.Tensor) else ''}"
                )
        out = _Replay.apply(self, *args, *self.params)
        return out[0] if len(out) == 1 else out


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: GraphedStep, *args):
        n = len(step.static_inputs)
        with torch.no_grad():
            for s, a in zip(step.static_inputs, args[:n]):
                if s.data_ptr() != a.data_ptr():
                    s.copy_(a)
        step.fwd_graph.replay()
        ctx.step = step
        # AccumulateGrad keeps (steals) a gradient handed to a leaf whose .grad is None: give
        # leaves a copy, not the static buffer the next replay overwrites.
        ctx.leaf = [a.is_leaf and a.requires_grad for a in args[:n]]
        outs = tuple(o.detach() for o in step.static_outputs)
        ctx.mark_non_differentiable(
            *[o for i, o in enumerate(outs) if i not in step.diff_outputs]
        )
        return outs

    @staticmethod
    def backward(ctx, *grads):
        step = ctx.step
        with torch.no_grad():
            for buf, i in zip(step.static_grad_outputs, step.diff_outputs):
                if grads[i] is None:
                    buf.zero_()
                elif buf.data_ptr() != grads[i].data_ptr():
                    buf.copy_(grads[i])
        step.bwd_graph.replay()
        nd = len(step.diff_inputs)
        input_grads = [None] * len(step.static_inputs)
        for j, i in enumerate(step.diff_inputs):
            g = step.static_grad_inputs[j]
            input_grads[i] = None if g is None else (g.clone() if ctx.leaf[i] else g.detach())
        param_grads = [
            None if g is None else (g.clone() if p.grad is None else g.detach())
            for g, p in zip(step.static_grad_inputs[nd:], step.params)
        ]
        return (None, *input_grads, *param_grads)


class GraphedLayer(nn.Module):
    """A layer whose forward replays its graphs: the k-th call (since :meth:`reset`) uses the
    graphs of microbatch ``k % num_microbatches`` (each chunk runs its microbatches in order)."""

    def __init__(self, layer: nn.Module, steps: Sequence[GraphedStep]) -> None:
        super().__init__()
        self.layer = layer
        self.steps = list(steps)
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def forward(self, *args):
        step = self.steps[self.calls % len(self.steps)]
        self.calls += 1
        return step(*args)


def _layers_per_chunk(num_callables, num_chunks, num_layers_per_chunk):
    if num_layers_per_chunk is None:
        if num_callables % num_chunks:
            raise ValueError(
                f"{num_callables} callables do not split evenly over the order's {num_chunks} "
                "chunks; pass num_layers_per_chunk"
            )
        return [num_callables // num_chunks] * num_chunks
    if len(num_layers_per_chunk) != num_chunks or sum(num_layers_per_chunk) != num_callables:
        raise ValueError(
            f"num_layers_per_chunk={list(num_layers_per_chunk)} must have one entry per chunk "
            f"({num_chunks}) and sum to the number of callables ({num_callables})"
        )
    return list(num_layers_per_chunk)


def _warmup(callables, sample_args, params, iters: int) -> None:
    for fn, sample, ps in zip(callables, sample_args, params):
        for _ in range(iters):
            inputs = [t.detach().clone().requires_grad_(_differentiable(t)) for t in sample]
            outs = [o for o in _flat(fn(*inputs)) if _differentiable(o)]
            targets = [t for t in inputs if t.requires_grad] + list(ps)
            if outs and targets:
                torch.autograd.grad(outs, targets, [torch.ones_like(o) for o in outs],
                                    allow_unused=True)


def make_graphed_callables(
    callables: Sequence[Callable],
    sample_args: Sequence[Sequence[torch.Tensor]],
    *,
    order: Sequence[int] | None = None,
    num_microbatches: int = 1,
    num_layers_per_chunk: Sequence[int] | None = None,
    num_warmup_iters: int = 1,
    pool=None,
    graph_factory: Callable | None = None,
    reuse_buffers: bool = True,
) -> tuple[list[list[GraphedStep]], BufferPlan, StaticBuffers]:
    """Capture ``callables`` (layers, chunk after chunk) in ``order``.

    Args:
        callables: modules or functions ``(*tensors) -> tensor | tuple of tensors``; the
            parameters of a module get their gradients through the backward graph.
        sample_args: per callable, tensors with the inputs' shapes, dtypes and
            ``requires_grad`` (values are not used).
        order: the rank's pipeline order (:func:`mtp.pipeline.get_pipeline_order`); default
            ``[1, -1] * num_microbatches`` (one chunk, no pipelining).
        num_layers_per_chunk: layers of each chunk (default: an even split).
        num_warmup_iters: eager forward+backward runs per callable before capturing.
        pool: the memory pool shared by every graph (CUDA default: a new one).
        graph_factory: ``pool -> graph`` (:class:`CudaGraph` when the samples are on CUDA, else
            :class:`StandInGraph`).
        reuse_buffers: share static buffers between forwards per the order (False: one slot
            per microbatch, for comparison).

    Returns:
        ``(graphs, plan, buffers)``: ``graphs[l][m]`` is the :class:`GraphedStep` of layer
        ``l`` and microbatch ``m``; ``plan`` the slot assignment; ``buffers.nbytes()`` the
        static buffers' size.
    """
    callables = list(callables)
    if len(sample_args) != len(callables):
        raise ValueError(
            f"sample_args has {len(sample_args)} entries, callables {len(callables)}"
        )
    for i, sample in enumerate(sample_args):
        if not all(isinstance(t, torch.Tensor) for t in sample):
            raise TypeError(f"sample_args[{i}] must be a sequence of tensors")
    if order is None:
        order = [1, -1] * num_microbatches
    order = list(order)
    num_chunks = max((abs(c) for c in order), default=0)
    per_chunk = _layers_per_chunk(len(callables), num_chunks, num_layers_per_chunk)
    first_layer = [sum(per_chunk[:c]) for c in range(num_chunks)]
    plan = plan_static_buffers(order, num_chunks)
    num_mb = [sum(1 for c in order if c == k + 1) for k in range(num_chunks)]
    if len(set(num_mb)) > 1:
        raise ValueError(f"order runs different microbatch counts per chunk: {num_mb}")
    device = next((t.device for s in sample_args for t in s), torch.device("cpu"))
    if graph_factory is None:
        graph_factory = CudaGraph if device.type == "cuda" else StandInGraph
    if pool is None and graph_factory is CudaGraph:
        pool = torch.cuda.graph_pool_handle()
    params = [
        [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, nn.Module) else []
        for fn in callables
    ]
    if device.type == "cuda" and num_warmup_iters > 0:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _warmup(callables, sample_args, params, num_warmup_iters)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    elif num_warmup_iters > 0:
        _warmup(callables, sample_args, params, num_warmup_iters)

    slots = StaticBuffers()
    graphs: list[list] = [[None] * num_mb[0] for _ in callables]
    fwd_count, bwd_count = [0] * num_chunks, [0] * num_chunks
    fresh = iter(range(10**9))
    for c in order:
        k = abs(c) - 1
        layers = range(first_layer[k], first_layer[k] + per_chunk[k])
        if c > 0:
            m = fwd_count[k]
            fwd_count[k] += 1
            slot = plan.slot[(k, m)] if reuse_buffers else next(fresh)
            for l in layers:
                step = GraphedStep(callables[l], l, m, slot, params[l],
                                   lambda: graph_factory(pool))
                step.capture_forward(slots, sample_args[l])
                graphs[l][m] = step
        else:
            m = bwd_count[k]
            bwd_count[k] += 1
            for l in reversed(layers):
                graphs[l][m].capture_backward(slots)
    return graphs, plan, slots
