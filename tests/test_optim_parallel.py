"""The distributed optimizer with tensor and expert parallelism, and checkpoint resharding.

World 4 (one spawned job): tp=2 x dp=2 (clipping on a plain ``parallelize()``d model and inside
the distributed optimizer, both equal to torch's single-process norm; 5 clipped steps equal the
single-process run shard by shard, replicated parameters bit-identical across TP ranks; the full
state dict equals the single-process ``state_dict()`` and loads back), then tp=1 x dp=4 with
ep=2 (an MoE layer trained with expert parameters sharded over the expert-data-parallel group,
against one process holding every expert; fp16 loss scaling skipping a step when one rank
overflows; the measured bytes per parameter at d=4; checkpoints saved). World 2 (a second job):
the dp=4 checkpoint loaded at dp=2 continues exactly as the uninterrupted single-process run; a
tp=2 checkpoint is refused at tp=1.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from optim_helpers import BUCKET, batch, local_rows, loss_fn, make_net, reference_train

import mtp.parallel as mp
from mtp.moe import MoELayer
from mtp.optim import (
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    bytes_per_parameter_formula,
    clip_grad_norm,
    get_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from mtp.tensor_parallel import parallelize
from mtp.tensor_parallel.utils import shard
from mtp.testing import assert_close, run_distributed

FP32 = {"rtol": 1e-6, "atol": 1e-7}
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # column fc1, row fc2


# fc1's output features (fc2's input features) in two blocks, each split over TP on its own
# (the layout of a fused weight); full state dicts must put the blocks back in order
TP_PLAN = {"fc1": {"style": "column", "stride": 2}, "fc2": {"style": "row", "stride": 2}}


def _local_of(name, full, tp_rank, tp):
    if name in SPLIT and tp > 1:
        dim = SPLIT[name]
        n = full.size(dim)
        blocks = [n // 2, n // 2]
        return shard(full, dim, blocks, tp_rank, tp)
    return full


def _compare_tp(net, ref, tp_rank, tp, what):
    for (name, p), (rname, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert name == rname
        assert_close(
            p.detach(), _local_of(name, q.detach(), tp_rank, tp), msg=f"{what}: {name}", **FP32
        )


def _tp2_dp2(rank, world, ckpt_tp):
    mp.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank, dp_rank = mp.get_tensor_model_parallel_rank(), mp.get_data_parallel_rank()
    # clip_grad_norm on a plain parallelize()d model (full batch everywhere) == torch's norm
    ref, net = make_net(), parallelize(make_net(), TP_PLAN)
    x, y = batch(0)
    loss_fn(ref(x), y).backward()
    loss_fn(net(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    got = clip_grad_norm(net, 0.05)
    assert_close(got, want, rtol=1e-6, atol=0, msg="plain tp=2 norm")
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(
            p.grad, _local_of(name, q.grad, tp_rank, 2), msg=f"clipped grad {name}", **FP32
        )
    # 5 clipped AdamW steps with the distributed optimizer at tp=2 x dp=2
    ref = make_net()
    norms = reference_train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 5, clip=0.05)
    net = parallelize(make_net(), TP_PLAN)
    model = DistributedDataParallel(net, use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, clip_grad=0.05)
    for step in range(5):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model(local_rows(x, dp_rank, 2)), local_rows(y, dp_rank, 2)).backward()
        ok, norm, _ = opt.step()
        assert ok
        assert_close(norm, norms[step], rtol=1e-6, atol=0, msg=f"step {step} norm")
    _compare_tp(net, ref, tp_rank, 2, "tp2 x dp2")
    tp_group = mp.get_tensor_model_parallel_group()
    for name, p in net.named_parameters():
        if name not in SPLIT:  # replicated over TP: bit-identical on both TP ranks
            both = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(both, p.detach().contiguous(), group=tp_group)
            assert torch.equal(both[0], both[1]), name
    # full state dict == single-process state_dict(); loads back into another TP model
    full = get_full_state_dict(model)
    assert list(full) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert_close(full[k], v, msg=f"full state dict {k}", **FP32)
    net2 = parallelize(make_net(seed=7), TP_PLAN)
    model2 = DistributedDataParallel(net2, use_distributed_optimizer=True, bucket_size=BUCKET)
    opt2 = DistributedOptimizer(torch.optim.AdamW, model2, lr=1e-2)
    load_full_state_dict(model2, full if rank == 0 else None, src=0, optimizer=opt2)
    for p, q in zip(net2.parameters(), net.parameters()):
        assert torch.equal(p, q)
    save_checkpoint(ckpt_tp, model, opt)
    dist.barrier()
    mp.destroy_model_parallel()


H, FFN, E, TOPK, T = 8, 6, 4, 2, 6


def _moe_data(step, r):
    g = torch.Generator().manual_seed(50 * step + r)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def _ep2_dp4(rank, world, solo):
    ep_rank = mp.get_expert_model_parallel_rank()
    assert mp.get_expert_data_parallel_world_size() == 2
    torch.manual_seed(0)
    ref = MoELayer(H, FFN, E, TOPK, backend="torch", ep_group=solo)
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, E, TOPK, backend="torch")
    assert layer.experts.num_local_experts == E // 2
    model = DistributedDataParallel(layer, use_distributed_optimizer=True, bucket_size=None)
    kinds = sorted((b.is_expert, dist.get_world_size(b.group)) for b in model.buffers)
    assert kinds == [(False, 4), (True, 2)], kinds
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        ropt.zero_grad()
        sum(F.mse_loss(ref(x), y) for x, y in (_moe_data(step, r) for r in range(world))).div(
            world
        ).backward()
        ropt.step()
        opt.zero_grad()
        x, y = _moe_data(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert_close(layer.router.weight, ref.router.weight, msg="router", **FP32)
    mine = slice(ep_rank * (E // 2), (ep_rank + 1) * (E // 2))
    for name in ("weight1", "weight2"):
        got, want = getattr(layer.experts, name), getattr(ref.experts, name)[mine]
        assert_close(got, want, msg=f"experts.{name}", **FP32)
    full = get_full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert_close(full[k], v, msg=f"moe full state dict {k}", **FP32)


def _fp16_overflow(rank, world):
    model = DistributedDataParallel(
        make_net(dtype=torch.float16), use_distributed_optimizer=True, bucket_size=BUCKET
    )
    scaler = DynamicLossScaler(initial_scale=2.0**10, hysteresis=1)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, grad_scaler=scaler)
    results = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model(local_rows(x, rank, world).half()), local_rows(y, rank, world))
        if step == 1 and rank == world - 1:
            loss = loss * float("inf")  # one rank overflows: every rank must skip
        opt.scale_loss(loss).backward()
        ok, _, _ = opt.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        results.append((ok, changed, float(scaler.scale)))
    assert results == [(True, True, 1024.0), (False, False, 512.0), (True, True, 512.0)], results


def _bytes_d4(rank, world):
    out = []
    for dtype, fp32_grads in (
        (torch.float32, False),
        (torch.bfloat16, True),
        (torch.bfloat16, False),
    ):
        model = DistributedDataParallel(
            make_net(dtype=dtype),
            use_distributed_optimizer=True,
            accumulate_allreduce_grads_in_fp32=fp32_grads,
            bucket_size=BUCKET,
        )
        opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-3)
        x, y = batch(0)
        opt.zero_grad()
        loss_fn(model(local_rows(x, rank, world).to(dtype)), local_rows(y, rank, world)).backward()
        opt.step()
        grad_dtype = torch.float32 if fp32_grads else dtype
        assert opt.bytes_per_parameter() == bytes_per_parameter_formula(
            dtype, grad_dtype, "adam", 4
        )
        out.append(opt.bytes_per_parameter())
    return out


def _train_dense(model, opt, steps, rank, world, start=0, dtype=torch.float32):
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model(local_rows(x, rank, world).to(dtype)), local_rows(y, rank, world)).backward()
        opt.step()


def _main_pieces(opt):
    # plain lists: tensors returned from a child would need it alive (shared-memory fds)
    return [(e.name, e.ranges["param"].start, e.main_param.detach().tolist()) for e in opt.shards]


def _build(dtype=torch.float32, seed=0):
    model = DistributedDataParallel(
        make_net(dtype=dtype, seed=seed),
        use_distributed_optimizer=True,
        accumulate_allreduce_grads_in_fp32=dtype != torch.float32,
        bucket_size=BUCKET,
    )
    return model, DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, clip_grad=0.05)


def _world4_worker(rank, world, ckpt, ckpt_bf16, ckpt_tp):
    _tp2_dp2(rank, world, ckpt_tp)
    solo = None
    for r in range(world):  # every rank creates every group
        g = dist.new_group([r])
        solo = g if r == rank else solo
    mp.initialize_model_parallel(expert_model_parallel_size=2)
    _ep2_dp4(rank, world, solo)
    _fp16_overflow(rank, world)
    out = {"bytes": _bytes_d4(rank, world)}
    model, opt = _build()
    _train_dense(model, opt, 2, rank, world)
    opt.param_groups[0]["lr"] = 5e-3  # restored by load_checkpoint
    save_checkpoint(ckpt, model, opt, extra={"step": 2})
    model, opt = _build(torch.bfloat16)
    _train_dense(model, opt, 2, rank, world, dtype=torch.bfloat16)
    save_checkpoint(ckpt_bf16, model, opt)
    out["bf16_mains"] = _main_pieces(opt)
    out["bf16_params"] = [p.detach().float().tolist() for p in model.parameters()]
    mp.destroy_model_parallel()
    return out


def _world2_worker(rank, world, ckpt, ckpt_bf16, ckpt_tp):
    mp.initialize_model_parallel()
    model, opt = _build(seed=123)
    assert load_checkpoint(ckpt, model, opt) == {"step": 2}
    assert opt.param_groups[0]["lr"] == 5e-3
    _train_dense(model, opt, 2, rank, world, start=2)
    ref = make_net()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    reference_train(ref, ropt, 2, clip=0.05)
    ropt.param_groups[0]["lr"] = 5e-3
    reference_train(ref, ropt, 2, start=2, clip=0.05)
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), msg=f"resumed at dp=2: {name}", **FP32)
    model, opt = _build(torch.bfloat16, seed=9)
    load_checkpoint(ckpt_bf16, model, opt)
    out = {
        "bf16_mains": _main_pieces(opt),
        "bf16_params": [p.detach().float().tolist() for p in model.parameters()],
    }
    try:
        load_checkpoint(ckpt_tp, *_build())
    except ValueError as exc:
        assert "parallel sizes" in str(exc), exc
    else:
        raise AssertionError("a tp=2 checkpoint was loaded at tp=1")
    mp.destroy_model_parallel()
    return out


def _full_mains(results):
    full = {}
    for r in results:
        for name, start, t in r["bf16_mains"]:
            full.setdefault(name, {})[start] = t
    return {n: [v for s in sorted(d) for v in d[s]] for n, d in full.items()}


def test_tp_ep_clipping_state_dicts_and_checkpoint_resharding(tmp_path):
    dirs = [str(tmp_path / n) for n in ("dp4", "dp4_bf16", "tp2")]
    four = run_distributed(_world4_worker, 4, *dirs, timeout=300)
    assert four[0]["bytes"] == [10.0, 9.0, 8.0]  # 8 + 8/4, 6 + 12/4, 4 + 16/4
    two = run_distributed(_world2_worker, 2, *dirs, timeout=240)
    # the bf16 run's fp32 main parameters and bf16 parameters survive dp=4 -> dp=2 exactly
    saved, loaded = _full_mains(four), _full_mains(two)
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert saved[name] == loaded[name], name
    assert four[0]["bf16_params"] == two[1]["bf16_params"]
