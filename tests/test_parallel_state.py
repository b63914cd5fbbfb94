"""Process groups on real gloo process groups (world sizes 4 and 8)."""

import pytest
import torch

import mtp.parallel as mp
from mtp.testing import run_distributed

CONFIGS = {
    4: [
        dict(tensor_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
             expert_tensor_parallel_size=1),
        dict(context_parallel_size=2, expert_model_parallel_size=4,
             expert_tensor_parallel_size=1),
    ],
    8: [
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
             context_parallel_size=2, expert_model_parallel_size=2,
             expert_tensor_parallel_size=1),
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=4,
             expert_tensor_parallel_size=1),
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
             order="tp-cp-ep-pp-dp"),
    ],
}

GETTERS = {
    "tp": (mp.get_tensor_model_parallel_group, mp.get_tensor_model_parallel_rank,
           mp.get_tensor_model_parallel_world_size),
    "pp": (mp.get_pipeline_model_parallel_group, mp.get_pipeline_model_parallel_rank,
           mp.get_pipeline_model_parallel_world_size),
    "dp": (mp.get_data_parallel_group, mp.get_data_parallel_rank,
           mp.get_data_parallel_world_size),
    "cp": (mp.get_context_parallel_group, mp.get_context_parallel_rank,
           mp.get_context_parallel_world_size),
    "tp-pp": (mp.get_model_parallel_group, mp.get_model_parallel_rank,
              mp.get_model_parallel_world_size),
    "tp-cp": (mp.get_tensor_and_context_parallel_group, mp.get_tensor_and_context_parallel_rank,
              mp.get_tensor_and_context_parallel_world_size),
    "tp-dp": (mp.get_tensor_and_data_parallel_group, mp.get_tensor_and_data_parallel_rank,
              mp.get_tensor_and_data_parallel_world_size),
    "ep": (mp.get_expert_model_parallel_group, mp.get_expert_model_parallel_rank,
           mp.get_expert_model_parallel_world_size),
    "etp": (mp.get_expert_tensor_parallel_group, mp.get_expert_tensor_parallel_rank,
            mp.get_expert_tensor_parallel_world_size),
    "edp": (mp.get_expert_data_parallel_group, mp.get_expert_data_parallel_rank,
            mp.get_expert_data_parallel_world_size),
    "tp-ep": (mp.get_expert_tensor_and_model_parallel_group,
              mp.get_expert_tensor_and_model_parallel_rank,
              mp.get_expert_tensor_and_model_parallel_world_size),
    "tp-ep-pp": (mp.get_expert_tensor_model_pipeline_parallel_group,
                 mp.get_expert_tensor_model_pipeline_parallel_rank,
                 mp.get_expert_tensor_model_pipeline_parallel_world_size),
}


def _expected_groups(world_size, cfg):
    dense, expert = mp.make_rank_generators(
        world_size,
        tp=cfg.get("tensor_model_parallel_size", 1),
        pp=cfg.get("pipeline_model_parallel_size", 1),
        cp=cfg.get("context_parallel_size", 1),
        ep=cfg.get("expert_model_parallel_size", 1),
        etp=cfg.get("expert_tensor_parallel_size"),
        order=cfg.get("order", mp.DEFAULT_ORDER),
    )
    gens = {"dense": dense, "expert": expert}
    return {kind: gens[which].get_ranks(tok) for kind, (which, tok) in mp.GROUP_KINDS.items()}


def _check_groups(rank, world_size, configs):
    import torch.distributed as dist

    for cfg in configs:
        mp.initialize_model_parallel(**cfg)
        expected = _expected_groups(world_size, cfg)
        for kind, groups in expected.items():
            mine = next(g for g in groups if rank in g)
            assert mp.get_process_group_ranks(kind) == mine, (cfg, kind)
            group = mp.get_process_group(kind)
            assert dist.get_process_group_ranks(group) == mine, (cfg, kind)
            # the group really connects exactly these ranks: sum of (rank + 1) over members
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=group)
            assert t.item() == sum(r + 1 for r in mine), (cfg, kind, t.item(), mine)
            if kind in GETTERS:
                get_group, get_rank, get_size = GETTERS[kind]
                assert get_group() is group
                assert get_rank() == mine.index(rank) == dist.get_rank(group)
                assert get_size() == len(mine)
        assert mp.get_data_parallel_group(with_context_parallel=True) is mp.get_process_group("dp-cp")
        assert mp.get_tensor_and_data_parallel_world_size(with_context_parallel=True) == len(
            expected["tp-dp-cp"][0]
        )
        assert mp.is_pipeline_first_stage() == (mp.get_pipeline_model_parallel_rank() == 0)
        assert mp.get_tensor_model_parallel_src_rank() == mp.get_process_group_ranks("tp")[0]
        mp.destroy_model_parallel()
        assert not mp.model_parallel_is_initialized()
    return True


@pytest.mark.parametrize("world_size", [4, 8])
def test_groups_match_generators_and_connect_members(world_size):
    assert run_distributed(_check_groups, world_size, CONFIGS[world_size], timeout=300) == [
        True
    ] * world_size


def _misuse(rank, world_size):
    errors = []
    try:
        mp.get_tensor_model_parallel_group()
    except mp.ParallelStateError as exc:
        errors.append(str(exc))
    try:
        mp.initialize_model_parallel(tensor_model_parallel_size=3)
    except ValueError as exc:
        errors.append(str(exc))
    mp.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        mp.initialize_model_parallel(tensor_model_parallel_size=2)
    except mp.ParallelStateError as exc:
        errors.append(str(exc))
    mp.destroy_model_parallel()
    return errors


def test_misuse_raises_clearly():
    errors = run_distributed(_misuse, 2)[0]
    assert "not initialized" in errors[0] and "initialize_model_parallel" in errors[0]
    assert "not divisible by tp*cp*pp = 3*1*1" in errors[1]
    assert "already initialized" in errors[2]


def test_initialize_without_distributed_raises():
    with pytest.raises(mp.ParallelStateError, match="init_process_group"):
        mp.initialize_model_parallel()
