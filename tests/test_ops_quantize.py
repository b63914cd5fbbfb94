"""FP8 quantisation (mtp.ops.quantize, mtp.kernels.quantize): the Triton kernel bit for bit
against the PyTorch definition on random, all-zero, extreme, denormal and NaN inputs, every
layout and recipe; the definition itself against float64; the expert-padded column-wise layout;
bytes / floor, launches and host syncs; the custom op's fake; sm_90a / sm_100a builds."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mtp import settings
from mtp.kernels import quantize as kq
from mtp.ops import Fp8Recipe, Fp8Tensor, quantize
from mtp.ops.quantize.reference import padded_rows
from mtp.testing import compile_for_targets, count_host_syncs
from mtp.testing.traffic import count_traffic

FLT_MAX = torch.finfo(torch.float32).max
LAYOUTS = [("blockwise", "rowwise"), ("blockwise", "colwise"), ("blockwise", "block"),
           ("mxfp8", "rowwise"), ("mxfp8", "colwise")]  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def _inputs(kind: str, shape=(37, 300), dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    if kind == "zeros":
        x.zero_()
    elif kind == "extreme":  # +-inf, the largest finite values, a huge and a tiny row
        x[..., 3, 5], x[..., 4, 9], x[..., 7, 0] = float("inf"), -float("inf"), FLT_MAX
        x[..., 5, :] *= 1e30
        x[..., 6, :] *= 1e-30
        x[..., 8, 1] = -0.0
    elif kind == "denormal":  # fp32 denormals (bf16 keeps fp32's exponent range)
        x = x * 2.0**-128
        x[..., 0, :] = 0.0
        x[..., 0, 3] = 2.0**-149
    elif kind == "nan":
        x[..., 2, 2] = float("nan")
        x[..., 10, :] = float("nan")
    return x.to(dtype)


def _same(t: Fp8Tensor, r: Fp8Tensor, rows: int | None = None) -> None:
    assert t.data.shape == r.data.shape and t.scales.shape == r.scales.shape
    assert t.data.dtype == torch.float8_e4m3fn and t.scales.dtype == r.scales.dtype
    d, s = (t.data, t.scales) if rows is None else (t.data[:rows], t.scales[: rows // t.block[0]])
    rd, rs = (r.data, r.scales) if rows is None else (r.data[:rows], r.scales[: rows // r.block[0]])
    assert torch.equal(_bits(s), _bits(rs)), "scales"
    bad = (_bits(d) != _bits(rd)).nonzero()
    assert bad.numel() == 0, f"data differs at {bad[:5].tolist()}"


KINDS = ("random", "zeros", "extreme", "denormal", "nan")


@pytest.mark.parametrize("recipe,layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_bitwise_equals_reference(recipe, layout, dtype):
    """Every kind of input in its own batch (a block never mixes two kinds)."""
    x = torch.stack([_inputs(kind, (37, 300), torch.float32, seed=i)
                     for i, kind in enumerate(KINDS)]).to(dtype)  # fmt: skip
    for pow2 in (False, True) if recipe == "blockwise" else (False,):
        t = quantize(x, recipe, layout, pow2_scales=pow2, backend="triton")
        r = quantize(x, recipe, layout, pow2_scales=pow2, backend="reference")
        _same(t, r)
        if layout == "colwise":  # the blocked axis is stored contiguously
            assert t.data.stride(-2) == 1 and t.scales.stride(-2) == 1


def test_weights_3d_every_layout():
    w = _inputs("random", (3, 200, 136), torch.float16, seed=1)
    for recipe, layout in LAYOUTS:
        t = quantize(w, recipe, layout, backend="triton")
        _same(t, quantize(w, recipe, layout, backend="reference"))
        assert t.data.shape == w.shape


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_reference_is_the_definition_in_float64(recipe):
    """x / scale rounded by torch's e4m3 conversion, scale = max(amax / 448, 2^-126) (and the
    power of two above it: e8m0 by its definition, 2^(byte - 127)), computed in float64."""
    x = _inputs("random", (5, 256), torch.float32) * torch.logspace(-8, 8, 256)
    t = quantize(x, recipe, "rowwise", backend="reference")
    b = t.block[1]
    blocks = x.double().reshape(5, -1, b)
    # the fp32 quotient (a float64 quotient of fp32 values rounds to it exactly)
    scale = torch.clamp(blocks.abs().amax(-1) / 448, min=2.0**-126).float().double()
    if recipe == "mxfp8":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        code = t.scales.view(torch.uint8).double()
        assert torch.equal(torch.exp2(code - 127), scale)
    assert torch.equal(t.scales.double(), scale)
    q = (blocks / scale[..., None]).float().reshape(5, 256).to(torch.float8_e4m3fn)
    assert torch.equal(_bits(t.data), _bits(q))
    # e4m3's normal range (2^-6 .. 448) below the block's maximum: half an ulp of 3 bits
    normal = blocks.abs() >= blocks.abs().amax(-1, keepdim=True) * 2.0**-14
    err = (t.dequantize().double().reshape(blocks.shape) - blocks).abs() / blocks.abs()
    assert err[normal].max() <= 2.0**-4


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_grouped_colwise_pads_every_expert(recipe):
    """Rows grouped by expert (empty ones, counts not multiples of the block, a zero tail):
    every expert starts on a block, its padding and its block's scale are what the
    reference's zero-padded copy gives."""
    counts = torch.tensor([0, 45, 3, 0, 20, 33])
    x = _inputs("random", (110, 72))
    t = quantize(x, recipe, "colwise", tokens_per_expert=counts, backend="triton")
    r = quantize(x, recipe, "colwise", tokens_per_expert=counts, backend="reference")
    b = t.block[0]
    assert t.padded and t.data.shape == (padded_rows(110, 6, b), 72)
    used = sum(-(-c // b) for c in counts.tolist()) * b
    _same(t, r, rows=used)
    pos = start = 0
    for c in counts.tolist():
        rows = t.dequantize()[pos : pos + c]
        exact = quantize(x[start : start + c], recipe, "colwise", backend="reference")
        assert torch.equal(rows, exact.dequantize()), "an expert's blocks are its own"
        pad = -c % b
        assert torch.equal(_bits(t.data[pos + c : pos + c + pad]),
                           torch.zeros(pad, 72, dtype=torch.uint8)), "padding"  # fmt: skip
        pos, start = pos + c + pad, start + c


def test_recipe_and_argument_errors():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="layout must be one of"):
        quantize(x, "blockwise", "diagonal")
    with pytest.raises(ValueError, match="'blockwise' recipe's"):
        quantize(x, "mxfp8", "block")
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        quantize(x, "nvfp4")
    with pytest.raises(ValueError, match="tokens_per_expert groups the rows"):
        quantize(x, "blockwise", "rowwise", tokens_per_expert=torch.tensor([8]))
    with pytest.raises(TypeError, match="x"):
        quantize(torch.ones(8, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        quantize(torch.ones(2, 2, 8, 64))
    with pytest.raises(RuntimeError, match="sum to at most"):
        quantize(x, "blockwise", "colwise", tokens_per_expert=torch.tensor([5, 5]),
                 backend="triton")  # fmt: skip
    assert Fp8Recipe("mxfp8").scale_kind == "e8m0" and Fp8Recipe(pow2_scales=True).block == 128


def test_fake_shapes_match_the_kernel():
    x = torch.randn(50, 72, dtype=torch.bfloat16)
    counts = torch.tensor([20, 0, 30])
    eager = [quantize(x, r, layout, tokens_per_expert=counts if layout == "colwise" else None,
                      backend="triton") for r, layout in LAYOUTS]  # fmt: skip
    with FakeTensorMode() as mode:
        fx, fc = mode.from_tensor(x), mode.from_tensor(counts)
        fake = [quantize(fx, r, layout, tokens_per_expert=fc if layout == "colwise" else None,
                         backend="triton") for r, layout in LAYOUTS]  # fmt: skip
    for e, f in zip(eager, fake):
        assert (e.data.shape, e.data.stride(), e.scales.shape, e.scales.dtype) == (
            f.data.shape, f.data.stride(), f.scales.shape, f.scales.dtype)


# --------------------------------------------------------------------------------------------
# Bytes, launches, host syncs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_bytes_launches_and_no_host_sync(recipe):
    settings.configure(poison_outputs=False)
    M, K, b = 96, 512, Fp8Recipe(recipe).block
    x = torch.randn(M, K, dtype=torch.bfloat16)
    scale_bytes = 1 if recipe == "mxfp8" else 4
    with count_traffic() as t:
        quantize(x, recipe, backend="triton")
    floor = 2 * M * K + M * K + M * (K // b) * scale_bytes
    assert t.ratio(floor) <= 1.10, t.summary(floor)
    assert t.device_ops == 1 and t.num_host_syncs == 0
    counts = torch.tensor([40, 0, 33, 20])
    with count_traffic() as t:
        g = quantize(x, recipe, "colwise", tokens_per_expert=counts, backend="triton")
    rows = g.data.shape[0]
    floor = 2 * 93 * K + rows * K + rows // b * K * scale_bytes  # routed rows, padded output
    assert t.ratio(floor) <= 1.10, t.summary(floor)
    assert t.num_launches == 2 and t.num_host_syncs == 0  # the tile map and the quantiser
    with count_host_syncs() as syncs:
        quantize(x, recipe, "colwise", tokens_per_expert=counts, backend="triton")
    assert syncs.count == 0


# --------------------------------------------------------------------------------------------
# Ahead-of-time builds: e4m3 conversion instruction, correctly rounded division, no spills
# --------------------------------------------------------------------------------------------

_VARIANTS = {  # name: (group, ROW, COL, SQUARE, GROUPED, SCALE)
    "row_blockwise": (128, True, False, False, False, 0),
    "row_mxfp8": (32, True, False, False, False, 2),
    "row_col_grouped_blockwise": (128, True, True, False, True, 1),
    "row_col_grouped_mxfp8": (32, True, True, False, True, 2),
    "square_with_copy": (128, False, True, True, False, 0),
}


def _quantize_build(group, row, col, square, grouped, scale):
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*u8" if scale == 2 else "*fp32",
           "qt_ptr": "*fp8e4nv", "st_ptr": "*u8" if scale == 2 else "*fp32", "map_ptr": "*i32",
           "R": "i32", "C": "i32", "E": "i32"}  # fmt: skip
    sig.update({f"stride_{p}{d}": "i32" for p in "xqstu" for d in "brc"})
    block_r, block_c, chunk, warps = kq.tile_shape(group, row, col, square)
    constexprs = dict(BLOCK_R=block_r, BLOCK_C=block_c, CHUNK=chunk, GROUP=group, ROW=row,
                      COL=col, SQUARE=square, GROUPED=grouped, SCALE=scale, SOFT_CVT=False)
    for unit in ["stride_xc", "stride_qc", "stride_sc"] + (
            ["stride_tc"] if square else ["stride_tr", "stride_ur"]):  # fmt: skip
        del sig[unit]
        constexprs[unit] = 1
    divisible = [k for k in sig if k.startswith("stride")] + ["C"]
    return compile_for_targets(kq.quantize_kernel, sig, constexprs, num_warps=warps,
                               num_stages=1, divisible_by_16=divisible)  # fmt: skip


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_aot_quantize_kernel(variant):
    builds = _quantize_build(*_VARIANTS[variant])
    assert set(builds) == {90, 100}
    for build in builds.values():
        assert "cvt.rn.satfinite.e4m3x2.f32" in build.ptx, "the hardware e4m3 conversion"
        assert "div.full" not in build.ptx, "an approximate division"
        assert re.search(r"ld\.global\.v4", build.ptx), "vector loads"
        info = build.ptxas()
        assert info is None or not info.spills, info.output


def test_scale_floor_constants():
    assert kq.SCALE_MIN == 2.0**-126 == math.ldexp(1.0, -126)
    assert kq.E4M3_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
