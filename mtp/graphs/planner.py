"""Static-buffer planner: which graph static buffers each (chunk, microbatch) uses.

CUDA graphs read their inputs from, and write their outputs to, fixed addresses. Giving every
microbatch its own buffers makes their memory grow with the number of microbatches; but in a
pipeline order a backward (``-c``) ends the life of its forward's activations, so the next
forward of the chunk can take that forward's buffers (Transformer Engine's
``_reuse_graph_input_output_buffers``). Simulating the order with a free list
gives every forward a *slot*; the live slots at any time are the forwards in flight, so the
number of slots is bounded by the pipeline depth, not by the microbatch count.

:func:`plan_static_buffers` is pure Python (no tensors): usable and testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from mtp.pipeline.schedules import order_to_steps

__all__ = ["BufferPlan", "plan_static_buffers"]


@dataclass
class BufferPlan:
    """Result of :func:`plan_static_buffers`.

    Attributes:
        slot: ``{(chunk, microbatch): slot id}`` (chunks from 0); forwards in the same slot share
            static input/output buffers (one set per layer of the chunk).
        slot_key: ``{slot id: key}`` (the buffers' shape class; see ``key_fn``).
        num_slots: distinct slots (buffer sets) allocated.
        peak_live: most slots holding a forward's activations at once.
        events: ``[(step index, "alloc"|"reuse"|"free", chunk, microbatch, slot)]``.
    """

    slot: dict[tuple[int, int], int] = field(default_factory=dict)
    slot_key: dict[int, Hashable] = field(default_factory=dict)
    num_slots: int = 0
    peak_live: int = 0
    events: list[tuple[int, str, int, int, int]] = field(default_factory=list)

    def slots_of_chunk(self, chunk: int) -> list[int]:
        """Distinct slots used by ``chunk`` (0-based), sorted."""
        return sorted({s for (c, _), s in self.slot.items() if c == chunk})


def plan_static_buffers(
    order,
    num_model_chunks: int | None = None,
    key_fn: Callable[[int], Hashable] | None = None,
) -> BufferPlan:
    """Assign a buffer slot to each forward of ``order`` (Megatron/TE numbering).

    Args:
        order: one rank's order (``+c`` forward, ``-c`` backward of chunk ``c`` from 1).
        num_model_chunks: default ``max(|order|)``.
        key_fn: ``chunk (0-based) -> key``: slots are reused only between chunks with equal keys
            (the same static input shapes). Default: the chunk itself (no sharing across chunks).
            ``lambda c: 0`` shares slots between all chunks (identical layer shapes).

    A forward takes the oldest freed slot of its key, else a new one; a backward frees its
    forward's slot (backwards of a chunk run in microbatch order).

    Raises:
        ValueError: an invalid order (see :func:`mtp.pipeline.order_to_steps`).
    """
    steps = order_to_steps(order, num_model_chunks)
    key_fn = key_fn or (lambda c: c)
    plan = BufferPlan()
    free: dict[Hashable, list[int]] = {}
    live = 0
    for i, s in enumerate(steps):
        if s.forward:
            key = key_fn(s.chunk)
            pool = free.setdefault(key, [])
            if pool:
                slot, kind = pool.pop(0), "reuse"
            else:
                slot, kind = plan.num_slots, "alloc"
                plan.num_slots += 1
                plan.slot_key[slot] = key
            plan.slot[(s.chunk, s.microbatch)] = slot
            live += 1
            plan.peak_live = max(plan.peak_live, live)
        else:
            slot, kind = plan.slot[(s.chunk, s.microbatch)], "free"
            free.setdefault(plan.slot_key[slot], []).append(slot)
            live -= 1
        plan.events.append((i, kind, s.chunk, s.microbatch, slot))
    return plan
