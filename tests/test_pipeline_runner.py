"""The pipeline runner under gloo gives the loss and every gradient of the single-process model
(1F1B and interleaved, pp = 2 and 4, tp = 2 x pp = 2, a stage holding a MoELayer)."""

import copy

import pytest
import torch
from torch import nn

from mtp.pipeline import forward_backward_pipelining
from mtp.testing import run_distributed

H = 8


class Stage(nn.Module):
    def __init__(self, h=H, dtype=torch.float64):
        super().__init__()
        self.lin = nn.Linear(h, h, dtype=dtype)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class MoEStage(nn.Module):
    def __init__(self):
        super().__init__()
        from mtp.moe import MoELayer

        self.moe = MoELayer(H, 12, num_experts=4, topk=2, aux_loss_coeff=0.01)

    def forward(self, x):
        return x + self.moe(x)


def make_data(m, seed, dtype=torch.float64, shape=(3, 2, H)):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g, dtype=dtype) for _ in range(m)]
    ts = [torch.randn(shape, generator=g, dtype=dtype) for _ in range(m)]
    return xs, ts


def reference(stages, xs, ts):
    """Single process: the stages in sequence, loss averaged over microbatches."""
    model = nn.Sequential(*copy.deepcopy(stages))
    model.zero_grad()
    losses = [((model(x) - t) ** 2).sum() for x, t in zip(xs, ts)]
    (sum(losses) / len(losses)).backward()
    return [loss.detach() for loss in losses], model


def check_case(rank, pp, vpp, m, group, stages, xs, ts, tol, tensor_shape=None, pp_group=None):
    ref_losses, ref_model = reference(stages, xs, ts)
    mine = [copy.deepcopy(stages[c * pp + rank]) for c in range(vpp)]
    refs = [ref_model[c * pp + rank] for c in range(vpp)]
    losses = forward_backward_pipelining(
        mine if vpp > 1 else mine[0],
        xs if rank == 0 else None,
        lambda y, i: ((y - ts[i]) ** 2).sum(),
        num_microbatches=m,
        pp_group=pp_group,
        microbatch_group_size_per_vp_stage=group,
        tensor_shape=tensor_shape,
        dtype=xs[0].dtype if tensor_shape else None,
    )
    what = f"pp={pp} vpp={vpp} m={m} rank={rank}"
    if rank == pp - 1:
        assert len(losses) == m, what
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)
    else:
        assert losses == [], what
    for chunk, ref in zip(mine, refs):
        for (name, p), q in zip(chunk.named_parameters(), ref.parameters()):
            assert p.grad is not None, (what, name)
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=f"{what} {name}")


def check_graphed_case(rank, pp, vpp, m):
    from mtp.graphs import GraphedLayer, make_graphed_callables
    from mtp.pipeline import get_pipeline_order

    torch.manual_seed(5)
    stages = [nn.Sequential(Stage(), Stage()) for _ in range(pp * vpp)]
    xs, ts = make_data(m, seed=21)
    ref_losses, ref_model = reference(stages, xs, ts)
    mine = [copy.deepcopy(stages[c * pp + rank]) for c in range(vpp)]
    layers = [layer for chunk in mine for layer in chunk]
    sample = (torch.zeros(3, 2, H, dtype=torch.float64, requires_grad=True),)
    graphs, plan, _ = make_graphed_callables(
        layers, [sample] * len(layers), order=get_pipeline_order(pp, rank, m, vpp),
        num_layers_per_chunk=[2] * vpp)
    chunks = [nn.Sequential(*[GraphedLayer(layers[i], graphs[i]) for i in (2 * c, 2 * c + 1)])
              for c in range(vpp)]
    losses = forward_backward_pipelining(
        chunks, xs if rank == 0 else None, lambda y, i: ((y - ts[i]) ** 2).sum(),
        num_microbatches=m, microbatch_group_size_per_vp_stage=2 if vpp > 1 else None)
    what = f"graphed pp={pp} vpp={vpp} rank={rank}"
    if rank == pp - 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), msg=what)
    for c, chunk in enumerate(mine):
        for p, q in zip(chunk.parameters(), ref_model[c * pp + rank].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=what)
    assert all(g.fwd_graph.replays == 1 and g.bwd_graph.replays == 1 for row in graphs for g in row)
    assert plan.num_slots < m * vpp or m * vpp <= 2


def _pp_main(rank, world):
    torch.manual_seed(0)
    if world == 2:  # (vpp, microbatches, group, tensor_shape)
        cases = [(1, 3, None, None), (2, 4, None, None), (2, 6, 3, (3, 2, H)), (3, 4, 2, None)]
    else:
        cases = [(1, 6, None, (3, 2, H)), (2, 8, 4, None)]
    for vpp, m, group, shape in cases:
        stages = [Stage() for _ in range(world * vpp)]
        xs, ts = make_data(m, seed=vpp * 100 + m)
        check_case(rank, world, vpp, m, group, stages, xs, ts, 1e-10, shape)
    # forward only: the same losses, no gradients
    stages = [Stage() for _ in range(world * 2)]
    xs, ts = make_data(4, seed=9)
    ref_losses, _ = reference(stages, xs, ts)
    mine = [copy.deepcopy(stages[c * world + rank]) for c in range(2)]
    losses = forward_backward_pipelining(
        mine, xs if rank == 0 else None, lambda y, i: ((y - ts[i]) ** 2).sum(),
        num_microbatches=4, forward_only=True)
    if rank == world - 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    assert all(p.grad is None for c in mine for p in c.parameters())
    if world == 2:  # a MoE layer in a stage (float32)
        torch.manual_seed(1)
        stages = [Stage(dtype=torch.float32), MoEStage(), Stage(dtype=torch.float32), MoEStage()]
        xs, ts = make_data(4, seed=7, dtype=torch.float32, shape=(5, H))
        check_case(rank, 2, 1, 4, None, stages[:2], xs, ts, 2e-5)
        check_case(rank, 2, 2, 4, 2, stages, xs, ts, 2e-5)
    if world == 2:  # chunks of graphed layers (CPU stand-in), captured in this rank's order
        check_graphed_case(rank, 2, 1, 4)
        check_graphed_case(rank, 2, 2, 4)
    if world == 4:  # tp=2 x pp=2 in the same processes (one spawn less)
        _tp_pp_case(rank, world)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_single_process(world):
    """pp=world (1F1B, interleaved, forward-only; a MoE stage at pp=2; tp=2 x pp=2 at 4)."""
    assert run_distributed(_pp_main, world, timeout=150) == ["ok"] * world


def _tp_pp_case(rank, world):
    from mtp import parallel
    from mtp.tensor_parallel import ParallelMLP

    parallel.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp_rank = parallel.get_tensor_model_parallel_rank()
    pp_group = parallel.get_pipeline_model_parallel_group()
    pp_rank = parallel.get_pipeline_model_parallel_rank()
    torch.manual_seed(0)
    ffn = 12
    refs = [nn.Sequential(nn.Linear(H, ffn, dtype=torch.float64), nn.GELU(),
                          nn.Linear(ffn, H, dtype=torch.float64)) for _ in range(4)]
    m, vpp = 4, 2
    xs, ts = make_data(m, seed=3)
    ref_losses, _ = reference(refs, xs, ts)
    ref_model = nn.Sequential(*copy.deepcopy(refs))
    ref_model.zero_grad()
    (sum(((ref_model(x) - t) ** 2).sum() for x, t in zip(xs, ts)) / m).backward()

    class TPStage(nn.Module):
        def __init__(self, ref):
            super().__init__()
            self.mlp = ParallelMLP(H, ffn, dtype=torch.float64, perform_initialization=False)
            sl = slice(tp_rank * ffn // 2, (tp_rank + 1) * ffn // 2)
            with torch.no_grad():
                self.mlp.linear_fc1.weight.copy_(ref[0].weight[sl])
                self.mlp.linear_fc1.bias.copy_(ref[0].bias[sl])
                self.mlp.linear_fc2.weight.copy_(ref[2].weight[:, sl])
                self.mlp.linear_fc2.bias.copy_(ref[2].bias)
            self.sl = sl

        def forward(self, x):
            return self.mlp(x)

    chunks = [TPStage(refs[c * 2 + pp_rank]) for c in range(vpp)]
    losses = forward_backward_pipelining(
        chunks, xs if pp_rank == 0 else None, lambda y, i: ((y - ts[i]) ** 2).sum(),
        num_microbatches=m, pp_group=pp_group, microbatch_group_size_per_vp_stage=2)
    if pp_rank == 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for c, chunk in enumerate(chunks):
        ref = ref_model[c * 2 + pp_rank]
        sl = chunk.sl
        torch.testing.assert_close(chunk.mlp.linear_fc1.weight.grad, ref[0].weight.grad[sl])
        torch.testing.assert_close(chunk.mlp.linear_fc1.bias.grad, ref[0].bias.grad[sl])
        torch.testing.assert_close(chunk.mlp.linear_fc2.weight.grad, ref[2].weight.grad[:, sl])
        torch.testing.assert_close(chunk.mlp.linear_fc2.bias.grad, ref[2].bias.grad)
    parallel.destroy_model_parallel()


def test_runner_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model_chunks"):
        forward_backward_pipelining([], [], lambda y, i: y.sum(), num_microbatches=1)
    with pytest.raises(TypeError, match="loss_func"):
        forward_backward_pipelining(Stage(), [], None, num_microbatches=1)
    with pytest.raises(ValueError, match="inputs has 1"):
        forward_backward_pipelining(Stage(), [torch.zeros(1, H)], lambda y, i: y.sum(),
                                    num_microbatches=2)


@pytest.mark.slow  # torchrun start-up: ~30 s on the 2-core CI machine
def test_pipeline_example_runs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "examples" / "pipeline_train.py"), "--vpp", "2", "--check", "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: |loss - ref|" in proc.stdout
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
