"""The MoE layer's nested configuration, its groups as one ParallelDims value, and the
dispatchers' explicit metadata."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mtp.moe import (
    AllGatherTokenDispatcher,
    AllToAllDispatchMetadata,
    AllToAllTokenDispatcher,
    DispatcherConfig,
    ExpertsConfig,
    MoEConfig,
    MoELayer,
    RouterConfig,
)
from mtp.parallel import ParallelDims


def _config(**kw) -> MoEConfig:
    return MoEConfig(
        hidden_size=8,
        router=RouterConfig(4, 2, score_function="sigmoid", aux_loss_coeff=0.01),
        experts=ExpertsConfig(12, activation="swiglu", bias=True),
        dispatcher=DispatcherConfig(4, 2),
        **kw,
    )


def test_flat_keywords_build_the_same_config():
    flat = dict(score_function="sigmoid", aux_loss_coeff=0.01, activation="swiglu", bias=True)
    assert MoEConfig.from_flat(8, 12, 4, 2, **flat) == _config()
    torch.manual_seed(0)
    a = MoELayer(8, 12, 4, 2, **flat)
    torch.manual_seed(0)
    b = MoELayer(config=_config())
    assert a.config == b.config and repr(a.dims) == repr(b.dims) == repr(ParallelDims())
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name
    x = torch.randn(5, 8)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_configs_are_frozen_and_checked_where_made():
    cfg = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 4
    with pytest.raises(ValueError, match="topk=5 must be <= num_experts=4"):
        RouterConfig(4, 5)
    with pytest.raises(ValueError, match="activation"):
        ExpertsConfig(8, activation="silu")
    with pytest.raises(ValueError, match="token_dispatcher_type"):
        DispatcherConfig(4, 2, token_dispatcher_type="a2a")
    with pytest.raises(ValueError, match="router.capacity_factor"):
        MoEConfig(8, RouterConfig(4, 2, capacity_factor=1.0), ExpertsConfig(8),
                  DispatcherConfig(4, 2))
    with pytest.raises(TypeError, match="unexpected keyword"):
        MoEConfig.from_flat(8, 8, 4, 2, topk_group=1)
    with pytest.raises(TypeError, match="not both"):
        MoELayer(8, config=cfg)
    with pytest.raises(TypeError, match="dims must be a ParallelDims"):
        MoELayer(config=cfg, dims=object())


def test_parallel_dims_without_groups():
    dims = ParallelDims()
    assert (dims.tp, dims.ep, dims.etp, dims.dp, dims.pp) == (1, 1, 1, 1, 1)
    assert dims.ep_group is None and dims.ep_rank == 0
    assert ParallelDims(ep=1).ep == 1
    with pytest.raises(ValueError, match="ep=2 but ep_group has 1 rank"):
        ParallelDims(ep=2)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(TypeError, match="etp_group"):
        ParallelDims(etp_group="world")
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.ep = 2


def test_dispatchers_take_a_config_and_dims_or_the_flat_form():
    new = AllToAllTokenDispatcher(DispatcherConfig(4, 2, capacity_factor=1.5), ParallelDims())
    old = AllToAllTokenDispatcher(None, 4, 2, capacity_factor=1.5)
    assert new.config == old.config and new.local_expert_indices == [0, 1, 2, 3]
    gather = AllGatherTokenDispatcher(DispatcherConfig(4, 2), dims=ParallelDims())
    assert gather.num_local_experts == 4
    with pytest.raises(TypeError, match="dims"):
        AllToAllTokenDispatcher(DispatcherConfig(4, 2), 4, 2)


@pytest.mark.parametrize("kind", [AllToAllTokenDispatcher, AllGatherTokenDispatcher])
def test_dispatch_hands_combine_a_frozen_metadata_value(kind):
    dispatcher = kind(DispatcherConfig(4, 2, backend="reference"), ParallelDims())
    x = torch.randn(6, 8)
    probs = torch.rand(6, 4)
    routing_map = torch.zeros(6, 4, dtype=torch.bool)
    routing_map[torch.arange(6), torch.arange(6) % 4] = True
    routing_map[torch.arange(6), (torch.arange(6) + 1) % 4] = True
    probs = probs * routing_map
    rows, counts, pprobs, meta = dispatcher.dispatch(x, probs, routing_map)
    assert dataclasses.is_dataclass(meta) and meta.__dataclass_params__.frozen
    assert not any(isinstance(v, dict) for v in vars(dispatcher).values())  # no state dict
    # two dispatches in flight, combined in the other order: each metadata is its own
    rows2, _, pprobs2, meta2 = dispatcher.dispatch(2 * x, probs, routing_map)
    out2 = dispatcher.combine(rows2 * pprobs2[:, None], meta2)
    out = dispatcher.combine(rows * pprobs[:, None], meta)
    expected = (probs.unsqueeze(-1) * x.unsqueeze(1)).sum(1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out2, 2 * expected)
    assert counts.sum() == 12
    with pytest.raises(TypeError, match="metadata"):
        dispatcher.combine(rows, None)
    if kind is AllToAllTokenDispatcher:
        assert isinstance(meta, AllToAllDispatchMetadata)
    # Megatron-Core's stateful names keep working
    tokens, _, p = dispatcher.token_permutation(x, probs, routing_map)
    out3, bias = dispatcher.token_unpermutation(tokens * p[:, None])
    torch.testing.assert_close(out3, expected)
    assert bias is None
