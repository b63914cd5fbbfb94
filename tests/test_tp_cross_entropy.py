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

import mtp.parallel
import mtp.tensor_parallel
from mtp.kernels.cross_entropy import MAX_BLOCK_V_FWD
from mtp.ops.cross_entropy import vocab_parallel_cross_entropy
from mtp.testing import assert_close, count_collectives, run_distributed
from test_ops_cross_entropy import reference_loss

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
    assert forward.names() == ["all_gather"], forward
    rows = target.numel()
    assert forward.nbytes() == 12 * rows, forward  # (max, sum-exp, linear term) in fp32 per row
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


def _tp_worker(rank, world):
    # numpy (the Triton interpreter) warns about log(0) and inf - inf on the -inf shards
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    group = dist.new_group(list(range(world)))
    losses = [_run_case(rank, world, group, case, seed=i) for i, case in enumerate(CASES)]
    _megatron_api(rank, world)
    return losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_matches_full_cross_entropy(world_size):
    per_rank = run_distributed(_tp_worker, world_size, timeout=300)
    for losses in per_rank[1:]:
        for mine, first in zip(losses, per_rank[0]):
            assert mine == first  # every rank computes the same loss, bit for bit
