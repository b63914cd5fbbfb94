"""MoELayer at tp=2 x ep=2 (world 4), expert tensor parallel 1 and 2, against a float64
per-token reference written here: top-k weighted sum of the expert MLPs plus the gated shared
expert. Outputs, input gradients and every parameter gradient; the only reduction the test does
is the ordinary data-parallel sum (dense parameters over the data-parallel group, expert
parameters over the expert-data-parallel group): no manual scaling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mtp.parallel as mp
from mtp import settings
from mtp.moe import MoELayer, RankMismatchError
from mtp.moe.experts import fc1_shard_columns
from mtp.testing import assert_close, run_distributed

H, FFN, SHARED, E, K = 8, 8, 6, 4, 2
AUX, SEQ_AUX, ZLOSS = 0.1, 0.2, 0.05
S, B = 8, 2  # per data-parallel replica; sequence split over the 2 TP ranks

CASES = [
    # (expert_tensor_parallel_size, sequence_parallel, capacity_factor, dispatcher, ep)
    (1, True, None, "alltoall", 2),
    (1, False, 1.0, "alltoall", 2),
    (2, True, None, "alltoall", 2),
    (2, False, 1.0, "alltoall", 2),
    (2, True, 1.0, "allgather", 2),
    (2, False, None, "alltoall", 1),  # tp=2, no EP: experts sharded over the TP ranks
]


def _swiglu(h):
    a, g = h.chunk(2, dim=-1)
    return F.silu(a) * g


def _reference_chunk(x, w, capacity_factor):
    """float64 MoE output of one rank's tokens ``x [T, H]`` (capacity computed on them)."""
    logits = x @ w["router"].t()
    top, idx = logits.topk(K, dim=1)
    probs = torch.softmax(top, dim=1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if capacity_factor is not None:
        t = x.shape[0]
        cap = min(math.ceil(t * K / E * capacity_factor), t)
        for e in range(E):
            rows = [
                (float(-probs[i, j]), i, j) for i in range(t) for j in range(K) if idx[i, j] == e
            ]
            for _, i, j in sorted(rows)[cap:]:  # highest probability first, then lower token
                keep[i, j] = False
    out = []
    for i in range(x.shape[0]):
        y = x.new_zeros(H)
        for j in range(K):
            if keep[i, j]:
                e = int(idx[i, j])
                y = y + probs[i, j] * (_swiglu(x[i] @ w["w1"][e]) @ w["w2"][e])
        shared = _swiglu(x[i] @ w["s1"].t()) @ w["s2"].t()
        out.append(y + torch.sigmoid(x[i] @ w["gate"][0]) * shared)
    return torch.stack(out)


def _ref_weights(layer):
    w = dict(
        router=layer.router.weight,
        w1=layer.experts.weight1,
        w2=layer.experts.weight2,
        s1=layer.shared_experts.linear_fc1.weight,
        s2=layer.shared_experts.linear_fc2.weight,
        gate=layer.shared_experts.gate_weight,
    )
    return {k: v.detach().double().requires_grad_(True) for k, v in w.items()}


def _make(**kw):
    return MoELayer(
        H, FFN, E, K, activation="swiglu", shared_expert_intermediate_size=SHARED,
        shared_expert_gate=True, backend="torch", aux_loss_coeff=[AUX, SEQ_AUX],
        load_balancing_type=["aux_loss", "seq_aux_loss"], z_loss_coeff=ZLOSS, **kw,
    )


def _reference_losses(x, w):
    """Load-balancing (Switch + per-sequence) and z-loss of one data-parallel replica's tokens
    ``x [S, B, H]`` (float64)."""
    logits = x @ w["router"].t()
    scores = torch.softmax(logits, dim=-1)
    top = torch.zeros_like(scores).scatter(-1, scores.topk(K, dim=-1).indices, 1.0)
    t = S * B
    aux = AUX * E / (K * t * t) * (scores.sum((0, 1)) * top.sum((0, 1))).sum()
    per_seq = (scores.sum(0) * top.sum(0)).sum()  # sum over sequences b and experts e
    aux = aux + SEQ_AUX * E / (K * S * S) * per_seq / B
    z = ZLOSS * torch.logsumexp(logits, dim=-1).square().mean()
    return aux, z


def _case(etp, sp, cf, dispatcher, ep):
    torch.manual_seed(0)
    ref_layer = _make()  # single process (built before the parallel state exists)
    w = _ref_weights(ref_layer)
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(2, S, B, H, generator=g)  # two data-parallel replicas
    gs = torch.randn(2, S, B, H, generator=g)
    # Reference over every rank's tokens (capacity per rank: each TP rank's sequence chunk).
    ref_out = torch.zeros(2, S, B, H, dtype=torch.float64)
    xd = xs.double().requires_grad_(True)
    ref_losses = []
    for d in range(2):
        aux, z = _reference_losses(xd[d], w)
        ref_losses.append((aux.detach(), z.detach()))
        (aux + z).backward()
        for t in range(2):
            chunk = xd[d, t * S // 2 : (t + 1) * S // 2].reshape(-1, H)
            y = _reference_chunk(chunk, w, cf).view(S // 2, B, H)
            ref_out[d, t * S // 2 : (t + 1) * S // 2] = y.detach()
            (y * gs[d, t * S // 2 : (t + 1) * S // 2].double()).sum().backward()

    mp.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=None if etp == 2 else etp,  # default: tp (= 2)
    )
    try:
        torch.manual_seed(0)
        layer = _make(sequence_parallel=sp, capacity_factor=cf, token_dispatcher_type=dispatcher)
        assert (layer.ep_size, layer.etp_size, layer.tp_size) == (ep, etp, 2)
        d, t = mp.get_data_parallel_rank(), mp.get_tensor_model_parallel_rank()
        rows = slice(t * S // 2, (t + 1) * S // 2) if sp else slice(0, S)
        x = xs[d, rows].clone().requires_grad_(True)
        out = layer(x)
        (out * gs[d, rows]).sum().backward()
        assert_close(out, ref_out[d, rows], torch.float32, atol=1e-5, msg=f"{etp=} {sp=} {cf=} out")
        assert_close(x.grad, xd.grad[d, rows], torch.float32, atol=1e-5, msg="input grad")
        # Each TP rank holds its tokens' share of the replica's auxiliary losses.
        losses = torch.stack([layer.aux_loss, layer.z_loss]).double()
        dist.all_reduce(losses, group=mp.get_tensor_model_parallel_group())
        assert_close(losses, torch.stack(ref_losses[d]), torch.float32, msg="aux / z losses")
        # Ordinary data-parallel gradient sums, nothing else.
        dense = [layer.router.weight, *layer.shared_experts.parameters()]
        for p in dense:
            dist.all_reduce(p.grad, group=mp.get_data_parallel_group())
        for p in layer.experts.parameters():
            dist.all_reduce(p.grad, group=mp.get_expert_data_parallel_group())
        tol = dict(atol=1e-5)
        assert_close(layer.router.weight.grad, w["router"].grad, torch.float32, **tol, msg="router")
        sh = layer.shared_experts
        shared = (
            (sh.linear_fc1.weight, "s1"), (sh.linear_fc2.weight, "s2"), (sh.gate_weight, "gate")
        )
        for got, name in shared:
            assert_close(got.grad, w[name].grad, torch.float32, **tol, msg=f"shared {name} grad")
        first = layer.local_expert_indices[0]
        ex = layer.experts
        cols = fc1_shard_columns(FFN, "swiglu", ex.tp_size, ex.tp_rank)
        feat = slice(ex.tp_rank * FFN // ex.tp_size, (ex.tp_rank + 1) * FFN // ex.tp_size)
        experts = slice(first, first + layer.num_local_experts)
        full_w1 = ref_layer.experts.weight1.detach()
        assert torch.equal(ex.weight1.detach(), full_w1[experts][:, :, cols])
        w1_grad, w2_grad = w["w1"].grad[experts][:, :, cols], w["w2"].grad[experts][:, feat]
        assert_close(ex.weight1.grad, w1_grad, torch.float32, **tol, msg="w1 grad")
        assert_close(ex.weight2.grad, w2_grad, torch.float32, **tol, msg="w2 grad")
    finally:
        mp.destroy_model_parallel()


def _mismatch():
    """Ranks of the EP group disagree on the dtype (dropless) / token count (capacity): every
    rank raises RankMismatchError naming the values instead of dying inside gloo."""
    mp.initialize_model_parallel(expert_model_parallel_size=4)
    try:
        rank = dist.get_rank()
        for cf, x in (
            (None, torch.randn(6, H, dtype=torch.float16 if rank == 1 else torch.float32)),
            (1.0, torch.randn(6 + (rank == 2), H)),
        ):
            torch.manual_seed(0)
            layer = MoELayer(H, FFN, E, K, capacity_factor=cf, backend="torch").to(x.dtype)
            with pytest.raises(RuntimeError, match="dtype|token count") as info:
                layer(x)
            if cf is None:  # dropless: checked at its one host sync, values named
                assert info.type is RankMismatchError
                assert "rank 1" in str(info.value) or "rank 2" in str(info.value)
            else:  # capacity: a device-side assert (no sync); the sync mode names the values
                assert "ranks [0, 1, 2, 3]" in str(info.value)
                with settings.override(validate="sync"):
                    layer.token_dispatcher.check_ranks = True
                    with pytest.raises(RankMismatchError, match="rank 2: 7"):
                        layer(x)
    finally:
        mp.destroy_model_parallel()


def _worker(rank, world):
    for case in CASES:
        _case(*case)
    _mismatch()
    return True


def test_tp2_ep2_matches_float64_reference():
    assert all(run_distributed(_worker, 4, timeout=240))
