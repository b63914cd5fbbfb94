"""Schedule tables and orders against an independent oracle of Megatron-Core's algorithm,
hand-worked orders, and a whole-pipeline dependency simulation (no deadlock, right data)."""

import pytest

from mtp.pipeline import (
    check_schedule_args,
    convert_schedule_table_to_order,
    get_pipeline_order,
    get_pp_rank_microbatches,
    get_schedule_table,
    max_in_flight_forwards,
    order_to_steps,
)


def oracle_order(pp, rank, m, vpp, group):
    """Megatron-Core's interleaved loop written out: warm-up forwards, then forward k + w with
    backward k, then the remaining backwards; chunk of virtual microbatch k by arithmetic."""
    starts = list(range(0, m, group))

    def fwd_chunk(k):
        for s in starts:
            size = min(group, m - s)
            if k < s * vpp + size * vpp:
                return (k - s * vpp) // size
        raise AssertionError(k)

    total = m * vpp
    if pp == 1:  # no pipelining: forward, backward, forward, ... (Megatron-Core 0.16 and 0.19)
        warmup = 0
    elif vpp == 1:
        warmup = pp - rank - 1
    else:
        warmup = (pp - rank - 1) * 2 + (vpp - 1) * group
    warmup = min(warmup, total)
    out = [fwd_chunk(k) + 1 for k in range(warmup)]
    for k in range(total - warmup):
        out.append(fwd_chunk(k + warmup) + 1)
        out.append(-(vpp - fwd_chunk(k)))  # backward visits chunk vpp - 1 - c, 1-indexed, negated
    out += [-(vpp - fwd_chunk(k)) for k in range(total - warmup, total)]
    return out


def valid(pp, m, vpp, group):
    if vpp == 1:
        return True
    return pp > 1 and pp <= group <= m and not (0 < m % group < pp)


CASES = [
    (pp, m, vpp, group)
    for pp in (1, 2, 4, 8)
    for m in range(1, 17)
    for vpp in (1, 2, 3)
    for group in sorted({pp, max(pp, m)})
    if valid(pp, m, vpp, group)
]


def test_orders_match_oracle_everywhere():
    assert len(CASES) > 150
    for pp, m, vpp, group in CASES:
        for rank in range(pp):
            got = get_pipeline_order(pp, rank, m, vpp, group)
            assert got == oracle_order(pp, rank, m, vpp, group), (pp, rank, m, vpp, group)
            assert len(got) == 2 * m * vpp and sum(got) == 0


def test_hand_worked_orders():
    # Megatron-Core's docstring example: PP2 N3 M5 VP2, warm-up 5 (rank 0).
    assert get_schedule_table(5, 2, 3) == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    assert get_pp_rank_microbatches(5, 2, 3, 2, 0) == (10, False, 5, 5)
    assert get_pipeline_order(2, 0, 5, 2, 3) == [
        1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    # PP4 VP2 M8 (group 4), rank 0: warm-up 10.
    assert get_pipeline_order(4, 0, 8, 2) == [
        1, 1, 1, 1, 2, 2, 2, 2, 1, 1,
        1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1,
        -1, -1, -2, -2, -2, -2, -1, -1, -1, -1]
    # 1F1B: first stage warms up pp - 1, last stage alternates, and so does one stage
    # (Megatron-Core's no-pipelining warm-up is 0).
    assert get_pipeline_order(4, 0, 4) == [1, 1, 1, 1, -1, -1, -1, -1]
    assert get_pipeline_order(4, 3, 4) == [1, -1] * 4
    assert get_pipeline_order(4, 1, 3) == [1, 1, 1, -1, -1, -1]
    assert get_pipeline_order(1, 0, 3) == [1, -1, 1, -1, 1, -1]
    assert get_pp_rank_microbatches(3, 1, 1, 1, 0) == (3, False, 0, 3)
    assert convert_schedule_table_to_order(0, 1, [(0, 0), (1, 0)]) == [1, -1, 1, -1]


def simulate(pp, m, vpp, group):
    """Run every rank's order with blocking receives and asynchronous sends: a forward of
    virtual stage v needs stage v - 1's forward of the same microbatch, a backward needs stage
    v + 1's backward. Returns the number of rounds (raises on a deadlock)."""
    steps = [order_to_steps(get_pipeline_order(pp, r, m, vpp, group), vpp) for r in range(pp)]
    done_f, done_b = set(), set()
    pos = [0] * pp
    nv = pp * vpp
    rounds = 0
    while any(pos[r] < len(steps[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(steps[r]):
                continue
            s = steps[r][pos[r]]
            v = s.chunk * pp + r
            if s.forward:
                ready = v == 0 or (v - 1, s.microbatch) in done_f
                target = done_f
            else:
                ready = (v, s.microbatch) in done_f and (
                    v == nv - 1 or (v + 1, s.microbatch) in done_b
                )
                target = done_b
            if ready:
                target.add((v, s.microbatch))
                pos[r] += 1
                progressed = True
        rounds += 1
        assert progressed, f"deadlock pp={pp} m={m} vpp={vpp} group={group} at {pos}"
    assert len(done_f) == len(done_b) == nv * m
    return rounds


def test_orders_run_without_deadlock():
    for pp, m, vpp, group in CASES:
        simulate(pp, m, vpp, group)


def test_warmup_and_in_flight():
    for pp in (2, 4, 8):
        for rank in range(pp):
            order = get_pipeline_order(pp, rank, 16)
            # 1F1B keeps at most pp - rank activations: bounded by the depth, not by M.
            assert max_in_flight_forwards(order) == pp - rank
    order = get_pipeline_order(4, 0, 8, 2)
    assert max_in_flight_forwards(order) == 11 and max_in_flight_forwards(order, True) == [8, 4]


def test_bad_arguments():
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
        check_schedule_args(4, 3, 2)  # group 4 > M 3
    with pytest.raises(ValueError, match="must be 0 or >="):
        check_schedule_args(4, 9, 2, 4)  # last group of 1 < pp
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        get_pipeline_order(1, 0, 4, 2)
    with pytest.raises(TypeError, match="num_microbatches"):
        get_pipeline_order(2, 0, 2.0)
    with pytest.raises(ValueError, match="pipeline_parallel_rank"):
        get_pp_rank_microbatches(4, 1, None, 2, 2)
    with pytest.raises(ValueError, match="before its forward"):
        order_to_steps([-1, 1])
    with pytest.raises(ValueError, match="nonzero"):
        order_to_steps([1, 0, -1])
