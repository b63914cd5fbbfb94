"""mtp.optim on one process: the index ranges and bytes-per-parameter table, the loss
scaler, the optimizer at d=1 (ZeRO layout and the unsharded mixed-precision path) against plain
PyTorch, checkpoints and full state dicts without torch.distributed, and bad input."""

import itertools

import pytest
import torch
from optim_helpers import BUCKET, batch, loss_fn, make_net, reference_train
from torch import nn

from mtp.optim import (
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    ParamAndGradBuffer,
    Range,
    bytes_per_parameter_formula,
    clip_grad_norm,
    get_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    param_range_map,
    save_checkpoint,
)
from mtp.testing import assert_close, count_host_syncs

FP32 = {"rtol": 1e-6, "atol": 1e-7}


def _train(model, opt, steps, start=0, dtype=torch.float32, scale=False):
    out = []
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model(x.to(dtype)), y)
        (opt.scale_loss(loss) if scale else loss).backward()
        out.append(opt.step())
    return out


def test_seed_index_ranges():
    # The ZeRO-1 picture: 16 fp16 elements over 4 data-parallel ranks, 4 parameters laid out
    # green (3), yellow (5), blue (6), red (2) in the buffer, i.e. the reverse of model order.
    sizes = {"green": 3, "yellow": 5, "blue": 6, "red": 2}
    params = {k: nn.Parameter(torch.zeros(n, dtype=torch.float16)) for k, n in sizes.items()}
    model_order = [params[k] for k in ("red", "blue", "yellow", "green")]
    buf = ParamAndGradBuffer(
        model_order, torch.float16, None, None, param_buffer=False, data_parallel_size=4
    )
    assert buf.numel == 16 and len(buf.buckets) == 1 and buf.buckets[0].shard_size == 4
    yellow = params["yellow"]
    r0 = param_range_map(buf, 0)[yellow]
    r1 = param_range_map(buf, 1)[yellow]
    assert (r0["gbuf_world"], r0["gbuf_local"], r0["param"]) == (
        Range(3, 4),
        Range(3, 4),
        Range(0, 1),
    )
    assert (r1["gbuf_world"], r1["gbuf_local"], r1["param"]) == (
        Range(4, 8),
        Range(0, 4),
        Range(1, 5),
    )
    assert yellow not in param_range_map(buf, 2)
    # every element of every parameter is owned by exactly one rank
    for p in model_order:
        owned = sorted(
            (m[p]["param"].start, m[p]["param"].end)
            for m in (param_range_map(buf, r) for r in range(4))
            if p in m
        )
        assert owned[0][0] == 0 and owned[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(owned))
    # buckets close at >= 6 elements, never split a parameter, each padded to a multiple of 4:
    # reversed order extra 1, green 3, yellow 5 | blue 6 | red 2
    extra = nn.Parameter(torch.zeros(1, dtype=torch.float16))
    buf = ParamAndGradBuffer(
        model_order + [extra], torch.float16, None, 6, param_buffer=True, data_parallel_size=4
    )
    assert [(b.offset, b.numel) for b in buf.buckets] == [(0, 12), (12, 8), (20, 4)]
    assert [len(b.params) for b in buf.buckets] == [3, 1, 1]
    assert buf.param_index[params["red"]] == Range(20, 22)
    buf = ParamAndGradBuffer(
        model_order,
        torch.float16,
        None,
        6,
        param_buffer=False,
        data_parallel_size=4,
        pad_buckets_to=6,
    )  # lcm(4, 6) = 12: green + yellow, blue, red
    assert [(b.offset, b.numel) for b in buf.buckets] == [(0, 12), (12, 12), (24, 12)]
    with pytest.raises(ValueError, match="pad_buckets_to"):
        ParamAndGradBuffer(
            model_order, torch.float16, None, 6, param_buffer=False, pad_buckets_to=0
        )


def test_bytes_per_parameter_table():
    f16, f32 = torch.float16, torch.float32
    # 20 / 18 / 16 bytes without ZeRO; 4 + 16/d, 6 + 12/d, 8 + 8/d with it
    for d in (1, 2, 4, 8):
        assert bytes_per_parameter_formula(f16, f16, "adam", d) == 4 + 16 / d
        assert bytes_per_parameter_formula(f16, f32, "adam", d) == 6 + 12 / d
        assert bytes_per_parameter_formula(f32, f32, "adam", d) == 8 + 8 / d
    assert bytes_per_parameter_formula(f16, f16, "adam", 1) == 20
    assert bytes_per_parameter_formula(torch.bfloat16, f32, "sgd", 2) == 6 + 4 / 2
    with pytest.raises(ValueError, match="optimizer"):
        bytes_per_parameter_formula(f16, f16, "lamb")


@pytest.mark.parametrize(
    "dtype,fp32_grads,want",
    [(torch.float32, False, 16.0), (torch.bfloat16, True, 18.0), (torch.float16, False, 20.0)],
)
def test_measured_bytes_d1(dtype, fp32_grads, want):
    model = DistributedDataParallel(
        make_net(dtype=dtype),
        use_distributed_optimizer=True,
        accumulate_allreduce_grads_in_fp32=fp32_grads,
        bucket_size=BUCKET,
    )
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-3)
    _train(model, opt, 1, dtype=dtype)
    assert opt.bytes_per_parameter() == want, opt.memory_bytes()


@pytest.mark.parametrize("sharded", [True, False])
def test_mixed_precision_d1_matches_master_weights(sharded):
    ref = make_net(dtype=torch.bfloat16)
    master = [p.detach().float().clone() for p in ref.parameters()]
    reference_train(ref, torch.optim.AdamW(master, lr=1e-2), 3, master=master, clip=0.05)
    model = DistributedDataParallel(
        make_net(dtype=torch.bfloat16),
        use_distributed_optimizer=sharded,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=BUCKET,
    )
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2, clip_grad=0.05)
    _train(model, opt, 3, dtype=torch.bfloat16)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)  # same fp32 math on one process: bit-identical


def test_plain_ddp_with_torch_optimizer_and_clip_grad_norm():
    ref = make_net()
    norms = reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 2, clip=0.05)
    model = DistributedDataParallel(make_net(), bucket_size=BUCKET)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        model.zero_grad_buffer()
        loss_fn(model(x), y).backward()
        model.finish_grad_sync()
        assert all(p.grad is not None for p in model.parameters())
        assert_close(clip_grad_norm(model, 0.05), norms[step], rtol=1e-6, atol=0)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, **FP32)


def test_loss_scaler_policy():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    seq = []
    for inf in (True, True, True, True, False, False, False, False):
        s.update(inf)
        seq.append(float(s.scale))
    # hysteresis 2: the first overflow is tolerated; then halve down to min_scale; growth after
    # 2 clean steps, which also resets hysteresis
    assert seq == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0]
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert float(t.scale) == 8.0
    assert_close(s.scale_loss(torch.tensor(0.5)), torch.tensor(4.0))
    for bad in (
        {"initial_scale": 0.0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.5},
        {"hysteresis": 0},
    ):
        with pytest.raises(ValueError):
            DynamicLossScaler(**bad)


def test_fp16_overflow_skips_step():
    model = DistributedDataParallel(make_net(dtype=torch.float16), use_distributed_optimizer=True)
    opt = DistributedOptimizer(
        torch.optim.AdamW,
        model,
        lr=1e-2,
        grad_scaler=DynamicLossScaler(initial_scale=2.0**40, hysteresis=1),
    )
    before = [p.detach().clone() for p in model.parameters()]
    ((ok, _, _),) = _train(model, opt, 1, dtype=torch.float16, scale=True)  # 2^40 overflows fp16
    assert not ok and float(opt.grad_scaler.scale) == 2.0**39
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.grad_scaler.load_state_dict(
        {"scale": torch.tensor(256.0), "growth_tracker": 0, "hysteresis_tracker": 1}
    )
    ((ok, _, _),) = _train(model, opt, 1, dtype=torch.float16, scale=True)
    assert ok and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_checkpoint_and_full_state_dict_single_process(tmp_path):
    ref = make_net()
    reference_train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3)
    model = DistributedDataParallel(make_net(), use_distributed_optimizer=True, bucket_size=BUCKET)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=1e-2)
    _train(model, opt, 2)
    save_checkpoint(str(tmp_path), model, opt, extra=2)
    model2 = DistributedDataParallel(
        make_net(seed=3), use_distributed_optimizer=True, bucket_size=BUCKET
    )
    opt2 = DistributedOptimizer(torch.optim.AdamW, model2, lr=1e-2)
    assert load_checkpoint(str(tmp_path), model2, opt2) == 2
    _train(model2, opt2, 1, start=2)
    for p, q in zip(model2.parameters(), ref.parameters()):
        assert_close(p, q, **FP32)
    # the per-rank state_dict (same layout) round-trips too
    model3 = DistributedDataParallel(make_net(), use_distributed_optimizer=True, bucket_size=BUCKET)
    opt3 = DistributedOptimizer(torch.optim.AdamW, model3, lr=1e-2)
    model3.load_state_dict(model.state_dict())
    opt3.reload_model_params()
    opt3.load_state_dict(opt.state_dict())
    _train(model3, opt3, 1, start=2)
    for p, q in zip(model3.parameters(), ref.parameters()):
        assert_close(p, q, **FP32)
    full = get_full_state_dict(model2)
    assert list(full) == list(ref.state_dict())
    plain = make_net(seed=4)
    load_full_state_dict(plain, full)
    for p, q in zip(plain.parameters(), ref.parameters()):
        assert_close(p, q, **FP32)
    with pytest.raises(ValueError, match="missing"):
        load_full_state_dict(plain, {"fc1.weight": full["fc1.weight"]})


def test_bad_input():
    with pytest.raises(TypeError, match="module"):
        DistributedDataParallel(lambda x: x)
    frozen = make_net()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        DistributedDataParallel(frozen)
    with pytest.raises(ValueError, match="bucket_size"):
        DistributedDataParallel(make_net(), bucket_size=0)
    net = make_net()
    with pytest.raises(TypeError, match="model must be"):
        DistributedOptimizer(torch.optim.AdamW, net, lr=1e-3)
    model = DistributedDataParallel(net, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="clip_grad"):
        DistributedOptimizer(torch.optim.AdamW, model, clip_grad=-1.0)
    with pytest.raises(TypeError, match="optimizer"):
        DistributedOptimizer("adamw", model)
    other = torch.optim.SGD(make_net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not a trainable parameter"):
        DistributedOptimizer(other, model)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        clip_grad_norm(model, 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(make_net(), 0.0)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm(make_net(), 1.0, norm_type=-1)
    mixed = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dtype"):
        ParamAndGradBuffer(mixed, torch.float32, None, None, param_buffer=False)


def test_backward_after_sync_needs_zero_grad_buffer():
    model = DistributedDataParallel(make_net(), use_distributed_optimizer=True)
    x, y = batch(0)
    loss_fn(model(x), y).backward()
    model.finish_grad_sync()
    with pytest.raises(RuntimeError, match="zero_grad_buffer"):
        loss_fn(model(x), y).backward()
    model.zero_grad_buffer()
    loss_fn(model(x), y).backward()  # fine again


def test_no_host_sync_without_loss_scaler():
    # backward hooks, reduction, clipping, step and all-gather never read a value on the host
    # (SGD: torch's Adam reads its CPU step counter, which is not a device sync on a GPU)
    model = DistributedDataParallel(
        make_net(dtype=torch.bfloat16),
        use_distributed_optimizer=True,
        accumulate_allreduce_grads_in_fp32=True,
        bucket_size=BUCKET,
    )
    opt = DistributedOptimizer(torch.optim.SGD, model, lr=1e-2, momentum=0.9, clip_grad=0.05)
    with count_host_syncs() as syncs:
        results = _train(model, opt, 2, dtype=torch.bfloat16)
    assert syncs.count == 0, syncs
    assert all(ok is True and norm.dim() == 0 for ok, norm, _ in results)
