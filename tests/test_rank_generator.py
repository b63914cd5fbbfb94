"""Rank generator: worked examples (16 ranks), an independent oracle, properties, validation."""

import itertools

import numpy as np
import pytest

from mtp.parallel import (
    ParallelConfigError,
    RankGenerator,
    derive_parallel_sizes,
    generate_masked_orthogonal_groups,
    make_rank_generators,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DIMS = ["tp", "cp", "ep", "dp", "pp"]


def oracle_groups(sizes, mask):
    """Independent construction: lay ranks on an ndarray (axis 0 fastest) and transpose.

    Groups are enumerated with the first unmasked axis fastest, ranks inside a group with the
    first masked axis fastest (Megatron-Core's order).
    """
    world = int(np.prod(sizes))
    grid = np.arange(world).reshape(sizes[::-1]).transpose(list(range(len(sizes)))[::-1])
    masked = [k for k, m in enumerate(mask) if m]
    unmasked = [k for k, m in enumerate(mask) if not m]
    arranged = grid.transpose(unmasked[::-1] + masked[::-1])
    group_size = int(np.prod([sizes[k] for k in masked])) if masked else 1
    return arranged.reshape(world // group_size, group_size).tolist()


# --- worked examples (16 ranks) ------------------------------------------------------------


def test_seed_dense_tp4_pp2_dp2():
    gen = RankGenerator(tp=4, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gen.get_ranks("dp") == [
        [0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]
    ]
    assert gen.get_ranks("pp") == [
        [0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]
    ]
    assert gen.get_ranks("tp-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert gen.get_ranks("cp") == [[r] for r in range(16)]


def test_seed_expert_etp1_ep4_edp2_pp2():
    dense, expert = make_rank_generators(16, tp=4, pp=2, ep=4, etp=1)
    assert (expert.tp, expert.ep, expert.dp, expert.pp) == (1, 4, 2, 2)
    assert expert.get_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert expert.get_ranks("dp") == [
        [0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]
    ]
    assert expert.get_ranks("tp") == [[r] for r in range(16)]
    assert expert.get_ranks("pp") == dense.get_ranks("pp")


def test_megatron_docstring_example():
    # parallel_size [tp, dp, pp] = [2, 3, 4], mask on dp
    groups = generate_masked_orthogonal_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4]
    assert groups[1] == [1, 3, 5]
    assert groups[7] == [19, 21, 23]
    assert len(groups) == 8


def test_small_example_in_docstring():
    groups = generate_masked_orthogonal_groups(8, [2, 2, 2], [False, True, False])
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_order_appends_missing_size1_dims_like_megatron():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp")
    assert gen.order == "tp-dp-pp-ep-cp"
    assert gen.ordered_size == [2, 2, 2, 1, 1]
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # tp-pp-dp: pp before dp
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")
    assert gen.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_token_order_and_case_do_not_matter():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2)
    assert gen.get_ranks("dp-cp") == gen.get_ranks("cp-dp") == gen.get_ranks("CP-DP")


def test_rank_offset():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, rank_offset=4)
    assert gen.get_ranks("tp") == [[4, 5], [6, 7]]
    assert gen.coordinates(7) == {"tp": 1, "cp": 0, "ep": 0, "dp": 1, "pp": 0}


# --- oracle and properties over random valid configurations ---------------------------------

size = st.sampled_from([1, 1, 2, 3, 4])


@st.composite
def configs(draw):
    tp, dp, pp = draw(size), draw(size), draw(size)
    cp, ep = draw(size), draw(size)
    if draw(st.booleans()):
        ep = 1
    else:
        cp = 1
    order = draw(st.permutations(DIMS))
    return dict(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order="-".join(order))


def all_tokens():
    for n in range(1, len(DIMS) + 1):
        for combo in itertools.combinations(DIMS, n):
            yield "-".join(combo)


@settings(max_examples=60, deadline=None)
@given(configs())
def test_matches_independent_oracle(cfg):
    gen = RankGenerator(**cfg)
    sizes = gen.ordered_size
    axes = gen.order.split("-")
    for token in all_tokens():
        mask = [a in token.split("-") for a in axes]
        assert gen.get_ranks(token) == oracle_groups(sizes, mask), (cfg, token)


@settings(max_examples=60, deadline=None)
@given(configs())
def test_groups_partition_and_meet_once(cfg):
    gen = RankGenerator(**cfg)
    world = gen.world_size
    by_token = {}
    for token in all_tokens():
        groups = gen.get_ranks(token)
        expected_size = int(np.prod([gen.name_to_size[t] for t in token.split("-")]))
        assert all(len(g) == expected_size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
        by_token[token] = {r: set(g) for g in groups for r in g}
    for a, b in itertools.combinations(by_token, 2):
        if set(a.split("-")) & set(b.split("-")):
            continue
        for r in range(world):  # orthogonal groups through r meet exactly in r
            assert by_token[a][r] & by_token[b][r] == {r}


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([None, 1, 2]),
    st.sampled_from([1, 2, 4]),
)
def test_moe_folding_world_identity(tp, pp, cp, ep, etp, dp):
    world = tp * cp * pp * dp
    etp_ = tp if etp is None else etp
    if world % (etp_ * ep * pp):
        with pytest.raises(ParallelConfigError, match="not divisible by etp"):
            make_rank_generators(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        return
    dense, expert = make_rank_generators(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    assert dense.world_size == expert.world_size == world
    assert dense.tp * dense.cp * dense.dp * dense.pp == world
    assert expert.tp * expert.ep * expert.dp * expert.pp == world
    assert dense.get_ranks("pp") == expert.get_ranks("pp")


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0, ep=1, dp=1, pp=1, cp=1), "tp must be >= 1"),
        (dict(tp=2, ep=1, dp=-1, pp=1, cp=1), "dp must be >= 1"),
        (dict(tp=2, ep=2, dp=1, pp=1, cp=2), "cannot both exceed 1"),
        (dict(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-tp-dp"), "more than once"),
        (dict(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-xp-dp"), "unknown dimension"),
        (dict(tp=2, ep=4, dp=1, pp=1, cp=1, order="tp-cp-dp-pp"), r"lacks \['ep'\].*ep=4"),
        (dict(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp"), r"lacks \['pp'\]"),
    ],
)
def test_generator_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankGenerator(**kwargs)


def test_generator_rejects_non_int():
    with pytest.raises(TypeError, match="tp must be an int"):
        RankGenerator(tp=2.0, ep=1, dp=1, pp=1, cp=1)


def test_config_error_is_also_runtime_error():
    with pytest.raises(RuntimeError):
        RankGenerator(tp=2, ep=4, dp=1, pp=1, cp=1, order="tp-dp-pp")


@pytest.mark.parametrize("token, match", [("xp", "unknown"), ("tp-tp", "more than once"), ("", "unknown")])
def test_get_ranks_rejects_bad_token(token, match):
    with pytest.raises(ValueError, match=match):
        RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1).get_ranks(token)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=16, tp=3), r"not divisible by tp\*cp\*pp = 3\*1\*1 = 3"),
        (dict(world_size=8, tp=2, ep=3), r"not divisible by etp\*ep\*pp = 2\*3\*1 = 6"),
        (dict(world_size=16, tp=2, pp=2, ep=4, order="tp-cp-ep-pp-dp"), "must be equal"),
        (dict(world_size=0), "world_size must be >= 1"),
    ],
)
def test_derive_sizes_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        derive_parallel_sizes(**kwargs)


def test_derive_sizes():
    s = derive_parallel_sizes(16, tp=4, pp=2, ep=4, etp=1)
    assert (s.tp, s.cp, s.dp, s.pp, s.etp, s.ep, s.edp) == (4, 1, 2, 2, 1, 4, 2)
    s = derive_parallel_sizes(16, tp=2, pp=2, ep=2)
    assert (s.dp, s.etp, s.edp) == (4, 2, 2)


def test_mask_length_and_world_checked():
    with pytest.raises(ValueError, match="mask has 2 entries"):
        generate_masked_orthogonal_groups(4, [2, 2, 1], [True, False])
    with pytest.raises(ValueError, match="world_size 8 != product"):
        generate_masked_orthogonal_groups(8, [2, 2], [True, False])
