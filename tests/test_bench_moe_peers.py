"""The ``moe_layer`` bench's peers (``mtp.bench.moe_peers``): Megatron-Core's MoELayer and
torchtitan's MoE, built with mtp's weights, agree with the float64 reference on CPU; Liger's
fused MoE is declared and skips with the reason when Liger-Kernel is missing (its call is
checked against a stand-in with Liger's documented layout); the structural rows put mtp's
``triton`` layer next to each installed peer, with fewer device ops and fewer saved bytes per
token."""

from __future__ import annotations

import sys

import pytest
import torch

from mtp.bench import bench_moe_layer as moe
from mtp.bench import core, moe_peers, runner

CPU = torch.device("cpu")
INSTALLED = {
    moe_peers.MEGATRON: "megatron.core.transformer.moe.moe_layer",
    moe_peers.TORCHTITAN: "torchtitan.models.common.moe",
}


@pytest.fixture(autouse=True)
def _released():
    """No process group or Megatron-Core parallel state left for the next test."""
    yield
    moe_peers.release()


def _provider(name):
    return next(p for p in moe.providers() if p.name == name)


def test_the_three_peers_are_declared():
    peers = {p.name: p for p in moe.providers() if p.kind == "peer"}
    assert set(peers) == set(moe_peers.PEERS)
    assert not peers[moe_peers.LIGER].cpu  # Liger's Triton kernels: GPU only


def test_liger_skips_with_the_reason_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if absent
    reason = _provider(moe_peers.LIGER).unavailable(torch.device("cuda"))
    assert reason and "liger_kernel" in reason


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(INSTALLED))
def test_peer_agrees_with_the_float64_reference(name, dtype, pass_):
    pytest.importorskip(INSTALLED[name])
    T, H, F = moe._SMOKE
    case = moe._case("Mixtral-like", 8, 2, T, H, F, dtype, pass_)
    (rec,) = runner.run_cpu_case(moe, case, [_provider(name)])
    assert rec["status"] == "ok", rec["note"]
    assert rec["check"]["ok"] and rec["check"]["against"] == core.FLOAT64, rec
    assert rec["counts"]["device_ops"] >= 1


def test_release_leaves_the_process_as_it_was():
    import torch.distributed as dist

    pytest.importorskip(INSTALLED[moe_peers.MEGATRON])
    assert not dist.is_initialized()
    assert moe_peers.megatron_single_rank(CPU) is None and dist.is_initialized()
    moe_peers.release()
    assert not dist.is_initialized()


class _StandInFusedMoE(torch.autograd.Function):
    """Liger's documented semantics (HF v5 layout): ``gate_up [E, 2F, H]`` (gate first),
    ``down [E, H, F]``, ``out[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])``; plain PyTorch."""

    @staticmethod
    def forward(ctx, x, gate_up, down, idx, w):
        ctx.save_for_backward(x, gate_up, down, idx, w)
        return _StandInFusedMoE.compute(x, gate_up, down, idx, w)

    @staticmethod
    def compute(x, gate_up, down, idx, w):
        F = down.shape[-1]
        h = torch.einsum("th,tkfh->tkf", x, gate_up[idx.long()])
        a = torch.nn.functional.silu(h[..., :F]) * h[..., F:]
        return torch.einsum("tkf,tkhf,tk->th", a, down[idx.long()], w)

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, down, idx, w = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, gate_up, down, w)]
            y = _StandInFusedMoE.compute(leaves[0], leaves[1], leaves[2], idx, leaves[3])
            dx, dgu, dd, dw = torch.autograd.grad(y, leaves, dy)
        return dx, dgu, dd, None, dw


def test_liger_peer_call_against_a_stand_in(monkeypatch):
    import types

    for name in ("liger_kernel", "liger_kernel.ops", "liger_kernel.ops.fused_moe"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["liger_kernel.ops.fused_moe"].LigerFusedMoEFunction = _StandInFusedMoE
    T, H, F = moe._SMOKE
    case = moe._case("Mixtral-like", 8, 2, T, H, F, torch.float32, "fwd+bwd")
    run = moe.setup_moe_layer(case, moe_peers.LIGER, CPU)
    expected = moe.setup_moe_layer(case, core.FLOAT64, CPU).fn()
    assert core.rel_err(run.for_check(run.fn()), expected) < 1e-4


def test_structural_rows_put_mtp_next_to_each_peer(capsys):
    rows = moe.peer_structure(experts=((8, 2), (64, 8)))
    installed = moe_peers.available(CPU)
    assert installed, "no peer installed here"
    for E in (8, 64):
        by = {r["provider"]: r for r in rows if r["E"] == E}
        assert set(by) == {"triton", *installed}, by
        assert not any("error" in r for r in by.values()), by
        mtp = by["triton"]
        assert mtp["host_syncs"] == mtp["fwd_bwd_host_syncs"] == 0
        for name in installed:
            peer = by[name]
            with capsys.disabled():
                print(f"\nE={E}: triton {mtp['device_ops']}/{mtp['fwd_bwd_device_ops']} ops, "
                      f"{mtp['saved_bytes_per_token']:.0f} B/token; {name} "
                      f"{peer['device_ops']}/{peer['fwd_bwd_device_ops']} ops, "
                      f"{peer['host_syncs']} syncs, {peer['saved_bytes_per_token']:.0f} B/token")
            assert mtp["device_ops"] < peer["device_ops"], (mtp, peer)
            assert mtp["fwd_bwd_device_ops"] < peer["fwd_bwd_device_ops"], (mtp, peer)
            assert mtp["saved_bytes_per_token"] < peer["saved_bytes_per_token"], (mtp, peer)
