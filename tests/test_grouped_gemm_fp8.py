"""FP8 operands of mtp.ops.grouped_gemm (fp8_recipe="blockwise" / "mxfp8", Fp8Tensor inputs):
forward and both gradients against float64 on the dequantised operands (fp32 accumulation
level), against the BF16 GEMM on the original operands (the recipes' error), ragged, empty and
unaligned groups with exact zeros, the options (BF16 weight gradient, main-grad accumulation),
launches and host syncs, argument errors, and the sm_90a / sm_100a builds (QGMMA, the
block-scaled tcgen05 MMA, no spills).

Under the interpreter tiles are 16 x 16 x 32, so these shapes span several tiles per expert,
partial K and N steps, and no count is a multiple of 16, 32 or 128."""

from __future__ import annotations

import re

import pytest
import torch

from mtp import settings
from mtp.kernels.grouped_gemm_details import fp8 as kf
from mtp.ops import Fp8Recipe, grouped_gemm, quantize
from mtp.ops.grouped_gemm import config as gc
from mtp.ops.grouped_gemm.checks import check_fp8_device
from mtp.testing import assert_close, compile_for_targets, count_host_syncs
from mtp.testing.traffic import count_traffic
from test_grouped_gemm_tma import _sass

SIZES = [0, 37, 3, 0, 21, 0]  # empty first, middle and last experts; 61 routed of 70 rows
M, K, N = 70, 40, 24
RECIPES = ["blockwise", "mxfp8"]


def _data(dtype, trans_b, seed=0, m=M, k=K, n=N, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    E = len(sizes)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn((E, n, k) if trans_b else (E, k, n), generator=g) / k**0.5).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, torch.tensor(sizes), dy


def _deq(t) -> torch.Tensor:
    return t.dequantize().double()


def _weight_values(w, recipe, trans_b):
    """float64 ``(forward operand [E, K, N], data-gradient operand [E, N, K])``: ``w``
    quantised along K and along N as the op does it (blockwise: the same 128 x 128 blocks)."""
    if recipe == "blockwise":
        v = _deq(quantize(w, recipe, "block", backend="reference"))
        return (v.mT, v) if trans_b else (v, v.mT)
    along_last = _deq(quantize(w, recipe, "rowwise", backend="reference"))
    along_rows = _deq(quantize(w, recipe, "colwise", backend="reference"))
    return (along_last.mT, along_rows) if trans_b else (along_rows, along_last.mT)


def _per_expert(a, b, sizes, rows):
    """float64 ``out[rows of e] = a[rows of e] @ b[e]``, zeros past the routed rows."""
    out = torch.zeros(rows, b.shape[2], dtype=torch.float64)
    row = 0
    for e, m in enumerate(sizes):
        out[row : row + m] = a[row : row + m] @ b[e]
        row += m
    return out


def _expected_wgrad(x, dy, recipe, sizes, trans_b):
    """float64 ``dW[e]`` from each expert's rows quantised along the rows (column-wise)."""
    out, row = [], 0
    for m in sizes:
        xe = _deq(quantize(x[row : row + m], recipe, "colwise", backend="reference"))
        de = _deq(quantize(dy[row : row + m], recipe, "colwise", backend="reference"))
        out.append(de.T @ xe if trans_b else xe.T @ de)
        row += m
    return torch.stack(out)


def _run(x, w, counts, dy, trans_b, recipe, **kw):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_gemm(xx, ww, counts, trans_b=trans_b, fp8_recipe=recipe, **kw)
    y.backward(dy)
    return y.detach(), xx.grad, ww.grad


@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_and_gradients_match_float64_on_dequantised_operands(recipe, trans_b):
    """fp32 inputs and outputs: the fp32-accumulation level of tolerance."""
    x, w, counts, dy = _data(torch.float32, trans_b)
    y, dx, dw = _run(x, w, counts, dy, trans_b, recipe, backend="triton")
    wf, wd = _weight_values(w, recipe, trans_b)
    xq = _deq(quantize(x, recipe, backend="reference"))
    dyq = _deq(quantize(dy, recipe, backend="reference"))
    assert_close(y, _per_expert(xq, wf, SIZES, M), msg="y")
    assert_close(dx, _per_expert(dyq, wd, SIZES, M), msg="dx")
    assert_close(dw, _expected_wgrad(x, dy, recipe, SIZES, trans_b), msg="dw")
    routed = sum(SIZES)
    for name, t in (("y", y), ("dx", dx)):
        assert torch.equal(t[routed:], torch.zeros_like(t[routed:])), f"{name}: the zero tail"
    for e, m in enumerate(SIZES):
        if m == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), f"dW[{e}] of an empty expert"


@pytest.mark.parametrize("recipe", RECIPES)
def test_pre_quantised_operands_equal_the_internal_quantisation(recipe):
    x, w, counts, _ = _data(torch.bfloat16, True, seed=1)
    y = grouped_gemm(x, w, counts, trans_b=True, fp8_recipe=recipe, backend="triton")
    layout = "block" if recipe == "blockwise" else "rowwise"
    xq, wq = quantize(x, recipe, backend="triton"), quantize(w, recipe, layout, backend="triton")
    y2 = grouped_gemm(xq, wq, counts, trans_b=True, backend="triton")
    assert y2.dtype == torch.bfloat16 and torch.equal(y, y2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_error_against_the_bf16_gemm(recipe):
    """The recipe's error on Gaussian data (docs/grouped_gemm.md): relative Frobenius error of
    the output and both gradients against the BF16 grouped GEMM on the original operands."""
    sizes = [40, 0, 45, 13]
    x, w, counts, dy = _data(torch.bfloat16, False, seed=2, m=100, k=128, n=32, sizes=sizes)
    got = _run(x, w, counts, dy, False, recipe, backend="triton")
    want = _run(x, w, counts, dy, False, None, backend="triton")
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 0.07, f"{name}: relative error {err:.4f}"


def test_bf16_weight_gradient_option_and_accumulation():
    x, w, counts, dy = _data(torch.bfloat16, False, seed=3)
    recipe = Fp8Recipe("blockwise", wgrad="bf16")
    _, _, dw = _run(x, w, counts, dy, False, recipe, backend="triton")
    _, _, dw_bf16 = _run(x, w, counts, dy, False, None, backend="triton")
    assert torch.equal(dw, dw_bf16), "the BF16 weight gradient of the BF16 operands"
    for rec in (recipe, Fp8Recipe("mxfp8")):
        ww = w.clone().requires_grad_()
        ww.main_grad = torch.ones(ww.shape, dtype=torch.float32)
        y = grouped_gemm(x, ww, counts, fp8_recipe=rec, gradient_accumulation_fusion=True,
                         backend="triton")  # fmt: skip
        y.backward(dy)
        assert ww.grad is None
        _, _, plain = _run(x, w, counts, dy, False, rec, backend="triton")
        # main_grad holds the fp32 sums, the plain gradient their bf16 rounding
        assert_close(ww.main_grad - 1, plain.double(), torch.bfloat16, msg=rec.name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_backend_agrees(recipe):
    x, w, counts, dy = _data(torch.bfloat16, True, seed=4)
    got = _run(x, w, counts, dy, True, recipe, backend="triton")
    ref = _run(x, w, counts, dy, True, recipe, backend="reference")
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        assert_close(a, b.double(), msg=name)


def test_launches_and_no_host_sync():
    """Forward: the tile map of the grouped quantisation, x and w quantised (one launch each),
    the GEMM; backward: dY quantised once for both gradient GEMMs, then the two GEMMs. (The
    counter is a dispatch mode: the custom ops run, whose backward derives its own tile map;
    the eager path shares the forward's: tests/test_host_budget.py counts those launches.)"""
    settings.configure(poison_outputs=False)
    x, w, counts, dy = _data(torch.bfloat16, False, seed=5)
    x.requires_grad_()
    w.requires_grad_()
    with count_traffic() as fwd:
        y = grouped_gemm(x, w, counts, fp8_recipe="blockwise", backend="triton")
    with count_traffic() as bwd:
        y.backward(dy)
    assert fwd.num_launches == 4 and fwd.num_host_syncs == 0, fwd.summary()
    kernels = bwd.by_kernel()
    assert kernels["quantize_kernel"]["calls"] == 1, kernels
    assert kernels["tile_map_kernel"]["calls"] == 1, kernels
    assert bwd.num_launches == 4 and bwd.num_host_syncs == 0, bwd.summary()
    with count_host_syncs() as syncs:
        grouped_gemm(x, w, counts, fp8_recipe="mxfp8", backend="triton").backward(dy)
    assert syncs.count == 0


def test_argument_errors():
    x, w, counts, _ = _data(torch.bfloat16, False)
    with pytest.raises(ValueError, match="bias cannot be combined with FP8"):
        grouped_gemm(x, w, counts, fp8_recipe="blockwise", bias=torch.zeros(6, N))
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        grouped_gemm(x, w, counts, fp8_recipe="fp4")
    xq = quantize(x, "mxfp8")
    with pytest.raises(ValueError, match="must agree|row-wise"):
        grouped_gemm(xq, w, counts, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="quantised along K"):
        grouped_gemm(x, quantize(w, "blockwise", "rowwise"), counts, backend="triton")
    with pytest.raises(ValueError, match="needs the BF16 x"):
        grouped_gemm(xq, w.requires_grad_(), counts)
    with pytest.raises(ValueError, match="sm_100"):
        check_fp8_device("mxfp8", torch.device("cuda", 0), 9)
    check_fp8_device("blockwise", torch.device("cuda", 0), 9)
    check_fp8_device("mxfp8", torch.device("cuda", 0), 10)


# --------------------------------------------------------------------------------------------
# Ahead-of-time builds: the FP8 tensor-core instructions in the SASS, no spills
# --------------------------------------------------------------------------------------------


def _fp8_build(cc, recipe, gemm, M, N, K, E):
    """The FP8 kernel of ``gemm`` as make_config picks it, K-major operands (the op's layouts:
    unit strides along the reduction), the other strides multiples of 16."""
    cfg = gc.make_config(cc // 10, torch.float8_e4m3fn, M, N, K, E, gemm=gemm, recipe=recipe,
                         sms=132)  # fmt: skip
    mx = recipe == "mxfp8"
    scale = "*u8" if mx else "*fp32"
    common = {"a_ptr": "*fp8e4nv", "sa_ptr": scale, "b_ptr": "*fp8e4nv", "sb_ptr": scale,
              "c_ptr": "*bf16", "counts_ptr": "*i64"}  # fmt: skip
    if gemm == "forward":
        kernel = kf.grouped_gemm_fp8_kernel
        ints = ["M", "N", "K", "E", "stride_am", "stride_sam", "stride_sak", "stride_be",
                "stride_bn", "stride_sbe", "stride_sbk", "stride_sbn", "stride_cm"]
        consts = dict(stride_ak=1, stride_bk=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, BLOCK_E=E, GROUP_M=cfg.group_m,
                      GROUP_K=32 if mx else 128, GROUP_N=1 if mx else 128, MX=mx,
                      PERSISTENT=cfg.persistent)  # fmt: skip
    else:
        kernel = kf.grouped_wgrad_fp8_kernel
        ints = ["P", "Q", "E", "stride_ap", "stride_sap", "stride_bq", "stride_sbq",
                "stride_ce", "stride_cp"]
        consts = dict(stride_am=1, stride_sam=1, stride_bm=1, stride_sbm=1, stride_cq=1,
                      BLOCK_P=cfg.block_m, BLOCK_Q=cfg.block_n, BLOCK_R=cfg.block_k,
                      BLOCK_E=E, GROUP_P=cfg.group_m, GROUP=32 if mx else 128, MX=mx,
                      ACCUMULATE=False)  # fmt: skip
    signature = {**common, **{name: "i32" for name in ints}}
    divisible = [k for k in ints if k.startswith("stride")] + ["N", "K", "P", "Q"]
    return compile_for_targets(kernel, signature, consts, targets=(cc,),
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                               divisible_by_16=[d for d in divisible if d in signature])[cc]


_AOT = {  # name: (cc, recipe, gemm, M, N, K, E, SASS MMA, PTX MMA)
    "sm90_blockwise_forward": (90, "blockwise", "forward", 128 * 512, 4096, 2048, 128,
                               "QGMMA", r"wgmma\.mma_async\S*\.e4m3\.e4m3"),
    "sm90_blockwise_small_groups": (90, "blockwise", "forward", 128 * 64, 768, 2048, 128,
                                    "QGMMA", r"wgmma\.mma_async\S*\.e4m3\.e4m3"),
    "sm90_blockwise_wgrad": (90, "blockwise", "wgrad", 128 * 512, 4096, 2048, 128, "QGMMA",
                             r"wgmma\.mma_async\S*\.e4m3\.e4m3"),
    "sm100_blockwise_forward": (100, "blockwise", "forward", 128 * 512, 4096, 2048, 128,
                                "UTCQMMA", r"tcgen05\.mma\S*kind::f8f6f4"),
    "sm100_mxfp8_forward": (100, "mxfp8", "forward", 128 * 512, 4096, 2048, 128, "UTCQMMA",
                            r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale"),
    "sm100_mxfp8_wgrad": (100, "mxfp8", "wgrad", 128 * 512, 4096, 2048, 128, "UTCQMMA",
                          r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale"),
}


@pytest.mark.parametrize("name", sorted(_AOT))
def test_aot_fp8_tensor_cores_and_no_spills(name):
    cc, recipe, gemm, Mx, Nx, Kx, E, sass_mma, ptx_mma = _AOT[name]
    build = _fp8_build(cc, recipe, gemm, Mx, Nx, Kx, E)
    assert build.arch == f"sm_{cc}a" and build.fits_shared_memory, build.shared
    assert re.search(ptx_mma, build.ptx), f"no {ptx_mma} in the PTX"
    info, sass = _sass(build)
    assert re.search(rf"\b{sass_mma}\b", sass), f"no {sass_mma} in the SASS"
    assert not re.search(r"\bHGMMA\b|UTCHMMA", sass), "a 16-bit MMA: FP8 upcast"
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", info), info
