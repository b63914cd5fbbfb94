"""DeviceMesh interop at tp=2 x dp=2 (gloo, CPU): ``group=`` takes a DeviceMesh dimension,
``get_device_mesh`` reuses mtp's groups, and mtp layers train under FSDP2 ``fully_shard`` on
the data-parallel dimension exactly like the single-process model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mtp.testing import run_distributed

IN, HID, BATCH, LR = 8, 16, 4, 0.1


def _reference(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, IN))


def _batch(dp_rank: int) -> torch.Tensor:
    return torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(100 + dp_rank))


def _worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mtp.parallel import get_device_mesh, initialize_model_parallel
    from mtp.parallel import get_data_parallel_rank, get_tensor_model_parallel_group
    from mtp.tensor_parallel import parallelize

    initialize_model_parallel(tensor_model_parallel_size=2)
    mesh = get_device_mesh(("dp", "tp"))
    same_groups = mesh["tp"].get_group() is get_tensor_model_parallel_group()
    # group= accepts the mesh dimension; a 2-D mesh is refused with a clear error
    try:
        parallelize(_reference(), {"0": "column", "2": "row"}, group=mesh)
        refused = False
    except ValueError as exc:
        refused = "mesh['tp']" in str(exc)
    # torch's ColwiseParallel / RowwiseParallel plan objects give the same shards
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dtensor_style = parallelize(
        _reference(), {"0": ColwiseParallel(), "2": RowwiseParallel()}, group=mesh["tp"]
    )
    model = parallelize(_reference(), {"0": "column", "2": "row"}, group=mesh["tp"])
    same_shards = all(
        torch.equal(a, b) for a, b in zip(dtensor_style.parameters(), model.parameters())
    )
    strides = (model[0].bias.partition_stride, model[2].bias.partition_stride)
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = _batch(get_data_parallel_rank())
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    # every TP shard after the step, gathered over dp by FSDP2 (DTensor.full_tensor)
    local = {n: p.full_tensor().detach().tolist() for n, p in model.named_parameters()}
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    return same_groups, refused, same_shards, strides, local, [float(v) for v in losses]


def test_mtp_layers_under_fsdp2_fully_shard_tp2_dp2():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 fully_shard not available in this torch")
    results = run_distributed(_worker, 4, timeout=180)
    ref = _reference()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    dp_losses = [ref(_batch(d)).pow(2).mean() for d in range(2)]
    (sum(dp_losses) / 2).backward()  # FSDP2 averages the gradients over dp
    opt.step()
    full = dict(ref.named_parameters())
    for rank, (same_groups, refused, same_shards, strides, local, losses) in enumerate(results):
        assert same_groups and refused and same_shards
        assert strides == (1, 1)
        tp_rank = rank % 2  # default order tp-cp-ep-dp-pp: tp fastest
        for d in range(2):
            torch.testing.assert_close(losses[2 * d], float(dp_losses[d]), rtol=1e-6, atol=0)
        expected = {
            "0.weight": full["0.weight"].chunk(2, 0)[tp_rank],
            "0.bias": full["0.bias"].chunk(2, 0)[tp_rank],
            "2.weight": full["2.weight"].chunk(2, 1)[tp_rank],
            "2.bias": full["2.bias"],
        }
        for name, value in expected.items():
            got = torch.tensor(local[name])
            torch.testing.assert_close(got, value.detach(), rtol=1e-5, atol=1e-6)
