"""Pipeline schedules: 1F1B and interleaved 1F1B as Megatron-Core numbers them.

A rank holds ``num_model_chunks`` (= virtual pipeline size, ``vpp``) model chunks. Its work is
a list of ``2 * num_microbatches * num_model_chunks`` steps, the **order**: ``+c`` is the next
forward of local chunk ``c`` (numbered from 1), ``-c`` the next backward of chunk ``c``. This is
the ``_order`` argument of Transformer Engine's ``make_graphed_callables`` and what
``megatron.core.pipeline_parallel.schedules.convert_schedule_table_to_order`` returns, so orders
are interchangeable with Megatron-Core.

- :func:`get_schedule_table`: the forward sequence ``[(microbatch, chunk), ...]`` shared by all
  ranks: microbatches go in groups of ``microbatch_group_size_per_vp_stage``; inside a group
  every chunk runs the group's microbatches in turn.
- :func:`get_pp_rank_microbatches`: ``(total, all_in_warmup, warmup, remaining)``; warm-up is
  ``pp - rank - 1`` (1F1B), ``(pp - rank - 1) * 2 + (vpp - 1) * group`` (interleaved), 0 with
  one stage (Megatron-Core's no-pipelining case: forward, backward, forward, ...), capped at the
  total.
- :func:`convert_schedule_table_to_order`: warm-up forwards, then one forward + one backward per
  step, then the remaining backwards. A backward of table entry ``(m, c)`` runs chunk
  ``vpp - 1 - c`` (backwards visit the chunks in reverse), written ``c - vpp``.
- :func:`get_pipeline_order`: the three above for one rank.
- :func:`order_to_steps`: the order with explicit microbatch ids, ``[(chunk0, mb, is_fwd)]``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PipelineStep",
    "check_schedule_args",
    "get_pp_rank_microbatches",
    "get_schedule_table",
    "convert_schedule_table_to_order",
    "get_pipeline_order",
    "order_to_steps",
    "max_in_flight_forwards",
]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_schedule_args(
    pipeline_parallel_size: int,
    num_microbatches: int,
    num_model_chunks: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> int:
    """Validate a schedule's sizes (Megatron-Core's rules); return the group size used.

    Interleaving (``num_model_chunks > 1``) needs ``pp > 1``, ``pp <= group <= num_microbatches`` and a last
    group that is empty or at least ``pp`` microbatches (otherwise stages wait on each other).

    Raises:
        TypeError / ValueError: naming the argument.
    """
    pp = _check_int("pipeline_parallel_size", pipeline_parallel_size, 1)
    m = _check_int("num_microbatches", num_microbatches, 1)
    vpp = _check_int("num_model_chunks", num_model_chunks, 1)
    group = microbatch_group_size_per_vp_stage
    group = pp if group is None else group
    group = _check_int("microbatch_group_size_per_vp_stage", group, 1)
    if vpp > 1:
        if pp == 1:
            raise ValueError(
                f"num_model_chunks={vpp} needs pipeline_parallel_size > 1 (interleaving splits "
                "the model over pipeline ranks; with one stage use one chunk)"
            )
        if not pp <= group <= m:
            raise ValueError(
                f"microbatch_group_size_per_vp_stage={group} must be in [pipeline_parallel_size="
                f"{pp}, num_microbatches={m}] with interleaving (num_model_chunks={vpp})"
            )
        last = m % group
        if 0 < last < pp:
            raise ValueError(
                f"num_microbatches={m} % microbatch_group_size_per_vp_stage={group} = {last} must "
                f"be 0 or >= pipeline_parallel_size={pp} with interleaving"
            )
    return group


def get_pp_rank_microbatches(
    num_microbatches: int,
    num_model_chunks: int,
    microbatch_group_size_per_vp_stage: int | None,
    pipeline_parallel_size: int,
    pipeline_parallel_rank: int,
    forward_only: bool = False,
) -> tuple[int, bool, int, int]:
    """``(total, all_in_warmup, num_warmup, remaining)`` for one pipeline rank.

    ``total = num_microbatches * num_model_chunks`` forward steps; ``num_model_chunks == 1`` is
    the non-interleaved 1F1B schedule (Megatron-Core's ``vpp=None``).
    """
    group = check_schedule_args(
        pipeline_parallel_size, num_microbatches, num_model_chunks,
        microbatch_group_size_per_vp_stage,
    )
    pp = pipeline_parallel_size
    rank = _check_int("pipeline_parallel_rank", pipeline_parallel_rank, 0)
    if rank >= pp:
        raise ValueError(f"pipeline_parallel_rank={rank} must be < pipeline_parallel_size={pp}")
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp > 1:
        warmup = pp - rank - 1
        if num_model_chunks > 1:
            warmup = 2 * (pp - rank - 1) + (num_model_chunks - 1) * group
    else:  # one stage: Megatron-Core's forward_backward_no_pipelining order
        warmup = 0
    all_in_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_in_warmup, warmup, total - warmup


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> list[tuple[int, int]]:
    """The forward sequence ``[(microbatch_id, model_chunk_id), ...]`` (both from 0)."""
    m = _check_int("num_microbatches", num_microbatches, 1)
    vpp = _check_int("num_model_chunks", num_model_chunks, 1)
    group = _check_int("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage, 1)
    table = []
    for start in range(0, m, group):
        stop = min(start + group, m)
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(start, stop))
    return table


def convert_schedule_table_to_order(
    num_warmup_microbatches: int, num_model_chunks: int, schedule_table
) -> list[int]:
    """Interleave the table's forwards and backwards into one rank's order (see module doc)."""
    chunks = [chunk for _, chunk in schedule_table]
    forward = [c + 1 for c in chunks]
    backward = [c - num_model_chunks for c in chunks]
    w = num_warmup_microbatches
    order = forward[:w]
    for i in range(w, len(forward)):
        order += [forward[i], backward[i - w]]
    if w > 0:
        order += backward[-w:]
    return order


def get_pipeline_order(
    pipeline_parallel_size: int,
    pipeline_parallel_rank: int,
    num_microbatches: int,
    num_model_chunks: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> list[int]:
    """One rank's order (1F1B for ``num_model_chunks == 1``, else interleaved 1F1B)."""
    group = check_schedule_args(
        pipeline_parallel_size, num_microbatches, num_model_chunks,
        microbatch_group_size_per_vp_stage,
    )
    _, _, warmup, _ = get_pp_rank_microbatches(
        num_microbatches, num_model_chunks, group, pipeline_parallel_size, pipeline_parallel_rank
    )
    table = get_schedule_table(num_microbatches, num_model_chunks, group)
    return convert_schedule_table_to_order(warmup, num_model_chunks, table)


@dataclass(frozen=True)
class PipelineStep:
    """One entry of an order: local ``chunk`` (from 0), ``microbatch`` id, forward or not."""

    chunk: int
    microbatch: int
    forward: bool


def order_to_steps(order, num_model_chunks: int | None = None) -> list[PipelineStep]:
    """Attach microbatch ids to an order: each chunk runs its forwards and its backwards in
    microbatch order (0, 1, ...), so the k-th ``+c`` is microbatch k of chunk c, and so is the
    k-th ``-c``.

    Raises:
        ValueError: a zero entry, a chunk above ``num_model_chunks``, or a backward before its
            forward.
    """
    if num_model_chunks is None:
        num_model_chunks = max((abs(c) for c in order), default=0)
    fwd = [0] * num_model_chunks
    bwd = [0] * num_model_chunks
    steps = []
    for i, c in enumerate(order):
        if isinstance(c, bool) or not isinstance(c, int) or c == 0 or abs(c) > num_model_chunks:
            raise ValueError(
                f"order[{i}]={c!r}: entries must be nonzero ints in [-{num_model_chunks}, "
                f"{num_model_chunks}]"
            )
        k = abs(c) - 1
        if c > 0:
            steps.append(PipelineStep(k, fwd[k], True))
            fwd[k] += 1
        else:
            if bwd[k] >= fwd[k]:
                raise ValueError(f"order[{i}]={c}: backward of chunk {abs(c)} before its forward")
            steps.append(PipelineStep(k, bwd[k], False))
            bwd[k] += 1
    return steps


def max_in_flight_forwards(order, per_chunk: bool = False):
    """Largest number of forwards whose backward has not run yet (the activations a rank keeps),
    over the whole order; ``per_chunk=True``: a list, one maximum per chunk."""
    n = max((abs(c) for c in order), default=0)
    live, peak = [0] * n, [0] * n
    total = total_peak = 0
    for c in order:
        k = abs(c) - 1
        d = 1 if c > 0 else -1
        live[k] += d
        total += d
        peak[k] = max(peak[k], live[k])
        total_peak = max(total_peak, total)
    return peak if per_chunk else total_peak
