"""Composition property test: parallelisms together give the single-process answer.

A tiny transformer built from mtp's layers (vocab-parallel embedding, attention, dense MLP, a
MoE block with a gated shared expert, the vocab-parallel loss or the fused linear loss) is
compared with a float64 single-process model written in plain PyTorch (``compose_model.py``),
whose full weights the test cuts into each rank's shards itself. Configurations are drawn from
a seeded generator over tensor / expert / expert-tensor parallel sizes, sequence parallelism,
the dispatcher, top-k, capacity, a rank whose experts get no token, the optimizer path (DDP with
``clip_grad_norm`` and ``torch.optim.AdamW``; the distributed optimizer, sharded or not) and
micro-batches, at worlds 2 and 4. Compared on every rank: the loss, every gradient element
(the shard this rank holds, or owns under the distributed optimizer), the global gradient norm,
the parameters after two clipped AdamW steps and the full state dict
(``get_full_state_dict``, then ``load_full_state_dict`` back). Tolerances are a multiple of
PyTorch's own float32 error on the same model (the reference run in float32 against float64).

A fast subset runs in the default suite; the whole drawn set is marked ``slow``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from compose_model import (
    B,
    CLIP,
    EPS,
    LR,
    WD,
    Config,
    batch,
    build_mtp_model,
    coordinates,
    reference_run,
    shard,
)
from mtp.testing import assert_close, own_error_atol, run_distributed

FACTOR = 16  # allowed error: this many times PyTorch's own float32 error (plus a floor)


def _layouts(world):
    """Every valid (tp, ep, etp) at ``world`` (experts E=4, heads 4, expert features 8)."""
    out = []
    for tp in (1, 2, 4):
        for ep in (1, 2, 4):
            for etp in (1, 2, 4):
                if world % tp or world % (ep * etp) or tp > world:
                    continue
                out.append((tp, ep, etp))
    return out


def draw_configs(world: int, n: int, seed: int) -> list[Config]:
    """``n`` configurations at ``world`` from ``random.Random(seed)`` (every layout once first)."""
    rng = random.Random(seed)
    layouts = _layouts(world)
    rng.shuffle(layouts)
    out = []
    for i in range(n):
        tp, ep, etp = layouts[i % len(layouts)]
        dispatcher = rng.choice(["alltoall", "allgather"])
        capacity = rng.choice([None, None, 1.0, 1.5])
        out.append(Config(
            world=world, tp=tp, ep=ep, etp=etp, sp=tp > 1 and rng.random() < 0.7,
            dispatcher=dispatcher, topk=rng.choice([1, 2]), capacity=capacity,
            zero_token=ep > 1 and rng.random() < 0.4,
            optim=rng.choice(["ddp", "distopt", "mixed"]), fused_loss=rng.random() < 0.4,
            micro_batches=rng.choice([1, 1, 2]), seed=rng.randrange(1000),
        ))  # fmt: skip
    return out


# The default suite's subset: every kind of parallelism and each defect of
# tests/test_compose_regressions.py at least once
FAST = [
    Config(2, tp=2, ep=1, etp=2, sp=True, optim="ddp", micro_batches=2, seed=1),
    Config(2, tp=2, ep=2, etp=1, sp=True, dispatcher="allgather", capacity=1.0,
           zero_token=True, optim="distopt", fused_loss=True, seed=2),
    Config(2, tp=1, ep=2, etp=1, topk=1, optim="mixed", seed=3),
    Config(4, tp=2, ep=2, etp=2, sp=True, capacity=1.5, optim="distopt", seed=4),
    Config(4, tp=2, ep=2, etp=1, sp=False, zero_token=True, optim="ddp", fused_loss=True,
           seed=5),
]
SLOW = draw_configs(2, 12, 28) + draw_configs(4, 20, 280)


def _tol(ref64: dict, ref32: dict, key: str) -> dict:
    """Per-tensor absolute tolerance: FACTOR x float32 PyTorch's error, at least a few ulps."""
    out = {}
    for name, want in ref64[key].items():
        floor = 4 * 2.0**-23 * float(want.abs().max())
        out[name] = own_error_atol(ref32[key][name], want, FACTOR, floor=floor) + 1e-12
    return out


def _np(d: dict) -> dict:
    return {k: v.numpy() for k, v in d.items()}


def _expected(cfg: Config) -> dict:
    r64, r32 = reference_run(cfg), reference_run(cfg, torch.float32)
    last = {"params": r64["params"][-1]}
    ce_err = max(abs(a - b) for a, b in zip(r64["ce"], r32["ce"]))
    norm_err = max(abs(a - b) / a for a, b in zip(r64["norm"], r32["norm"]))
    assert min(r64["norm"]) > CLIP, "clipping must be active for the test to check the norm"
    return {
        "ce": r64["ce"], "norm": r64["norm"], "grads": _np(r64["grads"]),
        "params": _np(last["params"]), "first": _np(r64["params"][0]),
        "grad_tol": _tol(r64, r32, "grads"),
        "param_tol": _tol(last, {"params": r32["params"][-1]}, "params"),
        "ce_tol": FACTOR * max(ce_err, 1e-7), "norm_rtol": FACTOR * max(norm_err, 1e-7),
    }  # fmt: skip


def _grads_of(cfg, ddp, opt, c):
    """``{name: (local gradient values, expected values)}`` for the elements this rank holds
    (DDP) or owns (distributed optimizer)."""
    out = {}
    names = {p: n for n, p in ddp.module.named_parameters()}
    if opt is None:
        for p, n in names.items():
            out[n] = (p.grad, None)
        return out
    for p, r in opt.param_range_map.items():
        rng = r["param"]
        out[names[p]] = (p.main_grad.reshape(-1)[rng.start : rng.end], rng)
    return out


def _run_config(cfg: Config, exp: dict) -> dict:
    import torch.distributed as dist

    import mtp.parallel as mp
    from mtp.moe import MoEAuxLossAutoScaler
    from mtp.optim import (
        DistributedDataParallel,
        DistributedOptimizer,
        clip_grad_norm,
        get_full_state_dict,
        load_full_state_dict,
    )
    from mtp.tensor_parallel import VocabParallelLinearCrossEntropy, vocab_parallel_cross_entropy

    mp.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp, expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
    )  # fmt: skip
    try:
        c, what = coordinates(), str(cfg)
        model = build_mtp_model(cfg)
        ddp = DistributedDataParallel(model, use_distributed_optimizer=cfg.optim == "distopt")
        if cfg.optim == "ddp":
            opt = torch.optim.AdamW(ddp.parameters(), lr=LR, eps=EPS, weight_decay=WD)
            dopt = None
        else:
            dopt = DistributedOptimizer(torch.optim.AdamW, ddp, clip_grad=CLIP, lr=LR, eps=EPS,
                                        weight_decay=WD)  # fmt: skip
        lce = VocabParallelLinearCrossEntropy.from_column_parallel(model.head)
        dp_rank, dp_group = mp.get_data_parallel_rank(), mp.get_data_parallel_group()
        mb = cfg.micro_batches
        if mb > 1:  # the aux losses' gradient must be scaled like the main loss
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0 / mb)
        got = {"ce": [], "norm": []}
        for step in range(2):
            tokens, targets = batch(cfg, step)
            (opt if dopt is None else dopt).zero_grad()
            if dopt is None:
                ddp.zero_grad_buffer()
            ce_sum = torch.zeros(())
            for m in range(mb):
                lo = dp_rank * B + m * B // mb
                tok, tgt = tokens[:, lo : lo + B // mb], targets[:, lo : lo + B // mb]
                if cfg.fused_loss:
                    ce = lce(model.hidden(tok), tgt)
                else:
                    ce = vocab_parallel_cross_entropy(ddp(tok), tgt).mean()
                ce_sum += ce.detach() / mb
                if m < mb - 1:
                    with ddp.no_sync():
                        (ce / mb).backward()
                else:
                    (ce / mb).backward()
            dist.all_reduce(ce_sum, group=dp_group)
            got["ce"].append(float(ce_sum) / cfg.dp)
            assert abs(got["ce"][-1] - exp["ce"][step]) <= exp["ce_tol"], (what, step, got, exp)
            ddp.finish_grad_sync(set_param_grads=dopt is None)
            if step == 0:
                for name, (g, rng) in _grads_of(cfg, ddp, dopt, c).items():
                    want = shard(name, torch.from_numpy(exp["grads"][name]), c)
                    if rng is not None:
                        want = want.reshape(-1)[rng.start : rng.end]
                    assert_close(g, want, rtol=0, atol=exp["grad_tol"][name],
                                 msg=f"{what}: gradient of {name}")  # fmt: skip
            if dopt is None:
                norm = clip_grad_norm(ddp, CLIP)
                opt.step()
            else:
                _, norm, _ = dopt.step()
            got["norm"].append(float(norm))
            assert_close(norm, torch.tensor(exp["norm"][step]), rtol=exp["norm_rtol"], atol=0,
                         msg=f"{what}: grad norm, step {step}")  # fmt: skip
        full = get_full_state_dict(ddp)
        assert set(full) == set(exp["params"]), (what, set(full) ^ set(exp["params"]))
        for name, t in full.items():
            assert_close(t, torch.from_numpy(exp["params"][name]), rtol=0,
                         atol=exp["param_tol"][name], msg=f"{what}: {name} after 2 steps")
        first = {k: torch.from_numpy(v).float() for k, v in exp["first"].items()}
        load_full_state_dict(ddp, first, optimizer=dopt)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), shard(name, first[name], c)), (what, name)
        return got
    finally:
        MoEAuxLossAutoScaler.reset_loss_scale()
        mp.destroy_model_parallel()


def _ranks_run(rank, world, cfgs, expected):
    torch.manual_seed(0)
    return [_run_config(cfg, exp) for cfg, exp in zip(cfgs, expected)]


def check(cfgs: list[Config]) -> None:
    by_world: dict[int, list[Config]] = {}
    for cfg in cfgs:
        by_world.setdefault(cfg.world, []).append(cfg)
    for world, group in by_world.items():
        expected = [_expected(cfg) for cfg in group]
        run_distributed(_ranks_run, world, group, expected, timeout=900)


def test_fast_subset():
    check(FAST)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_drawn_configurations(world):
    check([cfg for cfg in SLOW if cfg.world == world])


def test_draws_cover_every_layout_and_option():
    for world in (2, 4):
        drawn = [c for c in SLOW if c.world == world]
        assert {(c.tp, c.ep, c.etp) for c in drawn} == set(_layouts(world))
    assert {c.optim for c in SLOW} == {"ddp", "distopt", "mixed"}
    assert {c.dispatcher for c in SLOW} == {"alltoall", "allgather"}
    assert {c.topk for c in SLOW} == {1, 2} and {c.capacity for c in SLOW} >= {None, 1.0}
    assert any(c.zero_token for c in SLOW) and any(c.sp for c in SLOW)
    assert any(c.micro_batches > 1 for c in SLOW) and any(c.fused_loss for c in SLOW)
    np.testing.assert_equal([str(c) for c in draw_configs(4, 3, 1)],
                            [str(c) for c in draw_configs(4, 3, 1)])  # seeded: reproducible
