"""Clipping and the distributed optimizer on a pipeline-parallel model (gloo, pp=2 and
tp=2 x pp=2 are not mixed here: world 2, pp=2, dp=1; and world 4, pp=2 x dp=2).

Each stage holds its own parameters; ``clip_grad_norm`` and the optimizer's ``clip_grad`` must
count every element once over the stages and give the single-process model's norm, and a few
AdamW steps through :func:`mtp.pipeline.forward_backward_pipelining` must give its parameters.
"""

import copy

import pytest
import torch
from torch import nn

import mtp.parallel as mp
from mtp.optim import DistributedDataParallel, DistributedOptimizer, clip_grad_norm
from mtp.pipeline import forward_backward_pipelining
from mtp.testing import assert_close, run_distributed

H, M, STEPS, CLIP = 8, 4, 3, 0.05
FP32 = {"rtol": 1e-5, "atol": 1e-6}


class Stage(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)) + x)


def _data(step, dp_rank, dp):
    """Microbatches of this data-parallel rank at ``step`` (the global batch is dp of them)."""
    g = torch.Generator().manual_seed(1000 + step)
    xs = [torch.randn(dp, 3, H, generator=g) for _ in range(M)]
    ts = [torch.randn(dp, 3, H, generator=g) for _ in range(M)]
    return [x[dp_rank] for x in xs], [t[dp_rank] for t in ts], xs, ts


def _loss(y, t):
    return ((y - t) ** 2).mean()


def _reference(stages, dp):
    """Single process, whole model, global batch: (norms per step, model after STEPS)."""
    model = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        _, _, xs, ts = _data(step, 0, dp)
        opt.zero_grad()
        losses = [_loss(model(x.reshape(-1, H)), t.reshape(-1, H)) for x, t in zip(xs, ts)]
        (sum(losses) / M).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
    return norms, model


def _worker(rank, world):
    pp = 2
    dp = world // pp
    mp.initialize_model_parallel(pipeline_model_parallel_size=pp)
    pp_rank, dp_rank = mp.get_pipeline_model_parallel_rank(), mp.get_data_parallel_rank()
    pp_group = mp.get_pipeline_model_parallel_group()
    stages = [Stage(seed) for seed in range(pp)]
    norms, ref = _reference(stages, dp)

    # plain clip_grad_norm after one pipelined backward (dp ranks see the same batch here)
    mine = copy.deepcopy(stages[pp_rank])
    xs, ts, _, _ = _data(0, 0, 1)
    forward_backward_pipelining(mine, xs if pp_rank == 0 else None,
                                lambda y, i: _loss(y, ts[i]), num_microbatches=M,
                                pp_group=pp_group)  # fmt: skip
    whole = nn.Sequential(*copy.deepcopy(stages))
    sum(_loss(whole(x), t) for x, t in zip(xs, ts)).div(M).backward()
    want = torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)
    if dp == 1:  # with dp > 1 each dp rank's gradients count on dp rank 0 only: same batch
        got = clip_grad_norm(mine, CLIP)
        assert_close(got, want, **FP32, msg="pp=2 clip_grad_norm")
        for p, q in zip(mine.parameters(), whole[pp_rank].parameters()):
            assert_close(p.grad, q.grad, **FP32, msg="clipped gradient")

    # STEPS clipped AdamW steps with the distributed optimizer (ZeRO-1 over dp)
    model = DistributedDataParallel(copy.deepcopy(stages[pp_rank]), use_distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, clip_grad=CLIP)
    for step in range(STEPS):
        xs, ts, _, _ = _data(step, dp_rank, dp)
        opt.zero_grad()
        with model.no_sync():  # the buckets reduce in step() (finish_grad_sync)
            forward_backward_pipelining(model, xs if pp_rank == 0 else None,
                                        lambda y, i: _loss(y, ts[i]), num_microbatches=M,
                                        pp_group=pp_group)  # fmt: skip
        ok, norm, _ = opt.step()
        assert ok
        assert_close(norm, norms[step], **FP32, msg=f"step {step} norm")
    for p, q in zip(model.module.parameters(), ref[pp_rank].parameters()):
        assert_close(p.detach(), q.detach(), **FP32, msg=f"pp rank {pp_rank} after {STEPS} steps")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_parallel_clipping_and_distributed_optimizer(world):
    assert all(run_distributed(_worker, world, timeout=240))
