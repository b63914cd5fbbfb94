"""Vocab-parallel cross-entropy on real gloo process groups (tp 2 and 4).

Each rank holds a vocab shard of the same full logits; loss and gradient shard must equal the
float64 ``F.cross_entropy`` on the full logits, the forward must make exactly one collective
(an all-gather of O(rows) bytes) and the backward none. One spawn per world size.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mtp.parallel
import mtp.tensor_parallel
from mtp import settings
from mtp.kernels.cross_entropy import LANES, vector_width
from mtp.ops.cross_entropy import TargetOutOfRangeError, vocab_parallel_cross_entropy
from mtp.parallel.collective_check import ROW_WIDTH
from mtp.parallel.errors import RankMismatchError
from mtp.testing import assert_close, count_collectives, run_distributed
from mtp.testing.traffic import count_traffic
from test_ops_cross_entropy import reference_loss

MAX_BLOCK_V_FWD = LANES * vector_width(torch.float32)

# (dtype, vocab per rank, label_smoothing, z_loss_weight, reduction, extra)
CASES = [
    (torch.float32, 12, 0.0, 0.0, "none", ""),
    (torch.bfloat16, 25, 0.1, 1e-3, "mean", ""),
    (torch.float16, 9, 0.2, 0.0, "sum", "inplace"),
    (torch.float32, MAX_BLOCK_V_FWD + 3, 0.1, 1e-2, "none", ""),  # shard larger than the block
    (torch.float32, 16, 0.0, 0.0, "none", "minus_inf"),  # rows finite only on rank 0's shard
    (torch.float16, 20, 0.0, 0.0, "mean", "huge"),
    (torch.bfloat16, 11, 0.1, 1e-3, "none", "reference"),
]


def _full_inputs(world, v_local, dtype, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = world * v_local
    scale = 3e4 if extra == "huge" else 3.0
    full = (torch.randn(3, 4, vocab, generator=gen) * scale).clamp(-65000, 65000)
    target = torch.randint(0, vocab, (3, 4), generator=gen)
    target[0, ::3] = -100
    if extra == "minus_inf":
        full[1, :, v_local:] = float("-inf")
        target[1] = torch.randint(0, v_local, (4,), generator=gen)
    return full.to(dtype), target


def _run_case(rank, world, group, case, seed):
    dtype, v_local, label_smoothing, z_loss_weight, reduction, extra = case
    full, target = _full_inputs(world, v_local, dtype, extra, seed)
    shard = full[..., rank * v_local:(rank + 1) * v_local].clone()
    kwargs = dict(label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, reduction=reduction)
    leaf = shard.clone().requires_grad_(True)
    logits = leaf * 1 if extra == "inplace" else leaf
    with count_collectives() as forward:
        loss = vocab_parallel_cross_entropy(
            logits, target, group=group, inplace_backward=extra == "inplace",
            backend="reference" if extra == "reference" else "triton", **kwargs,
        )
    assert forward.names() == ["agreement", "all_gather"], forward
    rows = target.numel()
    # the agreement row (int64), then (max, sum-exp, linear term) in fp32 per row and two rows
    # of metadata
    assert forward.nbytes("agreement") == 8 * ROW_WIDTH, forward
    assert forward.nbytes("all_gather") == 12 * (rows + 2), forward
    ref, x64 = reference_loss(full, target, **kwargs)
    assert_close(loss, ref, torch.float32, msg=f"loss {case}")
    dloss = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed + 1))
    with count_collectives() as backward:
        loss.backward(dloss)
    assert backward.count() == 0, backward
    ref.backward(dloss.double())
    expected = x64.grad[..., rank * v_local:(rank + 1) * v_local]
    assert_close(leaf.grad, expected, dtype, msg=f"grad {case}")
    return loss.detach().reshape(-1).tolist()  # plain floats: tensors do not outlive the child


def _megatron_api(rank, world):
    """mtp.tensor_parallel with the tp group of mtp.parallel (tp=2; dp=2 when world is 4)."""
    tp = 2
    mtp.parallel.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        tp_rank = mtp.parallel.get_tensor_model_parallel_rank()
        dp_rank = rank // tp
        v_local = 15
        full, target = _full_inputs(tp, v_local, torch.float32, "", seed=100 + dp_rank)
        target[target == -100] = 0
        shard = full[..., tp_rank * v_local:(tp_rank + 1) * v_local].clone().requires_grad_(True)
        loss = mtp.tensor_parallel.vocab_parallel_cross_entropy(shard, target, 0.1)
        ref, x64 = reference_loss(full, target, label_smoothing=0.1)
        assert_close(loss, ref, torch.float32)
        module = mtp.tensor_parallel.VocabParallelCrossEntropy(label_smoothing=0.1)
        module(shard, target).sum().backward()
        ref.sum().backward()
        assert_close(shard.grad, x64.grad[..., tp_rank * v_local:(tp_rank + 1) * v_local])
    finally:
        mtp.parallel.destroy_model_parallel()


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


def _mismatches(rank, world, group):
    """Ranks that disagree: each one raises a clear error (device check or typed), none hangs."""
    gen = torch.Generator().manual_seed(5)
    target = torch.randint(0, 8 * world, (3, 4), generator=gen)
    out = {}
    for validate in (True, "sync"):
        # uneven vocab shards (8 on rank 0, 9 on the others)
        logits = torch.randn(3, 4, 8 if rank == 0 else 9, generator=gen)
        out[("uneven", validate)] = _outcome(lambda: vocab_parallel_cross_entropy(
            logits, target, group=group, validate=validate, backend="triton"))
        # targets that differ on the last rank
        t = target.clone()
        if rank == world - 1:
            t[1, 2] = (t[1, 2] + 1) % (8 * world)
        x = torch.randn(3, 4, 8, generator=gen).requires_grad_(True)
        out[("targets", validate)] = _outcome(lambda: vocab_parallel_cross_entropy(
            x, t, group=group, validate=validate, backend="triton", reduction="mean"))
        # a target out of range on every rank
        bad = target.clone()
        bad[0, 0] = 8 * world
        out[("range", validate)] = _outcome(lambda: vocab_parallel_cross_entropy(
            torch.randn(3, 4, 8), bad, group=group, validate=validate, backend="triton"))
    # zero rows everywhere: the all-gather still runs (with the metadata), every rank agrees
    empty = torch.randn(0, 8, requires_grad=True)
    with count_collectives() as log:
        loss = vocab_parallel_cross_entropy(empty, torch.zeros(0, dtype=torch.long), group=group,
                                            reduction="sum", backend="triton")
    loss.backward()
    out["empty"] = (log.names(), float(loss.detach()), tuple(empty.grad.shape))
    return out


def _structure(rank, world, group):
    """Launches, aten ops, syncs of fwd / bwd at tp > 1 with the default arguments, and their
    bytes over the floor of two reads of the logits shard and one write of its gradient."""
    gen = torch.Generator().manual_seed(9)
    rows, shard = 16, 1024
    full = torch.randn(rows, shard * world, generator=gen)
    target = torch.randint(0, shard * world, (rows,), generator=gen)
    x = full[:, rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
    settings.configure(poison_outputs=False)  # the NaN fill of outputs is a test-suite extra
    kwargs = dict(group=group, reduction="mean", backend="triton")
    vocab_parallel_cross_entropy(x, target, **kwargs)  # warm-up
    with count_traffic() as fwd, count_collectives() as coll:
        loss = vocab_parallel_cross_entropy(x, target, **kwargs)
    one = torch.ones(())
    with count_traffic() as bwd:
        loss.backward(one)
    floor = 3 * rows * shard * x.element_size()
    return (fwd.num_launches, [a.name for a in fwd.aten], fwd.num_host_syncs, coll.names(),
            bwd.num_launches, [a.name for a in bwd.aten], bwd.num_host_syncs,
            (fwd.bytes_program + bwd.bytes_program) / floor)


def _grad_error(logits, target, fn):
    """max |d mean-loss / d logits - float64| of ``fn`` (full logits in, full gradient out)."""
    x = logits.clone().requires_grad_(True)
    fn(x, target).backward()
    ref = logits.double().requires_grad_(True)
    F.cross_entropy(ref, target).backward()
    return x.grad, ref.grad


def _precision(rank, world, group):
    """(mtp's fp32 gradient error at x30 logits / PyTorch's own, mtp's bf16 gradient's largest
    difference from F.cross_entropy's relative to its largest element) on this rank's shard.

    A gradient computed as exp(x - lse) carries lse's rounding (ulp(lse)) into every element:
    25x PyTorch's fp32 error at x30 logits, and bf16 at tp=2 up to 1.5 % off F.cross_entropy's."""
    out = []
    for dtype, scale in ((torch.float32, 30.0), (torch.bfloat16, 1.0)):
        gen = torch.Generator().manual_seed(7)
        full = (torch.randn(64, 1000, generator=gen) * scale).to(dtype)
        target = torch.randint(0, 1000, (64,), generator=gen)
        cols = slice(rank * 1000 // world, (rank + 1) * 1000 // world)

        def mine(x, t):
            shard = x[:, cols]
            return vocab_parallel_cross_entropy(shard, t, group=group, reduction="mean",
                                                backend="triton")

        g_mtp, g64 = _grad_error(full, target, mine)
        g_torch, _ = _grad_error(full, target, lambda x, t: F.cross_entropy(x, t))
        g_mtp, g_torch, g64 = g_mtp[:, cols].double(), g_torch[:, cols].double(), g64[:, cols]
        if dtype == torch.float32:
            out.append((g_mtp - g64).abs().max().item() / (g_torch - g64).abs().max().item())
        else:
            out.append((g_mtp - g_torch).abs().max().item() / g_torch.abs().max().item())
    return out


def _tp_worker(rank, world):
    # numpy (the Triton interpreter) warns about log(0) and inf - inf on the -inf shards
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    group = dist.new_group(list(range(world)))
    losses = [_run_case(rank, world, group, case, seed=i) for i, case in enumerate(CASES)]
    _megatron_api(rank, world)
    return (losses, _mismatches(rank, world, group), _structure(rank, world, group),
            _precision(rank, world, group))


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_matches_full_cross_entropy(world_size):
    per_rank = run_distributed(_tp_worker, world_size, timeout=300)
    for losses, *_ in per_rank[1:]:
        for mine, first in zip(losses, per_rank[0][0]):
            assert mine == first  # every rank computes the same loss, bit for bit
    for rank, (_, mismatch, structure, precision) in enumerate(per_rank):
        fp32_ratio, bf16_off = precision
        # PyTorch's precision: exp(x - max) / sum, rounded once (was 25x / 1.5 %)
        assert fp32_ratio <= 3.0, (rank, fp32_ratio)
        assert bf16_off <= 2 ** -8, (rank, bf16_off)  # one bf16 rounding of the largest element
        for what in ("uneven", "targets", "range"):
            # default: a device-side check (on CPU torch._assert_async raises at once)
            kind, message = mismatch[(what, True)]
            assert kind == "RuntimeError" and "target" in message, (rank, what, message)
            kind, message = mismatch[(what, "sync")]
            if what == "range":
                assert kind == TargetOutOfRangeError.__name__ and "outside" in message
            else:
                assert kind == RankMismatchError.__name__, (rank, what, kind, message)
                name = "vocab shard size" if what == "uneven" else "target checksum"
                assert name in message and "rank 0" in message, message
        if world_size > 1:
            assert "rank 0 has 8, rank 1 has 9" in mismatch[("uneven", "sync")][1]
        assert mismatch["empty"] == (["agreement", "all_gather"], 0.0, (0, 8))
        # forward: the agreement row's exchange and device-side comparison, 2 kernels + the
        # device-side check, one all-gather; backward: 1 kernel
        agree = ["aten::eq", "aten::all", "aten::_assert_async"]
        assert structure[:-1] == (2, agree + ["aten::_assert_async"], 0,
                                  ["agreement", "all_gather"], 1, [], 0), structure
        # two reads + one write of the shard (the gradient is written in the forward; a unit
        # upstream gradient moves nothing), plus the per-row statistics and targets
        assert 0.99 <= structure[-1] <= 1.10, structure
