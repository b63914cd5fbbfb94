"""The benchmarks' byte/FLOP formulas against hand counts, the peak table, the floor, the
routing skew and the host-side op counter."""

import dataclasses

import pytest
import torch

from mtp.bench import bench_bias_act as bias_act
from mtp.bench import bench_cross_entropy as ce
from mtp.bench import bench_grouped_gemm as gg
from mtp.bench import bench_linear_cross_entropy as lce
from mtp.bench import bench_moe_layer as moe
from mtp.bench import bench_permute as perm
from mtp.bench import bench_quantize as qz
from mtp.bench import runner
from mtp.bench.counting import count_ops
from mtp.bench.peaks import match_peak
from mtp.bench.runner import floor_seconds


def test_bias_act_bytes_hand_counts():
    # x [2, 3] bf16 (2 B), bias fp32 (4 B). Forward: x 12 + bias 12 + y 12.
    assert bias_act.bias_gelu_bytes(2, 3, 2, 4, "fwd") == 12 + 12 + 12
    # Backward: dy 12 + x 12 + bias 12 read; dx 12 + dbias 12 written.
    assert bias_act.bias_gelu_bytes(2, 3, 2, 4, "fwd+bwd") == 36 + 60
    # SwiGLU, y [2, 3] from x [2, 6]: x 24 + bias 24 + y 12.
    assert bias_act.bias_swiglu_bytes(2, 3, 2, 4, "fwd") == 24 + 24 + 12
    # Backward: dy 12 + x 24 + bias 24 read; dx 24 + dbias 24 written.
    assert bias_act.bias_swiglu_bytes(2, 3, 2, 4, "fwd+bwd") == 60 + 108


def test_cross_entropy_bytes_hand_counts():
    # 4 rows x 10 vocab bf16, int64 targets: logits 80 + targets 32 + fp32 loss 16.
    assert ce.cross_entropy_bytes(4, 10, 2, 8, "fwd") == 80 + 32 + 16
    # Fused fwd+bwd floor: logits read once (80) and the gradient written once (80), targets 32,
    # loss 16 out, dloss 16 in.
    assert ce.cross_entropy_bytes(4, 10, 2, 8, "fwd+bwd") == 160 + 32 + 32
    # the agreement row (14 int64), then rows + two metadata rows of 3 fp32
    assert ce.allgather_bytes_per_rank(4) == 14 * 8 + (4 + 2) * 3 * 4


def test_linear_cross_entropy_formulas_hand_counts():
    # N=4 tokens, H=3, V=10, bf16: one GEMM 2*4*3*10 forward, three with the backward.
    assert lce.linear_cross_entropy_flops(4, 3, 10, "fwd") == 240
    assert lce.linear_cross_entropy_flops(4, 3, 10, "fwd+bwd") == 720
    # hidden 24 + weight 60 + int64 targets 32 + loss 4; backward: d_hidden 24, d_weight 60,
    # and the operands read again.
    assert lce.linear_cross_entropy_bytes(4, 3, 10, 2, "fwd") == 24 + 60 + 32 + 4
    assert lce.linear_cross_entropy_bytes(4, 3, 10, 2, "fwd+bwd") == 2 * (24 + 60 + 32 + 4)


def test_permute_bytes_hand_counts():
    # T=3 tokens, H=4, E=5, top-2 -> N=6 rows, bf16, int64 row map, bool routing map.
    # permute fwd: tokens 24 + routing 15 read; rows 48 + map 48 written.
    assert perm.permute_bytes(3, 4, 5, 2, 2, "fwd") == 24 + 15 + 48 + 48
    # bwd: row grads 48 + map 48 read; token grads 24 written.
    assert perm.permute_bytes(3, 4, 5, 2, 2, "fwd+bwd") == 135 + 48 + 48 + 24
    # unpermute fwd (fp32 probs): rows 48 + map 48 + routing 15 + 6 probs 24 read; out 24.
    assert perm.unpermute_bytes(3, 4, 5, 2, 2, 4, "fwd") == 48 + 48 + 15 + 24 + 24
    # bwd: grad 24 + rows 48 + map 48 + routing 15 + probs 24 read; row grads 48 + dprobs
    # [3, 5] fp32 60 written.
    bwd = 24 + 48 + 48 + 15 + 24 + 48 + 60
    assert perm.unpermute_bytes(3, 4, 5, 2, 2, 4, "fwd+bwd") == 159 + bwd


def test_grouped_gemm_formulas_hand_counts():
    # M=6 rows, K=4, N=5, E=3 experts, bf16.
    assert gg.grouped_gemm_flops(6, 4, 5, "fwd") == 2 * 6 * 4 * 5
    assert gg.grouped_gemm_flops(6, 4, 5, "fwd+bwd") == 3 * 240
    # fwd: x 48 + w 120 + y 60 + int64 counts 24.
    assert gg.grouped_gemm_bytes(6, 4, 5, 3, 2, "fwd") == 48 + 120 + 60 + 24
    # dgrad: dy 60 + w 120 + dx 48; wgrad: x 48 + dy 60 + dw 120.
    assert gg.grouped_gemm_bytes(6, 4, 5, 3, 2, "fwd+bwd") == 252 + 228 + 228


def test_moe_layer_formulas_hand_counts():
    # T=2, H=3, F=4 (SwiGLU: fc1 has 8 outputs), E=5, top-2 -> M=4 rows, bf16.
    router, fc1, fc2 = 2 * 2 * 3 * 5, 2 * 4 * 3 * 8, 2 * 4 * 4 * 3
    assert moe.moe_layer_flops(2, 3, 4, 5, 2, "fwd") == router + fc1 + fc2
    assert moe.moe_layer_flops(2, 3, 4, 5, 2, "fwd+bwd") == 3 * (router + fc1 + fc2)
    weights = 5 * (3 * 8 + 4 * 3) * 2
    fwd = 2 * 2 * 3 * 2 + 5 * 3 * 2 + weights
    assert moe.moe_layer_bytes(2, 3, 4, 5, 2, "fwd") == fwd
    bwd = 3 * 2 * 3 * 2 + 2 * 30 + 2 * weights  # dy, x read, dx written; router and weights x2
    assert moe.moe_layer_bytes(2, 3, 4, 5, 2, "fwd+bwd") == fwd + bwd


def test_quantize_bytes_hand_counts():
    # x [300, 256] bf16: read 153600, e4m3 76800; blockwise 2 fp32 scales a row, mxfp8 8 e8m0.
    assert qz.quantize_bytes("x rowwise", "blockwise", 300, 256, 2, 2) == 153600 + 76800 + 2400
    assert qz.quantize_bytes("x rowwise", "mxfp8", 300, 256, 2, 2) == 153600 + 76800 + 2400
    # + the column-wise copy: experts of 100 and 200 rows padded to 128 + 256 (blockwise)
    # and to 128 + 224 (mxfp8), one scale per block of rows and column
    rc = qz.quantize_bytes("x rowwise+colwise", "blockwise", 300, 256, 2, 2, [100, 200])
    assert rc == 232800 + 384 * 256 + 3 * 256 * 4
    rc = qz.quantize_bytes("x rowwise+colwise", "mxfp8", 300, 256, 2, 2, [100, 200])
    assert rc == 232800 + 352 * 256 + 11 * 256
    # weights [2, 256, 200]: two e4m3 copies; blockwise one set of 2 x 2 blocks per expert,
    # mxfp8 along each axis (256 x 7 and 8 x 200 per expert)
    n = 2 * 256 * 200
    assert qz.quantize_bytes("w", "blockwise", 256, 200, 2, 2) == 2 * n + 2 * n + 2 * 4 * 4
    assert qz.quantize_bytes("w", "mxfp8", 256, 200, 2, 2) == 4 * n + 2 * (256 * 7 + 8 * 200)


def test_fp8_providers_floor_at_the_fp8_rate():
    """FP8 providers: the recipes' tolerance and the floor at the datasheet FP8 rate (twice
    bf16's on H100), no fraction of the measured bf16 ceiling."""
    names = {p.name: p for p in gg.providers()}
    for name in ("triton-fp8", "triton-mxfp8", "torch._scaled_grouped_mm", "te-fp8",
                 "deepgemm"):  # fmt: skip
        assert names[name].rate == "fp8" and names[name].tolerance == 0.07, name
    assert {p.name: p.tolerance for p in moe.providers()}["triton-fp8"] == 0.1
    peak = dataclasses.asdict(match_peak("NVIDIA H100 80GB HBM3"))
    assert peak["fp8_flops_per_s"] == 2 * peak["bf16_flops_per_s"] == 1978.8e12
    rec = {"bytes": 1, "flops": int(1978.8e12)}  # one second at the FP8 rate
    ceilings = {"copy_bytes_per_s": 1e12, "bf16_matmul_flops_per_s": 900e12}
    fig = runner._figures(rec, {"median_ms": 2000.0}, peak, ceilings, "fp8")
    assert fig["floor_fraction"] == pytest.approx(0.5) and "ceiling_fraction" not in fig
    fig = runner._figures(rec, {"median_ms": 2000.0}, peak, ceilings)
    assert fig["floor_fraction"] == pytest.approx(1.0) and fig["ceiling_fraction"] > 1


def test_case_bytes_use_the_formulas():
    case = next(c for c in gg.cases("quick", torch.bfloat16) if c.pass_ == "fwd")
    p = case.params
    assert case.flops == 2 * p["M"] * p["K"] * p["N"]
    assert case.bytes == gg.grouped_gemm_bytes(p["M"], p["K"], p["N"], p["E"], 2, "fwd")


@pytest.mark.parametrize("E", [8, 16, 128, 256])
def test_expert_counts(E):
    M = 48 * E // 8
    balanced = gg.expert_counts(M, E, "balanced")
    assert sum(balanced) == M and max(balanced) - min(balanced) <= 1
    skewed = gg.expert_counts(M, E, "skewed")
    assert sum(skewed) == M and min(skewed) >= 0
    assert max(skewed) > 3 * M / E  # the hottest expert gets several times its share
    with pytest.raises(ValueError, match="skew"):
        gg.expert_counts(M, E, "zipf")


@pytest.mark.parametrize(
    "name, sms, expected",
    [
        ("NVIDIA H100 80GB HBM3", 132, "H100 SXM"),
        ("NVIDIA H100 PCIe", 114, "H100 PCIe"),
        ("NVIDIA H100", 114, "H100 PCIe"),
        ("NVIDIA H100 NVL", 132, "H100 NVL"),
        ("NVIDIA H200", 132, "H200 SXM"),
        ("NVIDIA H200 NVL", 132, "H200 NVL"),
        ("NVIDIA B200", 148, "B200"),
        ("NVIDIA GB200", 152, "GB200"),
        ("NVIDIA A100-SXM4-80GB", 108, None),
    ],
)
def test_match_peak(name, sms, expected):
    peak = match_peak(name, sms)
    assert (peak.name if peak else None) == expected


def test_peak_numbers_and_floor():
    h100 = match_peak("NVIDIA H100 80GB HBM3")
    assert h100.hbm_bytes_per_s == 3.35e12 and h100.bf16_flops_per_s == 989.4e12
    assert "datasheet" in h100.source
    assert match_peak("NVIDIA B200").hbm_bytes_per_s == 8e12
    # The floor is the larger of the two times.
    assert floor_seconds(int(3.35e12), None, 3.35e12, 1e15) == pytest.approx(1.0)
    assert floor_seconds(10, int(2e15), 1e12, 1e15) == pytest.approx(2.0)
    assert floor_seconds(None, None, 1.0, 1.0) is None


def test_count_ops_sees_launches_and_syncs():
    import mtp.ops as ops

    x = torch.randn(5, 8)
    with count_ops() as counted:
        y = ops.bias_gelu(x, torch.randn(8), backend="triton")
    assert counted.triton_launches == 1 and counted.host_syncs == [] and counted.device_ops >= 1
    assert torch.isfinite(y).all()
    w, counts = torch.randn(3, 8, 4), torch.tensor([2, 0, 3])
    with count_ops(execute_kernels=False) as counted:
        ops.grouped_gemm(x, w, counts, backend="sequential", validate=False)
    assert counted.host_syncs  # the loop reads the sizes on the host
    assert counted.compute["aten::mm"] == 2  # one GEMM per expert with tokens
    with count_ops(execute_kernels=False) as counted:
        ops.grouped_gemm(x, w, counts, backend="triton", validate=False)
    assert counted.triton_launches == 1 and not counted.host_syncs
