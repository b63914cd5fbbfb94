"""Model-parallel RNG (Megatron-LM appendix B.2): dropout outside a tensor-parallel region is
identical on every rank, inside it differs per tp rank (and per expert rank for the expert
stream); the tracker's fork/get/set; checkpoint() repeats masks on recompute."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mtp.parallel as mp
import mtp.tensor_parallel as tp
from mtp.parallel import random as mp_random
from mtp.testing import run_distributed


@pytest.fixture(autouse=True)
def _fresh_rng():
    state = torch.get_rng_state()
    mp.get_cuda_rng_tracker().reset()
    yield
    mp.get_cuda_rng_tracker().reset()
    torch.set_rng_state(state)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def _rng_main(rank: int, world: int) -> str:
    mp.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    mp.model_parallel_manual_seed(1234)
    tracker = mp.get_cuda_rng_tracker()
    ones = torch.ones(64)

    outside = _gather(F.dropout(ones, p=0.5))
    with tracker.fork():
        inside = _gather(F.dropout(ones, p=0.5))
    with tracker.fork(mp.EXPERT_PARALLEL_RNG_TRACKER_NAME):
        expert = _gather(torch.rand(16))
    assert mp.get_process_group_ranks("tp") == ([0, 1] if rank < 2 else [2, 3])

    # outside any region: the same mask everywhere
    for other in outside[1:]:
        assert torch.equal(other, outside[0])
    # inside: different masks on the two tp ranks, the same on data-parallel replicas (0 / 2)
    assert not torch.equal(inside[0], inside[1])
    assert torch.equal(inside[0], inside[2]) and torch.equal(inside[1], inside[3])
    assert not torch.equal(inside[0], outside[0])
    # expert stream: a different stream on every (ep, etp) rank pair
    for i in range(world):
        for j in range(i):
            assert not torch.equal(expert[i], expert[j]), (i, j)

    # a ParallelSelfAttention's attention dropout is drawn from the tp stream: the default
    # generator (replicated activations) is left where it was
    attn = tp.ParallelSelfAttention(8, 4, attention_dropout=0.5, dtype=torch.float64)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    before = torch.get_rng_state()
    states = tracker.get_states()
    y1 = attn(x)
    assert torch.equal(torch.get_rng_state(), before)
    tracker.set_states(states)
    assert torch.equal(attn(x), y1)  # same stream state -> same mask
    y3 = attn(x)
    assert not torch.equal(y3, y1)  # the stream advanced
    attn.eval()
    no_drop = tp.ParallelSelfAttention(8, 4, dtype=torch.float64)
    no_drop.load_state_dict(attn.state_dict())
    assert torch.equal(attn(x), no_drop(x))
    mp.destroy_model_parallel()
    return "ok"


def test_dropout_inside_and_outside_tensor_parallel_regions():
    assert run_distributed(_rng_main, 4) == ["ok"] * 4


# --------------------------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _draw(seed: int, n: int = 8, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(n, generator=g, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_seeds_follow_megatron(device):
    mp.model_parallel_manual_seed(42)  # single process: tp = ep = etp rank 0
    tracker = mp.get_cuda_rng_tracker()

    def rand():
        return torch.rand(8, device=device)

    assert torch.equal(rand(), _draw(42, device=device))
    with tracker.fork():
        assert torch.equal(rand(), _draw(42 + 2718, device=device))
    with tracker.fork(mp.EXPERT_PARALLEL_RNG_TRACKER_NAME):
        assert torch.equal(rand(), _draw(42 + 1024, device=device))
    mp.model_parallel_manual_seed(42, tp_rank=3, ep_rank=2, etp_rank=1)
    with tracker.fork():
        assert torch.equal(rand(), _draw(42 + 2718 + 3, device=device))
    with tracker.fork("expert-parallel-rng"):
        assert torch.equal(rand(), _draw(42 + 1024 + 200 + 1, device=device))
    assert mp.model_parallel_cuda_manual_seed is mp.model_parallel_manual_seed


def test_fork_advances_its_stream_and_leaves_the_default_alone():
    tracker = mp.RNGStatesTracker()
    tracker.add("a", 7)
    torch.manual_seed(0)
    expected_default = torch.rand(2, 8)
    torch.manual_seed(0)
    first = torch.rand(8)
    with tracker.fork("a"):
        inside_1 = torch.rand(8)
    with tracker.fork("a"):
        inside_2 = torch.rand(8)
    second = torch.rand(8)
    assert torch.equal(torch.stack([first, second]), expected_default)
    assert torch.equal(torch.cat([inside_1, inside_2]), _draw(7, 16))
    # get/set states replays the stream
    states = tracker.get_states()
    with tracker.fork("a"):
        again = torch.rand(8)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(8), again)
    # an exception inside the block still restores the default generator
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    with pytest.raises(RuntimeError, match="boom"), tracker.fork("a"):
        torch.rand(100)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(4), expected)


def test_tracker_errors():
    tracker = mp.RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="model_parallel_manual_seed"), tracker.fork("missing"):
        pass
    assert tracker.is_initialized()
    tracker.reset()
    assert not tracker.is_initialized()


def _dropout_net(weight: torch.Tensor, x: torch.Tensor, calls: list) -> torch.Tensor:
    calls.append(1)
    h = F.dropout(x @ weight, p=0.3)  # default stream
    with mp.get_cuda_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p=0.3)  # tp stream
    return (h * h).sum(-1)


def _run(use_checkpoint: bool, device: str = "cpu"):
    mp.model_parallel_manual_seed(11)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 6, dtype=torch.float64, generator=g).to(device).requires_grad_(True)
    x = torch.randn(5, 6, dtype=torch.float64, generator=g).to(device).requires_grad_(True)
    calls: list = []
    if use_checkpoint:
        out = mp.checkpoint(_dropout_net, weight, x, calls)
    else:
        out = _dropout_net(weight, x, calls)
    torch.rand(3, device=device)  # other randomness between forward and backward
    with mp.get_cuda_rng_tracker().fork():
        torch.rand(3, device=device)
    out.sum().backward()
    default = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    after = (default, mp.get_cuda_rng_tracker().get_states())
    return out.detach(), weight.grad, x.grad, len(calls), after


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_repeats_dropout_masks(device):
    out, gw, gx, calls, (state, tracked) = _run(False, device)
    out_c, gw_c, gx_c, calls_c, (state_c, tracked_c) = _run(True, device)
    assert calls == 1 and calls_c == 2  # the checkpointed function was recomputed
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)
    torch.testing.assert_close(gw_c, gw, rtol=0, atol=0)
    torch.testing.assert_close(gx_c, gx, rtol=0, atol=0)
    # the recompute did not disturb the run's random streams
    assert torch.equal(state_c, state)
    assert tracked_c.keys() == tracked.keys()
    for name in tracked:
        for kind in tracked[name]:
            assert torch.equal(tracked_c[name][kind], tracked[name][kind]), (name, kind)


def test_checkpoint_without_restoring_would_differ():
    """Sanity check that the test above can fail: plain torch checkpoint does not restore the
    tracker's stream, so the recomputed tp-stream mask differs and the gradients are wrong."""
    mp.model_parallel_manual_seed(11)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 6, dtype=torch.float64, generator=g).requires_grad_(True)
    x = torch.randn(5, 6, dtype=torch.float64, generator=g)
    out = torch.utils.checkpoint.checkpoint(_dropout_net, weight, x, [], use_reentrant=False)
    out.sum().backward()
    _, gw, _, _, _ = _run(use_checkpoint=False)
    assert not torch.allclose(weight.grad, gw)


def test_model_parallel_seed_needs_groups_in_a_multi_rank_job(monkeypatch):
    monkeypatch.setattr(mp_random.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mp_random.dist, "get_world_size", lambda *a: 2)
    with pytest.raises(mp.ParallelStateError, match="initialize_model_parallel"):
        mp.model_parallel_manual_seed(1)
