"""The TMA grouped GEMM (mtp.kernels.grouped_gemm_details.tma): float64 checks under the
interpreter (descriptors run there), the per-arch config table of
mtp.ops.grouped_gemm.config, and sm_90a / sm_100a SASS built ahead of time.

Interpreter tiles are tiny (16 / 32) so that the small shapes below still span several row tiles
per expert, partial tiles in K and N, and the persistent loop's stride (4 programs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton

from mtp import ops, settings
from mtp.kernels.grouped_gemm_details import launch, tiles
from mtp.kernels.grouped_gemm_details import tma as tk
from mtp.ops.grouped_gemm import config as gc
from mtp.ops.grouped_gemm.backends import triton_forward, triton_wgrad
from mtp.testing import _find_ptxas, assert_close, compile_for_targets

# Skewed, empty experts (first, middle and last), one expert over several row tiles; K and N are
# multiples of 8 (TMA's 16-byte strides) but not of the 16-wide tiles. 61 routed of 70 rows.
SIZES = [0, 37, 3, 0, 21, 0]
M, K, N = 70, 40, 24


def tma_config(block_m, block_n, block_k, **kw):
    """A TMA config at interpreter scale (4 persistent programs)."""
    kw = {"num_stages": 4, "persistent": True, "programs": 4, **kw}
    return gc.GroupedGemmConfig("tma", block_m, block_n, block_k, **kw)


def fwd_cfg(arch, M, N, K, E, bias=False):
    """make_config's choice for TMA-aligned bf16 operands on ``arch`` (132 SMs)."""
    return gc.make_config(arch, torch.bfloat16, M, N, K, E, bias=bias, tma_ok=True, sms=132)


def wgrad_cfg(arch, M, P, Q, E, sms):
    """make_config's TMA weight gradient ``c[e] = a_e^T b_e`` (``[P, Q]``) on ``arch``."""
    return gc.make_config(arch, torch.bfloat16, M, Q, P, E, gemm="wgrad", tma_ok=True, sms=sms)


FAMILIES = {  # one per regime of the table, at interpreter scale
    "small": tma_config(16, 16, 16, group_m=2, warp_specialize=False, flatten=False),
    "large": tma_config(32, 32, 16, warp_specialize=True, flatten=True),
}


def _data(dtype, trans_b, seed=0, sizes=SIZES, m=M):
    g = torch.Generator().manual_seed(seed)
    E = len(sizes)
    a = torch.randn(m, K, generator=g).to(dtype)
    w = torch.randn((E, N, K) if trans_b else (E, K, N), generator=g).to(dtype) / K**0.5
    dy = torch.randn(m, N, generator=g).to(dtype)
    return a, w, torch.tensor(sizes, dtype=torch.int32), dy


def _w_kn(w, trans_b):
    return w.transpose(1, 2) if trans_b else w


def _expected_forward(a, b, sizes):
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    row = 0
    for e, m in enumerate(sizes):
        out[row : row + m] = a[row : row + m].double() @ b[e].double()
        row += m
    return out


def _expected_wgrad(a, dy, sizes):
    out = torch.zeros(len(sizes), a.shape[1], dy.shape[1], dtype=torch.float64)
    row = 0
    for e, m in enumerate(sizes):
        out[e] = a[row : row + m].double().T @ dy[row : row + m].double()
        row += m
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_matches_float64(family, trans_b, dtype):
    a, w, counts, _ = _data(dtype, trans_b)
    b = _w_kn(w, trans_b)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch.forward(a, b, counts, out, FAMILIES[family])
    assert_close(out, _expected_forward(a, b, SIZES), msg=family)
    routed = sum(SIZES)
    assert torch.equal(out[routed:], torch.zeros_like(out[routed:])), "rows past the routed ones"


def test_forward_many_small_experts():
    """40 experts of 0-20 rows: the tile map spans several programs of its kernel."""
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 21, (40,), generator=g).tolist()
    sizes[:3] = [0, 0, 17]
    m = sum(sizes) + 5
    a = torch.randn(m, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(40, 16, 16, generator=g).to(torch.bfloat16)
    out = torch.full((m, 16), float("nan"), dtype=torch.bfloat16)
    launch.forward(a, b, torch.tensor(sizes), out, FAMILIES["small"])
    assert_close(out, _expected_forward(a, b, sizes))
    assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wgrad_matches_float64_with_split(split, dtype):
    # Ragged reduction lengths (37, 3, 21 rows: none a multiple of the 16-row chunk), empty
    # experts, and splits that leave some programs without rows.
    a, _, counts, dy = _data(dtype, False, seed=1)
    out = torch.full((len(SIZES), K, N), float("nan"), dtype=dtype)
    cfg = tma_config(16, 16, 16, group_m=2, num_stages=3, split=split,
                     warp_specialize=gc.supports_warp_specialize())
    launch.wgrad(a, dy, counts, out, cfg)
    assert_close(out, _expected_wgrad(a, dy, SIZES), msg=f"split={split}")
    for e, m in enumerate(SIZES):
        if m == 0:
            assert torch.equal(out[e], torch.zeros_like(out[e])), f"dW[{e}] of an empty expert"


@pytest.mark.parametrize("how", ["env", "override"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
def test_op_forward_backward_through_tma(monkeypatch, trans_b, how):
    """ops.grouped_gemm with MTP_TRITON_TMA=1, or inside override(kernel="tma"): forward, dX
    and dW all take the TMA kernels."""
    calls = []
    for name in ("grouped_gemm_tma_kernel", "grouped_wgrad_tma_kernel"):
        kernel = getattr(tk, name)
        monkeypatch.setattr(kernel, "run", lambda *a, _o=kernel.run, _n=name, **k: (
            calls.append(_n), _o(*a, **k))[1])
    a, w, counts, dy = _data(torch.bfloat16, trans_b, seed=2)
    a.requires_grad_()
    w.requires_grad_()
    if how == "env":
        monkeypatch.setenv("MTP_TRITON_TMA", "1")
        settings.reload()
        y = ops.grouped_gemm(a, w, counts, trans_b=trans_b, backend="triton")
    else:
        monkeypatch.setenv("MTP_TRITON_TMA", "0")  # the override wins over the setting
        settings.reload()
        with gc.override(kernel="tma"):
            y = ops.grouped_gemm(a, w, counts, trans_b=trans_b, backend="triton")
    b = _w_kn(w.detach(), trans_b)
    assert_close(y, _expected_forward(a.detach(), b, SIZES))
    if how == "env":
        y.backward(dy)
    else:
        with gc.override(kernel="tma"):
            y.backward(dy)
    dx = _expected_forward(dy, b.transpose(1, 2), SIZES)
    dw = _expected_wgrad(a.detach(), dy, SIZES)
    assert_close(a.grad, dx, msg="dx")
    assert_close(w.grad, dw.transpose(1, 2) if trans_b else dw, msg="dw")
    assert calls.count("grouped_gemm_tma_kernel") == 2, calls
    assert calls.count("grouped_wgrad_tma_kernel") == 1, calls


def test_tma_true_rejects_ineligible_operands():
    a, w, counts, _ = _data(torch.float32, False)
    out = torch.empty(M, N)
    with pytest.raises(ValueError, match="tma=True needs fp16/bf16"):
        launch.forward(a, w, counts, out, FAMILIES["small"])
    a16 = torch.randn(M, K + 1, dtype=torch.bfloat16)[:, :K]  # 82-byte row stride
    with pytest.raises(ValueError, match="16-byte"):
        launch.forward(a16, w.bfloat16(), counts, out.bfloat16(), FAMILIES["small"])
    # Default, and asking for TMA: the pointer kernels take them, still correct.
    for force in (False, True):
        out16 = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        with gc.override(kernel="tma") if force else contextlib.nullcontext():
            triton_forward(a16, w.bfloat16(), counts, False, out16)
        assert_close(out16, _expected_forward(a16, w.bfloat16(), SIZES))


def test_config_table_by_regime_and_split():
    # Regime by average rows per expert.
    assert fwd_cfg(9, 8 * 64, 4096, 4096, 8).block_m == 64
    medium = fwd_cfg(9, 8 * 512, 4096, 4096, 8)
    assert (medium.block_m, medium.block_n) == (128, 128)
    large = fwd_cfg(9, 8 * 4096, 14336, 4096, 8)
    assert (large.block_m, large.block_n) == (128, 256) and not large.warp_specialize
    assert fwd_cfg(9, 8 * 64, 4096, 4096, 8).warp_specialize == (
        gc.supports_warp_specialize())  # 4-warp tiles: Hopper's pass specialises them
    bw = fwd_cfg(10, 8 * 4096, 14336, 4096, 8)
    assert bw.warp_specialize == gc.supports_warp_specialize()
    assert fwd_cfg(9, 100, 24, 40, 8).block_n == 32  # narrow N shrinks the tile
    # Split-K for wgrad only while the output tiles leave SMs idle and experts have rows.
    assert wgrad_cfg(9, 8 * 4096, 2048, 2048, 8, 132).split == 1  # 2048 tiles
    few = wgrad_cfg(9, 4 * 8192, 512, 256, 4, 132)  # 4 * 8 tiles
    assert few.split == 4
    assert wgrad_cfg(9, 4 * 300, 512, 256, 4, 132).split == 1  # too few rows


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation: TMA, wgmma / tcgen05 and warp specialisation in the SASS
# --------------------------------------------------------------------------------------------

#: cuobjdump (with the nvdisasm it calls beside it): the nvidia-cuda-cuobjdump wheel's, else the
#: one Triton's NVIDIA backend ships
_CUOBJDUMP = [os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13",
                           "bin", "cuobjdump"),
              os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                           "cuobjdump")]  # fmt: skip


def _sass(build) -> tuple[str, str]:
    """(ptxas -v output, SASS) of a build, or pytest.skip without ptxas / cuobjdump."""
    ptxas = _find_ptxas(build.arch)
    cuobjdump = next((t for t in _CUOBJDUMP if os.path.exists(t)), None)
    if ptxas is None or cuobjdump is None:
        pytest.skip("needs ptxas and cuobjdump (nvidia-cuda-* wheels)")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(build.ptx)
        info = subprocess.run([ptxas, "-v", f"--gpu-name={build.arch}", src, "-o", cubin],
                              capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return info.stdout + info.stderr, sass


def _forward_build(cc: int, cfg: gc.GroupedGemmConfig, trans_b: bool, bias: bool = False):
    signature = {
        "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16",
        "map_ptr": "*i32",
        "M": "i32", "N": "i32", "K": "i32", "E": "i32", "stride_am": "i32", "stride_be": "i32",
        "stride_cm": "i32", ("stride_bn" if trans_b else "stride_bk"): "i32",
    }
    constexprs = {
        ("stride_bk" if trans_b else "stride_bn"): 1, "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "TRANS_B": trans_b,
        "FLATTEN": cfg.flatten, "WARP_SPECIALIZE": cfg.warp_specialize, "UPCAST_DOT": False,
        "HAS_BIAS": bias, "MAP_OFF": tiles.head_size(8),  # the launch's constant (8 experts)
    }
    divisible = [k for k in signature if k.startswith("stride")] + ["N", "K"]
    return compile_for_targets(
        tk.grouped_gemm_tma_kernel, signature, constexprs, targets=(cc,),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, divisible_by_16=divisible,
    )[cc]


def _wgrad_build(cc: int, cfg: gc.GroupedGemmConfig):
    signature = {
        "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32" if cfg.split > 1 else "*bf16",
        "rows_ptr": "*i32", "M": "i32", "P": "i32", "Q": "i32", "E": "i32",
        "stride_am": "i32", "stride_bm": "i32", "stride_ce": "i32", "stride_cp": "i32",
        "stride_cs": "i32",
    }
    constexprs = {
        "BLOCK_P": cfg.block_m, "BLOCK_Q": cfg.block_n, "BLOCK_R": cfg.block_k,
        "GROUP_P": cfg.group_m, "SPLIT": cfg.split, "WARP_SPECIALIZE": cfg.warp_specialize,
        "UPCAST_DOT": False, "ACCUMULATE": False,
    }
    divisible = [k for k in signature if k.startswith("stride")] + ["P", "Q"]
    return compile_for_targets(
        tk.grouped_wgrad_tma_kernel, signature, constexprs, targets=(cc,),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, divisible_by_16=divisible,
    )[cc]


def _check(build, cc: int, warp_specialized: bool) -> None:
    info, sass = _sass(build)
    assert build.arch == f"sm_{cc}a" and build.fits_shared_memory, build.shared
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", info), info
    assert "UTMALDG" in sass, "no TMA loads in the SASS"
    if cc == 90:
        assert "HGMMA" in sass, "no wgmma in the sm_90a SASS"
    else:
        assert "tcgen05.mma" in build.ptx and re.search(r"UTC\w*MMA", sass), "no tcgen05 MMA"
    if warp_specialized:
        assert "setmaxnreg" in build.ptx and "USETMAXREG" in sass, "not warp-specialised"


@pytest.mark.parametrize("cc", [90, 100])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias_epilogue"])
def test_aot_forward_large_groups(cc, bias):
    cfg = fwd_cfg(cc // 10, 8 * 4096, 14336, 4096, 8)  # Mixtral fc1
    assert cfg.warp_specialize == (cc == 100 and gc.supports_warp_specialize())
    # a bias epilogue on these 128 x 256 tiles would spill in the epilogue warps: not specialised
    cfg = fwd_cfg(cc // 10, 8 * 4096, 14336, 4096, 8, bias=bias)
    assert not (bias and cfg.warp_specialize), cfg
    _check(_forward_build(cc, cfg, trans_b=False, bias=bias), cc, cfg.warp_specialize)


def test_aot_forward_small_groups_warp_specialized_on_hopper():
    cfg = fwd_cfg(9, 128 * 64, 768, 2048, 128)  # Qwen3-30B-A3B decode-like
    assert cfg.block_m == 64 and cfg.warp_specialize == gc.supports_warp_specialize()
    _check(_forward_build(90, cfg, trans_b=True), 90, cfg.warp_specialize)


def test_hopper_tables_avoid_the_half_tile_warp_specialization():
    """Found on an H200 (triton 3.6): a warp-specialised loop over 128-row tiles with 4 warps
    stores only half of each tile. The sm_90a tables give such tiles 8 warps (forward) or no
    warp specialisation (weight gradient); 64-row tiles with 4 warps were right."""
    for (arch, _), cfg in gc.FORWARD_TABLE.items():
        if arch == 9 and cfg.warp_specialize and cfg.block_m >= 128:
            assert cfg.num_warps >= 8, cfg
    assert not gc.WGRAD_TABLE[9].warp_specialize or gc.WGRAD_TABLE[9].num_warps >= 8
    assert wgrad_cfg(9, 4 * 8192, 512, 256, 4, 132).warp_specialize is False


def test_aot_forward_medium_groups_eight_warps_on_hopper():
    cfg = fwd_cfg(9, 128 * 256, 768, 2048, 128)  # Qwen3-30B-A3B at 4096 tokens
    assert (cfg.block_m, cfg.num_warps) == (128, 8)
    # TMA + wgmma, no spills; whether the 8-warp loop is split into producer / consumer warps
    # is the compiler's choice (triton 3.9 here emits no setmaxnreg for it), so not asserted.
    _check(_forward_build(90, cfg, trans_b=False), 90, warp_specialized=False)


@pytest.mark.parametrize("cc", [90, 100])
def test_aot_wgrad_split(cc):
    cfg = wgrad_cfg(cc // 10, 4 * 8192, 512, 256, 4, 132)
    assert cfg.split > 1
    _check(_wgrad_build(cc, cfg), cc, cfg.warp_specialize and gc.supports_warp_specialize())


@pytest.mark.slow
@pytest.mark.parametrize("cc", [90, 100])
def test_aot_every_forward_variant(cc):
    for M in (8 * 64, 8 * 512, 8 * 4096):
        cfg = fwd_cfg(cc // 10, M, 4096, 4096, 8)
        for trans_b in (False, True):  # 8-warp loops: specialised at the compiler's choice
            _check(_forward_build(cc, cfg, trans_b), cc,
                   cfg.warp_specialize and cfg.num_warps == 4)
    cfg = dataclasses.replace(gc.WGRAD_TABLE[cc // 10], split=1)
    _check(_wgrad_build(cc, cfg), cc, cfg.warp_specialize and gc.supports_warp_specialize())


# --------------------------------------------------------------------------------------------
# GPU (sm_90+): the default configs of every regime, split-K, CUDA graphs
# --------------------------------------------------------------------------------------------


def _needs_tma_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90+ GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("E, rows", [(16, 40), (8, 512), (4, 3000)],
                         ids=["small", "medium", "large"])
def test_gpu_default_configs_match_float64(E, rows, trans_b):
    _needs_tma_gpu()
    g = torch.Generator().manual_seed(E)
    sizes = torch.randint(0, 2 * rows, (E,), generator=g).tolist()
    sizes[1] = 0
    m = sum(sizes) + 77  # a zero tail
    Kd, Nd = 264, 392
    a = torch.randn(m, Kd, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn((E, Nd, Kd) if trans_b else (E, Kd, Nd), generator=g) / Kd**0.5).to(
        "cuda", torch.bfloat16)
    b = _w_kn(w, trans_b)
    counts = torch.tensor(sizes, device="cuda")
    out = torch.full((m, Nd), float("nan"), dtype=torch.bfloat16, device="cuda")
    with gc.override(kernel="tma"):
        triton_forward(a, b, counts, False, out)
    assert_close(out, _expected_forward(a.cpu(), b.cpu(), sizes).cuda())
    assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))


@pytest.mark.gpu
def test_gpu_wgrad_split_matches_float64():
    _needs_tma_gpu()
    g = torch.Generator().manual_seed(3)
    sizes = [1500, 0, 37, 2600]
    m, P, Q = sum(sizes), 256, 128
    a = torch.randn(m, P, generator=g).to("cuda", torch.bfloat16)
    dy = torch.randn(m, Q, generator=g).to("cuda", torch.bfloat16)
    counts = torch.tensor(sizes, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = wgrad_cfg(torch.cuda.get_device_capability()[0], m, P, Q, len(sizes), sms)
    assert cfg.split > 1
    out = torch.full((len(sizes), P, Q), float("nan"), dtype=torch.bfloat16, device="cuda")
    with gc.override(kernel="tma"):
        triton_wgrad(a, dy, counts, out)
    assert_close(out, _expected_wgrad(a.cpu(), dy.cpu(), sizes).cuda())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    again = torch.full_like(out, float("nan"))
    with gc.override(kernel="tma"):
        triton_wgrad(a, dy, counts, again)
    assert torch.equal(out, again), "split-K must be deterministic"


@pytest.mark.gpu
def test_gpu_tma_graph_replay_with_new_routing():
    _needs_tma_gpu()
    a, w, counts, _ = _data(torch.bfloat16, False)
    a, w, counts = a.cuda(), w.cuda(), counts.cuda()
    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    with gc.override(kernel="tma"):
        triton_forward(a, w, counts, False, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), gc.override(kernel="tma"):
        triton_forward(a, w, counts, False, out)
    for new in ([0, 40, 2, 7, 0, 0], [70, 0, 0, 0, 0, 0], [0] * 6):
        counts.copy_(torch.tensor(new))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, _expected_forward(a.cpu(), w.cpu(), new).cuda(), msg=str(new))


@pytest.mark.parametrize("E", [256, 4096])
def test_aot_tile_map_no_spills(E):
    block_t = max(2, min(32, 4096 // E))  # as the launcher's tile map picks it
    build = compile_for_targets(
        tiles.tile_map_kernel,
        {"counts_ptr": "*i64", "head_ptr": "*i32", "M": "i32", "E": "i32", "row_tiles": "i32"},
        {"BLOCK_M": 64, "BLOCK_E": E, "BLOCK_T": block_t}, targets=(90,),
    )[90]
    info = build.ptxas()
    assert info is None or not info.spills, info.output


@pytest.mark.parametrize("E", [8, 256])
def test_aot_routing_head_and_split_reduce_no_spills(E):
    """The small helper launches of the TMA wgrad (the routing head alone, the split's sum),
    for both targets (the minimum-Triton check in CI compiles every kernel an AOT test
    reaches)."""
    rows = compile_for_targets(
        tiles.tile_map_kernel,
        {"counts_ptr": "*i64", "head_ptr": "*i32", "M": "i32", "E": "i32", "row_tiles": "i32"},
        {"BLOCK_M": 16, "BLOCK_E": E, "BLOCK_T": max(2, min(32, 4096 // E))},
    )
    reduce = compile_for_targets(
        tk.split_reduce_kernel,
        {"ws_ptr": "*fp32", "c_ptr": "*bf16", "numel": "i32", "PQ": "i32", "Q": "i32",
         "stride_ce": "i32", "stride_cp": "i32", "stride_cq": "i32"},
        {"SPLIT": 4, "BLOCK": 1024, "ACCUMULATE": True},
    )
    for builds in (rows, reduce):
        assert set(builds) == {90, 100}
        for build in builds.values():
            info = build.ptxas()
            assert info is None or not info.spills, info.output
