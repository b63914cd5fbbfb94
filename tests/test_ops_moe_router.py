"""mtp.ops.moe_router: the fused router kernels against a float64 oracle, every routing variant,
fp32/bf16/fp16/fp64 logits, statistics, ties, launches, host syncs, determinism, AOT builds.

The oracle is Megatron-Core's routing written in float64 with one change: its top-k breaks ties
by the lowest expert index (a stable sort), the kernel's documented rule (and CUDA's
``torch.topk``: its single-block kernel fills the k-th value's ties in index order; the CPU one
uses ``nth_element`` and does not). Where the kernel's choice differs from the oracle's, the
oracle's selection values must tie there within the rounding of the kernel's math.
"""

from __future__ import annotations

import re

import pytest
import torch

from mtp import settings
from mtp.kernels import moe_router as kernels
from mtp.ops.moe_router import moe_router
from mtp.testing import assert_close, compile_for_targets, count_host_syncs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
VARIANTS = {
    "softmax": dict(),
    "softmax-bias": dict(expert_bias=True),
    "pre": dict(pre_softmax=True),
    "pre-norm-scale": dict(pre_softmax=True, norm_topk_prob=True, scaling_factor=1.5),
    "pre-groups-topk": dict(pre_softmax=True, num_groups=4, group_topk=2),
    "pre-bias-groups-top2": dict(pre_softmax=True, expert_bias=True, num_groups=2, group_topk=1,
                                 group_score="top2"),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid-raw-scale": dict(score_function="sigmoid", norm_topk_prob=False,
                              scaling_factor=2.5),
    "sigmoid-bias-groups-top2": dict(score_function="sigmoid", expert_bias=True, num_groups=4,
                                     group_topk=2, group_score="top2", scaling_factor=2.827),
}


# --- float64 oracle ----------------------------------------------------------------------------


def _top(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim: NaN largest, ties to the lowest index."""
    key = torch.where(torch.isnan(v), torch.full_like(v, float("inf")), v)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def _mask(idx: torch.Tensor, width: int) -> torch.Tensor:
    return torch.zeros((*idx.shape[:-1], width), dtype=torch.bool).scatter(-1, idx, True)


def oracle(x, topk, padding_mask=None, score_function="softmax", pre_softmax=False,
           norm_topk_prob=None, num_groups=None, group_topk=None, group_score="topk",
           scaling_factor=None, expert_bias=None):  # fmt: skip
    """``(probs, map, selection values, scores_sum, aux counts, routed counts, lse_sq_sum)`` of
    float64 ``x`` (differentiable in ``x``)."""
    T, E = x.shape
    soft, sig = torch.softmax(x, -1), torch.sigmoid(x)
    base = sig if score_function == "sigmoid" else soft
    sel = (x if score_function == "softmax" and not pre_softmax else base).detach()
    if expert_bias is not None:
        sel = sel + expert_bias.double()
    if group_topk:
        grouped = sel.view(T, num_groups, E // num_groups)
        m = min(2 if group_score == "top2" else topk // group_topk, E // num_groups)
        gscore = torch.sort(grouped, -1, descending=True).values[..., :m].sum(-1)
        keep = _mask(_top(gscore, group_topk), num_groups)
        sel = torch.where(keep[:, :, None], grouped, float("-inf")).view(T, E)
    rmap = _mask(_top(sel, topk), E)
    if score_function == "softmax" and not pre_softmax:
        e = torch.where(rmap, torch.exp(x - x.max(-1, keepdim=True).values), 0.0)
        probs = e / e.sum(-1, keepdim=True)
    else:
        probs = base * rmap
        renorm = topk > 1 if (norm_topk_prob is None and score_function == "sigmoid") else bool(
            norm_topk_prob)  # fmt: skip
        if renorm:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    valid = torch.ones(T, 1, dtype=torch.bool) if padding_mask is None else ~padding_mask[:, None]
    aux = oracle_aux_scores(x, score_function)
    amap = _mask(_top(aux.detach(), topk), E)
    lse = torch.logsumexp(x, -1)
    return (probs, rmap, sel, (aux * valid).sum(0), (amap & valid).sum(0).double(),
            (rmap & valid).sum(0).double(), (lse * lse * valid[:, 0]).sum())  # fmt: skip


def oracle_aux_scores(x: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(x, -1)
    sig = torch.sigmoid(x)
    return sig / (sig.sum(-1, keepdim=True) + 1e-20)


def _ambiguous_rows(scores: torch.Tensor, topk: int, eps: float) -> int:
    """Rows whose k-th and (k+1)-th largest values are within ``eps`` (relative)."""
    if topk >= scores.shape[1] or scores.shape[0] == 0:
        return 0
    top = torch.sort(scores, -1, descending=True).values
    gap = top[:, topk - 1] - top[:, topk]
    return int((gap <= eps * (1 + top[:, topk - 1].abs())).sum())


def _inputs(T, E, dtype, kw, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g, dtype=torch.float64) * 2).to(dtype)
    kw = dict(kw)
    if kw.get("expert_bias"):
        kw["expert_bias"] = torch.randn(E, generator=g) * 0.3
    pad = torch.rand(T, generator=g) < 0.25
    return logits, kw, pad, g


def _near_tie_rows(got_map, ref_map, sel, topk, dtype):
    """Rows where the maps differ; each must be a near-tie of the oracle's selection values."""
    rows = (got_map != ref_map).any(1).nonzero().flatten().tolist()
    eps = 1e-12 if dtype == torch.float64 else 4e-6
    for r in rows:
        kth = torch.sort(sel[r], descending=True).values[topk - 1]
        picked = sel[r][got_map[r]]
        assert picked.min() >= kth - eps * (1 + kth.abs()), (r, sel[r], got_map[r], ref_map[r])
    return rows


def check_router(T, E, topk, dtype, kw, seed=0, pad=True):
    """Forward outputs, statistics and the logits gradient against :func:`oracle`."""
    logits, kw, mask, g = _inputs(T, E, dtype, kw, seed)
    mask = mask if pad else None
    x = logits.clone().requires_grad_(True)
    out = moe_router(x, topk, padding_mask=mask, aux_statistics=True, z_statistics=True,
                     routed_counts=True, backend="triton", **kw)  # fmt: skip
    x64 = logits.double().requires_grad_(True)
    probs, rmap, sel, ssum, acount, rcount, zsum = oracle(x64, topk, mask, **kw)
    math = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.probs.dtype == dtype and out.routing_map.dtype == torch.bool
    assert out.scores_sum.dtype == out.lse_sq_sum.dtype == math
    assert (out.routing_map.sum(1) == topk).all()
    bad = _near_tie_rows(out.routing_map, rmap, sel, topk, dtype)
    same = torch.ones(T, dtype=torch.bool)
    same[bad] = False
    assert_close(out.probs[same], probs.detach()[same], dtype, msg="probs")
    assert_close(out.scores_sum, ssum.detach(), math, msg="scores_sum")
    assert_close(out.lse_sq_sum, zsum.detach(), math, msg="lse_sq_sum")
    if not bad:
        assert torch.equal(out.tokens_per_expert, rcount.to(math)), "tokens_per_expert"
    # the aux-loss top-k: exact but on rows whose k-th and next aux score tie within rounding
    aux = oracle_aux_scores(x64.detach(), kw.get("score_function", "softmax"))
    near = _ambiguous_rows(aux, topk, 1e-12 if dtype == torch.float64 else 4e-6)
    moved = (out.aux_tokens_per_expert.double() - acount).abs().sum()
    assert moved <= 2 * topk * near, (moved, near, out.aux_tokens_per_expert, acount)
    dprobs = torch.randn(T, E, generator=g, dtype=torch.float64)
    a = torch.randn(E, generator=g, dtype=torch.float64)
    loss = (out.probs.double() * dprobs).sum() + (out.scores_sum.double() * a).sum()
    (loss + 0.37 * out.lse_sq_sum.double()).backward()
    ((probs * dprobs).sum() + (ssum * a).sum() + 0.37 * zsum).backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad[same], x64.grad[same], dtype, msg="dlogits")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_float64(variant, dtype):
    check_router(37, 16, 4, dtype, VARIANTS[variant], seed=hash(variant) % 1000)


SHAPES = [(0, 8, 2), (1, 8, 1), (1, 256, 8), (50, 256, 8), (33, 64, 3), (20, 128, 6),
          (17, 8, 8), (300, 8, 2), (9, 12, 5), (6, 96, 7)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,E,topk", SHAPES)
@pytest.mark.parametrize("variant", ["softmax", "pre", "sigmoid-bias-groups-top2"])
def test_shapes_and_topk(variant, T, E, topk, dtype):
    kw = VARIANTS[variant]
    if kw.get("num_groups") and topk > kw["group_topk"] * E // kw["num_groups"]:
        pytest.skip("the chosen groups hold fewer than topk experts")
    check_router(T, E, topk, dtype, kw, seed=T + E + topk, pad=T % 2 == 0)


def test_group_score_topk_with_several_per_group():
    check_router(40, 32, 6, torch.float32, dict(num_groups=8, group_topk=2), seed=3)
    check_router(40, 32, 6, torch.bfloat16,
                 dict(score_function="sigmoid", num_groups=8, group_topk=3), seed=4)


def test_ties_go_to_the_lowest_index_and_nan_is_largest():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [1.0, float("nan"), 3.0, float("nan"), 3.0, 0.0],
                           [float("-inf")] * 6])  # fmt: skip
    for kw in (dict(), dict(pre_softmax=True), dict(score_function="sigmoid")):
        rmap = moe_router(logits, 2, backend="triton", **kw).routing_map
        assert rmap[0].nonzero().flatten().tolist() == [1, 2], kw
        assert rmap[1].nonzero().flatten().tolist() == [0, 1], kw
        assert rmap[3].nonzero().flatten().tolist() == [0, 1], kw
    rmap = moe_router(logits, 2, backend="triton").routing_map
    assert rmap[2].nonzero().flatten().tolist() == [1, 3]
    # grouped: equal groups keep the first ones; within them the lowest indices
    tie = torch.zeros(3, 8)
    rmap = moe_router(tie, 2, num_groups=4, group_topk=2, backend="triton").routing_map
    assert (rmap.nonzero()[:, 1].view(3, 2) == torch.tensor([0, 1])).all()


def test_reference_backend_matches_the_oracle_without_ties():
    """The aten path (today's Megatron maths with torch.topk) agrees with the oracle where no
    two selection values tie, so the oracle stands for Megatron-Core's semantics."""
    for name, kw in VARIANTS.items():
        logits, kw, mask, _ = _inputs(29, 16, torch.float64, kw, 7)
        out = moe_router(logits, 4, padding_mask=mask, aux_statistics=True, z_statistics=True,
                         routed_counts=True, backend="reference", **kw)  # fmt: skip
        probs, rmap, _, ssum, acount, rcount, zsum = oracle(logits, 4, mask, **kw)
        assert torch.equal(out.routing_map, rmap), name
        assert_close(out.probs, probs, torch.float64, msg=name)
        assert_close(out.scores_sum, ssum, torch.float64, msg=name)
        assert torch.equal(out.aux_tokens_per_expert, acount), name
        assert torch.equal(out.tokens_per_expert, rcount), name
        assert_close(out.lse_sq_sum, zsum, torch.float64, msg=name)


def test_statistics_are_deterministic_over_several_programs():
    logits, kw, mask, _ = _inputs(1000, 64, torch.float32, VARIANTS["sigmoid"], 8)
    assert triton_programs(1000, 64, stats=True) > 1
    runs = [moe_router(logits, 4, padding_mask=mask, aux_statistics=True, z_statistics=True,
                       routed_counts=True, backend="triton", **kw) for _ in range(2)]  # fmt: skip
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    assert int(kernels.ticket_counter(logits.device)) == 0  # the last program reset it


def triton_programs(T: int, E: int, stats: bool) -> int:
    block_t, _, _ = kernels.tile_config(E, 1)
    return -(-T // kernels.rows_per_program(T, E, block_t, stats))


def test_statistics_are_optional_and_none_when_not_asked():
    logits = torch.randn(5, 8)
    out = moe_router(logits, 2, backend="triton")
    assert out[2:] == (None, None, None, None)
    out = moe_router(logits, 2, z_statistics=True, backend="triton")
    assert out.scores_sum is None and out.lse_sq_sum is not None
    ref = moe_router(logits, 2, z_statistics=True, backend="reference")
    assert_close(out.lse_sq_sum, ref.lse_sq_sum, torch.float32)


# --- launches, syncs, bytes ----------------------------------------------------------------------


@pytest.mark.parametrize("stats", [False, True])
def test_one_launch_each_way_no_sync_and_bytes_at_the_floor(stats):
    from mtp.testing.traffic import count_traffic

    settings.configure(poison_outputs=False)  # the NaN fill of outputs is a test extra
    T, E, s = 512, 64, 2
    x = torch.randn(T, E).to(torch.bfloat16).requires_grad_(True)
    kw = dict(score_function="sigmoid", aux_statistics=stats, z_statistics=stats,
              routed_counts=stats, backend="triton")  # fmt: skip
    moe_router(x[:1], 2, **kw)  # warm-up
    with count_traffic() as fwd, count_host_syncs() as syncs:
        out = moe_router(x, 4, **kw)
    loss = (out.probs.float() * torch.randn(T, E)).sum()
    if stats:
        loss = loss + out.scores_sum.sum() + out.lse_sq_sum
    with count_traffic() as bwd:
        loss.backward()
    assert fwd.num_launches == 1 and fwd.num_aten_ops == 0, fwd.summary()
    assert [launch.name for launch in bwd.launches] == ["_router_bwd_kernel"], bwd.by_kernel()
    assert syncs.count == 0 and fwd.num_host_syncs == bwd.num_host_syncs == 0
    floor_fwd = T * E * (2 * s + 1)  # logits read, probs and map written
    ratio = fwd.bytes_program / floor_fwd
    assert 0.99 <= ratio <= 1.10, (ratio, fwd.by_kernel())
    floor_bwd = T * E * (3 * s + 1)  # logits, map and dprobs read, dlogits written
    (launch,) = bwd.launches
    assert 0.99 <= launch.bytes_program / floor_bwd <= 1.10, bwd.by_kernel()


# --- backends, arguments, tracing -----------------------------------------------------------------


def test_auto_is_the_reference_on_cpu_and_the_kernel_when_asked():
    from mtp.bench.counting import count_ops

    logits = torch.randn(6, 8)
    with count_ops() as auto:
        moe_router(logits, 2)
    assert auto.triton_launches == 0 and "aten::topk" in auto.compute
    with settings.override(backend="triton"), count_ops() as env:
        moe_router(logits, 2)
    assert env.triton_launches == 1


@pytest.mark.parametrize("call,error,match", [
    (lambda x: moe_router(x[0], 2), ValueError, "logits"),
    (lambda x: moe_router(x.long(), 2), TypeError, "logits"),
    (lambda x: moe_router(x, 9), ValueError, "topk=9 must be <= num_experts=8"),
    (lambda x: moe_router(x, 0), ValueError, "topk"),
    (lambda x: moe_router(x, 2, score_function="relu"), ValueError, "score_function"),
    (lambda x: moe_router(x, 2, num_groups=3, group_topk=1), ValueError, "num_groups"),
    (lambda x: moe_router(x, 2, group_score="top3", num_groups=2, group_topk=1), ValueError,
     "group_score"),
    (lambda x: moe_router(x, 2, expert_bias=torch.zeros(7)), ValueError, "expert_bias"),
    (lambda x: moe_router(x, 2, padding_mask=torch.zeros(5)), TypeError, "padding_mask"),
    (lambda x: moe_router(x, 2, padding_mask=torch.zeros(4, dtype=torch.bool)), ValueError,
     "padding_mask"),
    (lambda x: moe_router(x, 2, backend="cuda"), ValueError, "backend"),
    (lambda x: moe_router(torch.randn(2, 2048), 2, backend="triton"), ValueError,
     "at most 1024"),
])  # fmt: skip
def test_bad_arguments_name_what_to_change(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(5, 8))


def test_wide_rows_fall_back_to_the_reference_under_auto():
    with settings.override(backend="triton"):
        out = moe_router(torch.randn(3, 2048), 4)
    assert out.routing_map.sum() == 12


def test_fake_tensors_and_compile_fullgraph():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = moe_router(torch.randn(7, 16), 3, aux_statistics=True, backend="triton")
        assert out.probs.shape == (7, 16) and out.scores_sum.shape == (16,)
    torch._dynamo.reset()

    def fn(x):
        out = moe_router(x, 2, score_function="sigmoid", aux_statistics=True,
                         z_statistics=True, backend="triton")  # fmt: skip
        return out.probs.sum() + out.scores_sum.sum() * 0.1 + out.lse_sq_sum * 0.01

    x = torch.randn(9, 8, requires_grad=True)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (grad,) = torch.autograd.grad(compiled(x), x)
    (want,) = torch.autograd.grad(fn(x), x)
    assert torch.equal(grad, want)


# --- ahead-of-time builds -------------------------------------------------------------------------


def aot_cases():
    """``(name, kernel, signature, constexprs, num_warps)``: forward and backward builds for the
    shapes of Mixtral (E=8, top-2, softmax), Qwen3 (E=128, top-8, softmax first) and DeepSeek-V3
    (E=256, top-8, sigmoid, bias, 8 groups / 4) in bf16, and in float64."""
    cases = []
    for name, dtype, E, topk, score, groups, gtopk, bias in (
        ("mixtral", "bf16", 8, 2, 0, 1, 0, False), ("qwen3", "bf16", 128, 8, 1, 1, 0, False),
        ("deepseek", "bf16", 256, 8, 2, 8, 4, True), ("fp64-sigmoid", "fp64", 64, 4, 2, 1, 0,
        False), ("fp64-mixtral", "fp64", 8, 2, 0, 1, 0, False), ("fp64-deepseek", "fp64", 256, 8,
        2, 8, 4, True),
    ):  # fmt: skip
        torch_dtype = torch.float64 if dtype == "fp64" else torch.bfloat16
        block_t, gp, sp = kernels.tile_config(E, groups, torch_dtype)
        math = "fp64" if dtype == "fp64" else "fp32"
        w_block = min(kernels.next_power_of_2(3 * E + 1), 1024)
        common = dict(NUM_GROUPS=groups, S=E // groups, GP=gp, SP=sp, SCORE=score,
                      RENORM=score != 0, HAS_SCALE=True, SCALE_HI=2.5, SCALE_LO=0.0,
                      HAS_PAD=True, BLOCK_T=block_t, MATH=kernels._math(torch_dtype))  # fmt: skip
        fwd_sig = dict(
            logits_ptr=f"*{dtype}", bias_ptr="*fp32", pad_ptr="*u8", probs_ptr=f"*{dtype}",
            map_ptr="*u8", part_ptr=f"*{math}", counter_ptr="*i32", score_ptr=f"*{math}",
            count_ptr=f"*{math}", z_ptr=f"*{math}", T="i32", stride_lt="i32", stride_pt="i32",
            stride_mt="i32", rows_per_program="i32")  # fmt: skip
        fwd_cx = dict(common, E=E, TOPK=topk, GROUP_TOPK=gtopk, GROUP_M=2 if gtopk else 0,
                      HAS_BIAS=bias, AUX=True, ZLOSS=True, COUNTS=True, W_BLOCK=w_block,
                      FINISH_ROWS=max(1, kernels.FINISH_ELEMENTS // w_block),
                      CONTIG=True)  # fmt: skip
        bwd_sig = dict(
            logits_ptr=f"*{dtype}", map_ptr="*u8", dprobs_ptr=f"*{dtype}",
            dscore_ptr=f"*{math}", dz_ptr=f"*{math}", pad_ptr="*u8", dlogits_ptr=f"*{dtype}",
            T="i32", stride_lt="i32", stride_mt="i32", stride_gt="i32", stride_ge="i32",
            stride_ds="i32", stride_dt="i32")  # fmt: skip
        bwd_cx = dict(common, HAS_DPROBS=True, HAS_DAUX=True, HAS_DZ=True, CONTIG=True,
                      GRAD_CONTIG=True)
        cases.append((f"router_fwd[{name}]", kernels._router_fwd_kernel, fwd_sig, fwd_cx,
                      kernels.NUM_WARPS))  # fmt: skip
        cases.append((f"router_bwd[{name}]", kernels._router_bwd_kernel, bwd_sig, bwd_cx,
                      kernels.NUM_WARPS))  # fmt: skip
    return cases


def test_compiles_for_sm90_and_sm100_without_spills():
    """bf16 builds: no spills. float64 builds: ptxas counts a few bytes (at most 32) around the
    call to the IEEE fp64 division's slow-path subroutine (``div.rn.f64``; the same builds with
    the divisions replaced by products report none): caller saves on a path taken only for
    extreme operands, not register pressure."""
    from test_ops_bias_act import ptxas_table

    cases = aot_cases()
    rows = ptxas_table(cases)
    print("\n".join(f"{n} {arch}: {regs} registers, {st} B spilled"
                    for n, arch, regs, st, _ in rows))  # fmt: skip
    for name, arch, _, stores, loads in rows:
        limit = 32 if "fp64" in name else 0
        assert stores <= limit and loads <= limit, (
            f"{name} spills on {arch}: {stores} B stored, {loads} B loaded")
    fp64 = next(c for c in cases if "fp64" in c[0])
    build = compile_for_targets(*fp64[1:4], num_warps=fp64[4], targets=(90,))[90]
    assert "div.rn.f64" in build.ptx
    # the forward's row loop is software-pipelined: asynchronous copies of the next tiles'
    # logits, 16-byte vectors (rows of E contiguous elements: a constant row stride)
    _, kernel, signature, constexprs, num_warps = cases[0]
    ptx = compile_for_targets(kernel, signature, constexprs, num_warps=num_warps,
                              targets=(90,))[90].ptx  # fmt: skip
    assert re.search(r"cp\.async\.cg\.shared\.global [^;]*, 0x10", ptx), "not pipelined"


def test_double_backward_raises_instead_of_returning_zeros():
    x = torch.randn(5, 8, requires_grad=True)
    out = moe_router(x, 2, backend="triton")
    (g,) = torch.autograd.grad(out.probs.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()


def test_strided_rows_and_gradients_give_the_same_bits():
    """Rows with a stride other than E (a column slice) and a transposed ``dprobs`` take the
    kernels' runtime-stride path: the same bits as the dense path."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(21, 32, generator=g)
    dprobs = torch.randn(16, 21, generator=g).t()  # strides (1, 21)
    kw = dict(score_function="sigmoid", aux_statistics=True, z_statistics=True,
              backend="triton")  # fmt: skip
    results = []
    for dense in (False, True):
        leaf = wide.clone().requires_grad_(True)
        x = leaf[:, :16].contiguous() if dense else leaf[:, :16]
        out = moe_router(x, 3, **kw)
        grads = [dprobs.contiguous() if dense else dprobs, torch.ones(16)]
        torch.autograd.backward([out.probs, out.scores_sum], grads)
        results.append([t for t in out if t is not None] + [leaf.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)
