"""``mtp.ops.grouped_mlp(..., fp8_recipe=)``: the FP8 fused expert MLP (the tokens quantised
once at their source rows, fc1 reading them through the row map and writing its activation
quantised, fc2 on that, the backward's FP8 data gradient with the activation's backward).

fc1's quantised activation bitwise equal to :func:`mtp.ops.quantize` of the activation the
BF16 epilogue computes from the same ``h``, ``h`` against float64 on the dequantised operands;
the MLP's output and every gradient against the ``reference`` backend (dequantised operands in
PyTorch) and against the BF16 MLP (the recipe's error); ragged groups with an empty expert, rows
and F not multiples of 32 / 128, with and without ``gather_index``; launches (one quantisation
of the tokens, none of fc1's output, no permuted copy), no host syncs, argument errors. Outputs
are poisoned (NaN) before the kernels write them."""

from __future__ import annotations

import pytest
import torch

from mtp import settings
from mtp.bench.counting import count_ops
from mtp.ops import Fp8Recipe, Fp8WeightCache, grouped_mlp, quantize
from mtp.ops.grouped_gemm.fp8 import weight_operands
from mtp.ops.grouped_mlp_fp8_ops import fc1, fp8_dact, gathered_rows
from mtp.ops.moe_permute import moe_permute_row_map
from mtp.ops.quantize import quantize_many
from mtp.testing import assert_close, count_host_syncs

RECIPES = ["blockwise", "mxfp8"]
SIZES = [21, 0, 30, 9]  # an empty expert, no count a multiple of 16 or 32; 60 of 64 rows routed
M, H, F_ = 64, 40, 136  # F neither a multiple of 128 nor of 32
T, E, K = 23, 4, 2  # the gathered case: 23 tokens, top-2 of 4 experts (the last one empty)


@pytest.fixture(autouse=True)
def _poison():
    with settings.override(poison_outputs=True):
        yield


def _gathered(seed=0):
    """``(tokens [T, H] bf16, probs [T, E], counts, gather_index, token_map)``."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    scores[:, E - 1] = -1.0
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(
        1, scores.topk(K, dim=1).indices, True)
    probs = torch.rand(T, E, generator=g) * routing_map
    rm = moe_permute_row_map(routing_map, T * K, backend="triton", token_map=True, width=K,
                             pair=False)  # fmt: skip
    x = torch.randn(T, H, generator=g).bfloat16()
    return x, probs, rm.tokens_per_expert, rm.row_id_map, rm.token_map


def _plain(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).bfloat16()
    return x, torch.rand(M, generator=g), torch.tensor(SIZES), None, None


def _weights(act, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = 2 * F_ if act == "swiglu" else F_
    w1 = torch.randn(E, H, w, generator=g) / H**0.5
    w2 = torch.randn(E, F_, H, generator=g) / F_**0.5
    return w1, w2


# --------------------------------------------------------------------------------------------
# fc1: the quantised activation
# --------------------------------------------------------------------------------------------

FC1_CASES = [("blockwise", "swiglu", False), ("blockwise", "gelu", True),
             ("mxfp8", "swiglu", True), ("mxfp8", "gelu", False)]  # fmt: skip


@pytest.mark.parametrize("recipe,act,gather", FC1_CASES)
def test_fc1_writes_the_quantised_activation_bitwise(recipe, act, gather):
    x, probs, counts, index, _ = _gathered() if gather else _plain()
    w1, w2 = _weights(act)
    r = Fp8Recipe(recipe)
    xq = quantize(x, r, backend="triton")
    w1f = weight_operands(w1, r, False, False, "triton")[0]
    rows = M if index is None else index.shape[0]
    h, yq, p = fc1(xq, w1f, counts, probs, index, act, r.scale_kind, 7.0, 1.702, "triton", True,
                   torch.bfloat16, rows, F_)  # fmt: skip
    assert h.dtype == torch.bfloat16 and yq.data.shape == (rows, F_) and yq.layout == "rowwise"
    # h: float64 on the dequantised operands (rows read through the index)
    a = xq.dequantize().double()
    want_p = probs.float()
    if index is not None:
        a, want_p = gathered_rows(a, probs, index, counts)
        assert torch.equal(p, want_p.float()), "the rows' probabilities fc1 wrote"
    want, start = torch.zeros(rows, h.shape[1], dtype=torch.float64), 0
    for e, m in enumerate(counts.tolist()):
        want[start : start + m] = a[start : start + m] @ w1f.dequantize()[e].double()
        start += m
    assert_close(h, want, torch.bfloat16, msg="h")
    assert torch.equal(h[start:].float(), torch.zeros_like(h[start:].float())), "zero tail"
    # the activation the BF16 epilogue computes from the same h (fc2's backward recomputes it
    # with that epilogue), quantised by mtp.ops.quantize: the same bytes
    w2d = weight_operands(w2, r, False, True, "triton")[1]
    dq = quantize(torch.randn(rows, H).bfloat16(), r, backend="triton")
    _, _, y = fp8_dact(dq, w2d, counts, h, p, act, 7.0, 1.702, True, "triton", True)
    ref = quantize(y, r, backend="triton")
    assert torch.equal(yq.data.view(torch.uint8), ref.data.view(torch.uint8)), "data"
    assert torch.equal(yq.scales.view(torch.uint8), ref.scales.view(torch.uint8)), "scales"


# --------------------------------------------------------------------------------------------
# The MLP: output and gradients
# --------------------------------------------------------------------------------------------


def _run(case, w1, w2, act, **kw):
    x, probs, counts, index, token_map = case
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, probs)]
    out = grouped_mlp(leaves[0], leaves[1], leaves[2], counts, leaves[3], activation=act,
                      gather_index=index, token_map=token_map, validate=False, **kw)  # fmt: skip
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    out.backward(dy)
    return {"out": out.detach(), **{n: t.grad for n, t in zip(("dx", "dw1", "dw2", "dp"), leaves)}}


def _high(case):
    """The case with fp32 tokens: the MLP without FP8 in high precision."""
    return (case[0].float(), *case[1:])


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("gather", [False, True])
def test_output_and_gradients(recipe, gather):
    """Triton against the reference backend (the same recipe on dequantised operands: FP8
    rounding of neighbouring values only) and against the BF16 MLP (in fp32: the recipe's
    error); gradients in the master weights' dtype; exact zeros past the routed rows."""
    case = _gathered() if gather else _plain()
    w1, w2 = _weights("swiglu")
    got = _run(case, w1, w2, "swiglu", backend="triton", fp8_recipe=recipe)
    ref = _run(case, w1, w2, "swiglu", backend="reference", fp8_recipe=recipe)
    bf16 = _run(_high(case), w1, w2, "swiglu", backend="reference")
    assert got["dw1"].dtype == got["dw2"].dtype == torch.float32
    assert got["dx"].dtype == torch.bfloat16 and got["dp"].dtype == torch.float32
    routed = int(case[2].sum())
    assert torch.equal(got["out"][routed:].float(), torch.zeros_like(got["out"][routed:].float()))
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
        assert _rel(value, ref[name]) < 0.05, (name, "reference", _rel(value, ref[name]))
        limit = 0.15 if name == "dp" else 0.08  # sum_f dL/dy * act(h): cancellation
        assert _rel(value, bf16[name]) < limit, (name, "bf16", _rel(value, bf16[name]))


def test_gelu_bf16_weight_gradient_and_main_grad():
    """``recipe.wgrad="bf16"`` with the row gather (fc1's weight gradient reads the BF16 tokens
    through the index) and the main-grad accumulation: the same gradients added to main_grad."""
    case = _gathered(3)
    w1, w2 = _weights("gelu")
    recipe = Fp8Recipe("blockwise", wgrad="bf16")
    plain = _run(case, w1, w2, "gelu", backend="triton", fp8_recipe=recipe)
    bf16 = _run(_high(case), w1, w2, "gelu", backend="reference")
    for name, value in plain.items():
        limit = 0.15 if name == "dp" else 0.08
        assert _rel(value, bf16[name]) < limit, (name, _rel(value, bf16[name]))
    x, probs, counts, index, token_map = case
    w1a, w2a = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    for w in (w1a, w2a):
        w.main_grad = torch.full(w.shape, 0.5)
    out = grouped_mlp(x, w1a, w2a, counts, probs, activation="gelu", gather_index=index,
                      token_map=token_map, backend="triton", fp8_recipe=recipe,
                      gradient_accumulation_fusion=True)  # fmt: skip
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16())
    assert w1a.grad is None and w2a.grad is None
    assert_close(w1a.main_grad - 0.5, plain["dw1"], torch.bfloat16, msg="dw1")  # BF16 wgrad
    assert_close(w2a.main_grad - 0.5, plain["dw2"], torch.bfloat16, msg="dw2")


# --------------------------------------------------------------------------------------------
# Structure: launches, quantisations, no permuted copy
# --------------------------------------------------------------------------------------------


def test_forward_quantises_the_tokens_once_and_copies_no_rows(monkeypatch):
    """With the row gather: the weights come from the cache, the tokens are quantised once at
    their T source rows, fc1's output is written quantised (no quantisation of it), and no aten
    op touches the rows (no gather / permuted copy): three launches."""
    from mtp.ops import grouped_mlp_fp8 as mod

    x, probs, counts, index, token_map = _gathered()
    w1, w2 = _weights("swiglu")
    cache = Fp8WeightCache()
    kw = dict(activation="swiglu", gather_index=index, token_map=token_map, backend="triton",
              fp8_recipe="blockwise", fp8_weight_cache=cache, validate=False)  # fmt: skip
    grouped_mlp(x, w1, w2, counts, probs, **kw)  # fills the cache
    shapes = []

    def counting(t, *args, **kwargs):
        shapes.append(tuple(t.shape))
        return quantize_many(t, *args, **kwargs)

    monkeypatch.setattr(mod, "quantize_many", counting)
    grouped_mlp(x, w1, w2, counts, probs, **kw)
    assert shapes == [(T, H)], "the tokens once, at their source rows"
    assert cache.hits == 2, "both weights from the cache"
    with count_host_syncs() as syncs:
        grouped_mlp(x, w1, w2, counts, probs, **kw)
    assert syncs.count == 0
    with count_ops() as ops:  # traced path (a dispatch mode: the custom ops, the cache bypassed)
        grouped_mlp(x, w1, w2, counts, probs, **kw)
    assert ops.triton["grouped_gemm_fp8_act_kernel"] == 1
    assert ops.triton["grouped_gemm_fp8_kernel"] == 1
    # quantize launches: the tokens and the two weights (uncached while traced)
    assert ops.triton["quantize_kernel"] == 3, ops.triton
    assert set(ops.triton) == {"grouped_gemm_fp8_act_kernel", "grouped_gemm_fp8_kernel",
                               "quantize_kernel"}, ops.triton  # fmt: skip
    assert not ops.host_syncs
    copies = {n for n in ops.compute if "index" in n or "gather" in n or "copy" in n}
    assert not copies, copies


@pytest.mark.parametrize("recipe", RECIPES)
def test_custom_op_path_without_host_syncs(recipe):
    """Forward and backward with the row gather under a dispatch mode (the custom ops and their
    bodies, as torch.compile sees them): no host sync, the eager path's values bitwise."""
    case = _gathered(7)
    w1, w2 = _weights("swiglu")
    with pytest.MonkeyPatch.context() as mp:  # the eager path runs the bodies, no custom op
        for name in ("grouped_mlp_fp8_fc1", "grouped_mlp_fp8_dact", "quantize_fp8",
                     "grouped_gemm_fp8_out", "grouped_gemm_fp8_wgrad"):  # fmt: skip
            mp.setattr(torch.ops.mtp, name, lambda *a, **k: pytest.fail("a custom op"))
        want = _run(case, w1, w2, "swiglu", backend="triton", fp8_recipe=recipe)
    with count_host_syncs() as syncs:
        got = _run(case, w1, w2, "swiglu", backend="triton", fp8_recipe=recipe)
    assert syncs.count == 0
    for name, value in got.items():
        assert torch.equal(value, want[name]), name


def test_compiled_equals_eager():
    """torch.compile (aot_eager: the custom ops and their fakes, forward and backward traced)
    gives the eager values, with the row gather."""
    x, probs, counts, index, token_map = _gathered(9)
    w1, w2 = _weights("gelu")
    case = (x, probs, counts, index, token_map)
    want = _run(case, w1, w2, "gelu", backend="triton", fp8_recipe="blockwise")

    def f(x, w1, w2, probs):
        return grouped_mlp(x, w1, w2, counts, probs, activation="gelu", gather_index=index,
                           token_map=token_map, backend="triton", fp8_recipe="blockwise",
                           validate=False)  # fmt: skip

    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, probs)]
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16())
    assert torch.equal(out.detach(), want["out"])
    for name, leaf in zip(("dx", "dw1", "dw2", "dp"), leaves):
        assert torch.equal(leaf.grad, want[name]), name


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_argument_errors():
    x, probs, counts, _, _ = _plain()
    w1, w2 = _weights("swiglu")
    def call(**kw):
        kw = {"fp8_recipe": "blockwise", "backend": "reference", **kw}
        return grouped_mlp(x, w1, w2, counts, probs, **kw)

    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        call(fp8_recipe="fp4")
    with pytest.raises(TypeError, match="fp8_recipe must be None, a str"):
        call(fp8_recipe=8)
    with pytest.raises(TypeError, match="fp8_weight_cache must be"):
        call(fp8_weight_cache={})
    with pytest.raises(ValueError, match="scatter_index is not supported with fp8_recipe"):
        call(scatter_index=torch.arange(x.shape[0]))
    with pytest.raises(ValueError, match="fp8_weight_cache is for FP8"):
        call(fp8_recipe=None, fp8_weight_cache=Fp8WeightCache())
    with pytest.raises(ValueError, match="bias1 / bias2"):
        grouped_mlp(x, w1, w2, counts, probs, torch.zeros(E, 2 * F_), fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="weight2 must be"):
        grouped_mlp(x, w1, w2[:, :-1], counts, probs, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="activation must be one of"):
        call(activation="relu2")
    with pytest.raises(ValueError, match="probs must be"):
        grouped_mlp(x, w1, w2, counts, probs[:-1], fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="tokens_per_expert must be"):
        grouped_mlp(x, w1, w2, counts[:-1], probs, fp8_recipe="blockwise")
    with pytest.raises(TypeError, match="token_map"):
        grouped_mlp(x, w1, w2, counts, None, fp8_recipe="blockwise",
                    gather_index=torch.zeros(M, dtype=torch.int64))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Ahead-of-time builds: FP8 tensor cores, no spills
# --------------------------------------------------------------------------------------------


def _aot_build(cc, recipe, which):
    """fc1's FP8 kernel (SwiGLU, row gather, probabilities) or fc2's data gradient with the
    activation's backward, with the tiles the op picks, K-major operands, strides multiples
    of 16 (a DeepSeek-like shape: 128 experts, H 2048, F 2048)."""
    from mtp.kernels.grouped_gemm_details import fp8_act as ka
    from mtp.ops.grouped_mlp_fp8_ops import act_tiles, dact_tiles
    from mtp.testing import compile_for_targets

    mx = recipe == "mxfp8"
    scale = "*u8" if mx else "*fp32"
    Ex = 128
    consts = dict(stride_ak=1, stride_bk=1, BLOCK_E=Ex, GROUP_K=32 if mx else 128,
                  GROUP_N=1 if mx else 128, MX=mx, ACT=2, LIMIT=7.0, ALPHA=1.702)  # fmt: skip
    if which == "act":
        bm, bn, bk, gm, warps, stages = act_tiles(cc // 10, recipe)
        kernel = ka.grouped_gemm_fp8_act_kernel
        ptrs = dict(a_ptr="*fp8e4nv", sa_ptr=scale, b_ptr="*fp8e4nv", sb_ptr=scale,
                    h_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr=scale, p_ptr="*fp32",
                    g_ptr="*i64", pp_ptr="*fp32", counts_ptr="*i64")  # fmt: skip
        ints = ["M", "F", "K", "E", "stride_am", "stride_sam", "stride_sak", "stride_be",
                "stride_bn", "stride_sbe", "stride_sbk", "stride_sbn", "stride_hm", "stride_qm",
                "stride_sm", "stride_ps"]  # fmt: skip
        consts.update(stride_pe=1, GROUP_Q=32 if mx else 128, HAS_PROB=True, GATHER=True,
                      ROW_PROBS=True, SCALE=2 if mx else 0, SOFT_CVT=False)  # fmt: skip
    else:
        bm, bn, bk, gm, warps, stages = dact_tiles(cc // 10, recipe)
        kernel = ka.grouped_gemm_fp8_dact_kernel
        ptrs = dict(a_ptr="*fp8e4nv", sa_ptr=scale, b_ptr="*fp8e4nv", sb_ptr=scale,
                    h_ptr="*bf16", p_ptr="*fp32", dh_ptr="*bf16", part_ptr="*fp32",
                    y_ptr="*bf16", counts_ptr="*i64")  # fmt: skip
        ints = ["M", "F", "K", "E", "stride_am", "stride_sam", "stride_sak", "stride_be",
                "stride_bn", "stride_sbe", "stride_sbk", "stride_sbn", "stride_hm", "stride_dm",
                "stride_ym"]  # fmt: skip
        consts.update(HAS_PROB=True, RECOMPUTE=True)
    consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm)
    signature = {**ptrs, **{name: "i32" for name in ints}}
    divisible = [k for k in ints if k.startswith("stride")] + ["F", "K"]
    return compile_for_targets(kernel, signature, consts, targets=(cc,), num_warps=warps,
                               num_stages=stages, divisible_by_16=divisible)[cc]


_AOT = {  # name: (cc, recipe, kernel, SASS MMA)
    "sm90_blockwise_fc1": (90, "blockwise", "act", "QGMMA"),
    "sm90_blockwise_dact": (90, "blockwise", "dact", "QGMMA"),
    "sm100_blockwise_fc1": (100, "blockwise", "act", "UTCQMMA"),
    "sm100_blockwise_dact": (100, "blockwise", "dact", "UTCQMMA"),
    "sm100_mxfp8_fc1": (100, "mxfp8", "act", "UTCQMMA"),
    "sm100_mxfp8_dact": (100, "mxfp8", "dact", "UTCQMMA"),
}


@pytest.mark.parametrize("name", sorted(_AOT))
def test_aot_fp8_mlp_kernels_tensor_cores_and_no_spills(name):
    import re

    from test_grouped_gemm_tma import _sass

    cc, recipe, which, mma = _AOT[name]
    build = _aot_build(cc, recipe, which)
    assert build.arch == f"sm_{cc}a" and build.fits_shared_memory, build.shared
    info, sass = _sass(build)
    assert re.search(rf"\b{mma}\b", sass), f"no {mma} in the SASS"
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", info), info


def test_gathered_rows_tolerates_an_unwritten_index():
    """The backward's materialised gather (fc1's FP8 weight gradient) reads an index that a
    recording pass (kernels counted, not launched: the bench's structure table) never wrote:
    no IndexError, and the -1 rows stay zero."""
    from mtp.ops.grouped_mlp_fp8_ops import gathered_rows

    x = torch.randn(5, 4)
    gather = torch.tensor([2, -1, torch.iinfo(torch.int32).max, 0], dtype=torch.int32)
    rows, _ = gathered_rows(x, None, gather, torch.tensor([4]))
    assert torch.equal(rows[0], x[2]) and torch.equal(rows[3], x[0]) and not rows[1].any()
    empty, _ = gathered_rows(x[:0], None, torch.full((3,), -1), torch.tensor([3]))
    assert empty.shape == (3, 4) and not empty.any()
