"""The distributed optimizer at dp=2 (gloo, world 2) against single-process PyTorch.

One spawned job checks, in order: AdamW and SGD (fp32, to 1e-6), gradient accumulation over 3
micro-batches, bf16 parameters with fp32 gradient accumulation (within bf16 rounding), the
collectives of a step (one reduce-scatter and one all-gather per bucket, reduce-scatters started
by the backward hooks before backward reaches the first layer), clipping, the measured bytes per
parameter at d=2, models with a frozen, an unused and a shared parameter, and (tp=2) sequence
parallelism, whose replicated parameters' gradients are summed over the TP group.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from optim_helpers import (
    BUCKET,
    TP_PLAN,
    batch,
    local_rows,
    loss_fn,
    make_net,
    reference_train,
)

import mtp.parallel as mp
from mtp.optim import (
    DistributedDataParallel,
    DistributedOptimizer,
    bytes_per_parameter_formula,
)
from mtp.tensor_parallel import parallelize
from mtp.testing import assert_close, count_collectives, run_distributed

STEPS = 3


def _rs_ag(log):
    rs = sum(log.count(n) for n in ("reduce_scatter_single", "reduce_scatter_tensor"))
    ag = sum(log.count(n) for n in ("all_gather_single", "all_gather_into_tensor"))
    return rs, ag


def _train(model, opt, steps, rank, world, *, start=0, micro=1, dtype=torch.float32):
    """The mtp loop: zero, (no_sync) micro-batches, step. Returns the step results."""
    results = []
    for step in range(start, start + steps):
        x, y = batch(step)
        x, y = local_rows(x, rank, world), local_rows(y, rank, world)
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if i < micro - 1:
                with model.no_sync():
                    (loss_fn(model(xm.to(dtype)), ym) / micro).backward()
            else:
                (loss_fn(model(xm.to(dtype)), ym) / micro).backward()
        results.append(opt.step())
    return results


def _compare(model, ref, what, **tol):
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), msg=f"{what}: {name}", **tol)


def _check_optimizers(rank, world):
    fp32 = {"rtol": 1e-6, "atol": 1e-7}
    for name, cls, kw in (
        ("adamw", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        ("sgd", torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}),
    ):
        ref = make_net()
        reference_train(ref, cls(ref.parameters(), **kw), STEPS)
        model = DistributedDataParallel(
            make_net(), use_distributed_optimizer=True, bucket_size=BUCKET
        )
        opt = DistributedOptimizer(cls, model, **kw)
        _train(model, opt, STEPS, rank, world)
        _compare(model, ref, name, **fp32)
    # parameter all-gathers left running after step(), waited for by the forward pre-hooks
    ref = make_net()
    reference_train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), STEPS)
    model = DistributedDataParallel(make_net(), use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, overlap_param_gather=True)
    _train(model, opt, STEPS, rank, world)
    assert all(b.param_work is not None for b in model.buckets)  # still in flight
    opt.finish_param_sync()
    _compare(model, ref, "overlap_param_gather", **fp32)
    # an optimizer instance with two param groups is mapped onto the shards
    ref = make_net()
    groups = lambda m: [
        {"params": [m.fc1.weight, m.fc2.weight, m.head.weight], "weight_decay": 0.1},
        {"params": [m.fc1.bias, m.fc2.bias, m.head.bias], "weight_decay": 0.0, "lr": 2e-2},
    ]
    reference_train(ref, torch.optim.AdamW(groups(ref), lr=1e-2), STEPS)
    net = make_net()
    model = DistributedDataParallel(net, use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW(groups(net), lr=1e-2), model)
    _train(model, opt, STEPS, rank, world)
    _compare(model, ref, "adamw param groups", **fp32)
    # gradient accumulation over 3 micro-batches (no_sync on the first two)
    ref = make_net()
    reference_train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), STEPS, micro=3, clip=None)
    model = DistributedDataParallel(make_net(), use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    x, y = batch(0)
    x, y = local_rows(x, rank, world), local_rows(y, rank, world)
    opt.zero_grad()
    with count_collectives() as log, model.no_sync():
        loss_fn(model(x[:1]), y[:1]).backward()
    assert log.count() == 0, f"no collective under no_sync, got {log.names()}"
    _train(model, opt, STEPS, rank, world, micro=3)
    _compare(model, ref, "accumulation", **fp32)


def _check_bf16(rank, world):
    ref = make_net(dtype=torch.bfloat16)
    master = [p.detach().float().clone() for p in ref.parameters()]
    reference_train(ref, torch.optim.AdamW(master, lr=1e-2), STEPS, master=master)
    model = DistributedDataParallel(
        make_net(dtype=torch.bfloat16),
        use_distributed_optimizer=True,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=BUCKET,
    )
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    _train(model, opt, STEPS, rank, world, dtype=torch.bfloat16)
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        # one bf16 ulp: the gradients are summed in another order than the reference's
        assert_close(p.detach().float(), q.detach().float(), rtol=8e-3, atol=8e-3, msg=name)
    # fp32 main params: the fp32 master weights of the reference, to fp32-with-bf16-grads accuracy
    mains = {id(e.param): e for e in opt.shards}
    for p, m in zip(model.module.parameters(), master):
        e = mains.get(id(p))
        if e is not None:
            r = e.ranges["param"]
            assert_close(e.main_param.detach(), m.view(-1)[r.start : r.end], rtol=2e-2, atol=2e-3)


def _check_collectives_and_order(rank, world):
    model = DistributedDataParallel(make_net(), use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    buckets = len(model.buckets)
    assert buckets == 3, model.buckets
    seen = {}

    def on_fc1_output(module, args, out):
        # runs when backward reaches fc1's output, before fc1's weight gradient exists
        def record(grad):
            seen.setdefault("before_fc1", _rs_ag(log)[0])

        out.register_hook(record)

    handle = model.module.fc1.register_forward_hook(on_fc1_output)
    x, y = batch(0)
    opt.zero_grad()
    with count_collectives() as log:
        loss_fn(model(local_rows(x, rank, world)), local_rows(y, rank, world)).backward()
        after_backward = _rs_ag(log)
        opt.step()
    handle.remove()
    assert seen["before_fc1"] == 2, f"head/fc2 buckets must start during backward: {seen}"
    assert after_backward == (3, 0), after_backward
    assert _rs_ag(log) == (buckets, buckets), log.names()
    others = [n for n in log.names() if "reduce_scatter" not in n and "all_gather" not in n]
    assert others == [], others
    # without overlap the reduce-scatters wait for finish_grad_sync (inside step)
    model2 = DistributedDataParallel(
        make_net(), use_distributed_optimizer=True, bucket_size=BUCKET, overlap_grad_reduce=False
    )
    opt2 = DistributedOptimizer(torch.optim.SGD, model2, lr=0.1)
    opt2.zero_grad()
    with count_collectives() as log:
        loss_fn(model2(local_rows(x, rank, world)), local_rows(y, rank, world)).backward()
        assert _rs_ag(log) == (0, 0)
        opt2.step()
    assert _rs_ag(log) == (3, 3)


def _check_clip(rank, world):
    ref = make_net()
    norms = reference_train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), STEPS, clip=0.05)
    model = DistributedDataParallel(make_net(), use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, clip_grad=0.05)
    results = _train(model, opt, STEPS, rank, world)
    for (_, got, _), want in zip(results, norms):
        assert_close(got, want, rtol=1e-6, atol=0)
    assert float(norms[0]) > 0.05  # clipping happened
    _compare(model, ref, "clipped", rtol=1e-6, atol=1e-7)


def _check_bytes(rank, world):
    cases = [
        (torch.float32, False, torch.optim.AdamW, "adam", {}),
        (torch.bfloat16, True, torch.optim.AdamW, "adam", {}),
        (torch.bfloat16, False, torch.optim.AdamW, "adam", {}),
        (torch.float16, False, torch.optim.SGD, "sgd_momentum", {"momentum": 0.9}),
    ]
    out = []
    for dtype, fp32_grads, cls, kind, kw in cases:
        model = DistributedDataParallel(
            make_net(dtype=dtype),
            use_distributed_optimizer=True,
            accumulate_allreduce_grads_in_fp32=fp32_grads,
            bucket_size=BUCKET,
        )
        opt = DistributedOptimizer(cls, model, lr=1e-3, **kw)
        _train(model, opt, 1, rank, world, dtype=dtype)
        grad_dtype = torch.float32 if fp32_grads else dtype
        want = bytes_per_parameter_formula(dtype, grad_dtype, kind, world)
        got = opt.bytes_per_parameter()
        assert got == want, (dtype, fp32_grads, kind, got, want, opt.memory_bytes())
        out.append(got)
    return out


def _check_odd_models(rank, world):
    # frozen + unused + shared parameter: frozen gets no buffer and never changes; the unused
    # one gets a zero gradient (as the reference, which gives it zeros); shared counted once.
    def build():
        net = make_net(tie=True, unused=True)
        net.fc1.bias.requires_grad_(False)
        return net

    ref = build()
    frozen0 = ref.fc1.bias.detach().clone()
    reference_train(
        ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2), STEPS
    )
    net = build()
    model = DistributedDataParallel(net, use_distributed_optimizer=True, bucket_size=BUCKET)
    assert all(p is not net.fc1.bias for buf in model.buffers for p in buf.params)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    _train(model, opt, STEPS, rank, world)
    assert torch.equal(net.fc1.bias, frozen0)
    _compare(model, ref, "frozen/unused/shared", rtol=1e-6, atol=1e-7)
    # a dtype mix: one buffer per dtype, both trained
    mixed = make_net()
    mixed.head.to(torch.float64)
    ref = copy.deepcopy(mixed)
    model = DistributedDataParallel(mixed, use_distributed_optimizer=True, bucket_size=BUCKET)
    assert sorted(str(b.param_dtype) for b in model.buffers) == ["torch.float32", "torch.float64"]
    opt = DistributedOptimizer(torch.optim.SGD, model, lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def forward(m, x):
        return m.head(F.gelu(m.fc2(F.gelu(m.fc1(x)))).double())

    for step in range(2):
        x, y = batch(step)
        ropt.zero_grad()
        loss_fn(forward(ref, x), y).backward()
        ropt.step()
        opt.zero_grad()
        loss_fn(forward(mixed, local_rows(x, rank, world)), local_rows(y, rank, world)).backward()
        opt.step()
    for (name, p), q in zip(mixed.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), dtype=torch.float32, rtol=1e-6, atol=1e-7, msg=name)
    # a second backward without no_sync is refused with a clear error
    opt.zero_grad()
    x, y = batch(0)
    loss_fn(forward(mixed, local_rows(x, rank, world)), local_rows(y, rank, world)).backward()
    try:
        loss_fn(forward(mixed, local_rows(x, rank, world)), local_rows(y, rank, world)).backward()
    except RuntimeError as exc:
        assert "no_sync" in str(exc)
    else:
        raise AssertionError("second backward without no_sync was accepted")
    model.finish_grad_sync()


def _check_sequence_parallel(rank, world):
    # tp=2 with sequence parallelism: the replicated parameters (head, fc2.bias) see half of the
    # rows on each rank; finish_grad_sync sums their gradients over the TP group.
    ref = make_net()
    reference_train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), STEPS)
    net = parallelize(make_net(), TP_PLAN, sequence_parallel=True)
    model = DistributedDataParallel(net, use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        out = model(local_rows(x, rank, world))
        (loss_fn(out, local_rows(y, rank, world)) / world).backward()
        opt.step()
    split = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        want = q.detach()
        if name in split:
            want = want.chunk(world, split[name])[rank]
        assert_close(p.detach(), want, msg=f"sequence parallel {name}", rtol=1e-6, atol=1e-7)


def _dp2_worker(rank, world):
    mp.initialize_model_parallel()
    assert mp.get_data_parallel_world_size() == world
    _check_optimizers(rank, world)
    _check_bf16(rank, world)
    _check_collectives_and_order(rank, world)
    _check_clip(rank, world)
    out = _check_bytes(rank, world)
    _check_odd_models(rank, world)
    dist.barrier()
    mp.destroy_model_parallel()
    mp.initialize_model_parallel(tensor_model_parallel_size=2)
    _check_sequence_parallel(rank, world)
    mp.destroy_model_parallel()
    return out


def test_distributed_optimizer_dp2_matches_single_process():
    out = run_distributed(_dp2_worker, 2, timeout=240)
    # fp32/fp32 Adam 8 + 8/2; bf16 + fp32 grads 6 + 12/2; bf16/bf16 4 + 16/2; fp16 SGD-momentum
    assert out[0] == [12.0, 12.0, 12.0, 2 + 2 + (4 + 4 + 4) / 2]
