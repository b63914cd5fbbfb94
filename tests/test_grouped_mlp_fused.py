"""The expert MLP with fused epilogues (``mtp.ops.grouped_mlp``, ``GroupedMLP``'s
``bias_activation_fusion``): output and every gradient against a float64 per-expert loop under
the interpreter (empty experts, rows past the routed ones, all three activations, biases and
probabilities on and off); the structure (four grouped GEMM launches per step, no aten op on the
``[M, F]`` intermediates, no host sync); GroupedMLP fused vs unfused; gradient-accumulation
fusion; bad input; AOT builds for sm_90a / sm_100a with tensor cores and no spills."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from mtp import ops, settings
from mtp.kernels.grouped_gemm_details import launch, pointer
from mtp.kernels.grouped_gemm_details import tma as ktma
from mtp.kernels.grouped_gemm_details.epilogue import ACTIVATIONS
from mtp.kernels.grouped_gemm_details.tiles import head_size
from mtp.ops.grouped_gemm.config import make_config, override
from mtp.moe import GroupedMLP
from mtp.testing import compile_for_targets, count_host_syncs
from mtp.testing.traffic import count_traffic

SIZES = [9, 0, 33, 17]  # an empty expert, ragged sizes, partial tiles
M, H, FF = 70, 24, 40  # 11 rows past the routed ones
LIMIT = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


CLAMP, ALPHA = 1.25, 1.702  # a small limit, so that the tests' values are clamped


def _act64(h: torch.Tensor, act: str) -> torch.Tensor:
    if act == "clamped_swiglu":  # written out here, not mtp's function
        gate = torch.minimum(h[..., 0::2], torch.tensor(CLAMP, dtype=h.dtype))
        up = h[..., 1::2].clamp(-CLAMP, CLAMP)
        return (up + 1) * gate * torch.sigmoid(ALPHA * gate)
    if act == "swiglu":
        a, g = h.chunk(2, -1)
        return F.silu(a) * g
    return F.gelu(h, approximate="tanh" if act == "gelu_tanh" else "none")


def _reference(x, w1, w2, probs, b1, b2, act):
    """float64 per-expert loop: (act(x_e w1[e] + b1[e]) * p) w2[e] + b2[e]; zeros past."""
    out, row = [], 0
    for e, m in enumerate(SIZES):
        h = x[row : row + m] @ w1[e]
        if b1 is not None:
            h = h + b1[e]
        y = _act64(h, act)
        if probs is not None:
            y = y * probs[row : row + m, None]
        o = y @ w2[e]
        out.append(o + b2[e] if b2 is not None else o)
        row += m
    out.append(x.new_zeros(M - row, H))
    return torch.cat(out)


def _inputs(dtype, act, bias, with_probs, seed):
    g = torch.Generator().manual_seed(seed)
    W = 2 * FF if act in ("swiglu", "clamped_swiglu") else FF
    E = len(SIZES)
    t = {
        "x": torch.randn(M, H, generator=g).to(dtype),
        "w1": (torch.randn(E, H, W, generator=g) / H**0.5).to(dtype),
        "w2": (torch.randn(E, FF, H, generator=g) / FF**0.5).to(dtype),
        "probs": torch.rand(M, generator=g) if with_probs else None,
        "b1": torch.randn(E, W, generator=g).to(dtype) if bias else None,
        "b2": torch.randn(E, H, generator=g).to(dtype) if bias else None,
    }
    return t, torch.randn(M, H, generator=g).to(dtype)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = [
    ("swiglu", torch.float32, True, True),
    ("swiglu", torch.bfloat16, True, True),
    ("swiglu", torch.float16, False, True),
    ("gelu", torch.float32, True, True),
    ("gelu", torch.bfloat16, False, False),
    ("gelu_tanh", torch.float32, False, True),
    ("swiglu", torch.float32, False, False),
    ("clamped_swiglu", torch.float32, True, True),
    ("clamped_swiglu", torch.bfloat16, True, False),
]


RUNS = [(*case, "triton") for case in CASES] + [
    (*case, "reference") for case in CASES if case[0] in ("swiglu", "clamped_swiglu")
]


@pytest.mark.parametrize("act, dtype, bias, with_probs, backend", RUNS, ids=str)
def test_output_and_gradients_match_float64(act, dtype, bias, with_probs, backend):
    t, dout = _inputs(dtype, act, bias, with_probs, seed=len(act) + int(bias) + 7 * with_probs)
    leaves = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in t.items()}
    y = ops.grouped_mlp(leaves["x"], leaves["w1"], leaves["w2"], torch.tensor(SIZES),
                        leaves["probs"], leaves["b1"], leaves["b2"], activation=act,
                        activation_limit=CLAMP, backend=backend)  # fmt: skip
    y.backward(dout)
    ref_leaves = {k: (v.double().requires_grad_() if v is not None else None)
                  for k, v in t.items()}  # fmt: skip
    ref = _reference(*(ref_leaves[k] for k in ("x", "w1", "w2", "probs", "b1", "b2")), act)
    ref.backward(dout.double())
    assert y.dtype == dtype
    assert _rel(y, ref) < LIMIT[dtype], _rel(y, ref)
    # The clamps' derivatives jump at the limit: in 16 bits, rounding h moves the elements near
    # it to the other side (the reference backend does the same), so those gradients get more.
    grad_limit = 2 * LIMIT[dtype] * (2 if act == "clamped_swiglu" and dtype != torch.float32 else 1)
    assert torch.equal(y[sum(SIZES):], torch.zeros_like(y[sum(SIZES):])), "rows past routed"
    for name, leaf in leaves.items():
        if leaf is None:
            continue
        want = ref_leaves[name].grad
        assert leaf.grad.dtype == leaf.dtype, name
        assert _rel(leaf.grad, want) < grad_limit, (name, _rel(leaf.grad, want))
    assert torch.equal(leaves["w1"].grad[1], torch.zeros_like(leaves["w1"].grad[1])), "empty e"
    if with_probs:
        tail = leaves["probs"].grad[sum(SIZES):]
        assert torch.equal(tail, torch.zeros_like(tail))


def test_kernels_write_every_element_and_zero_the_tail():
    """Outputs poisoned with NaN beforehand: h, y, dh and the dprob partials are all written."""
    torch.manual_seed(3)
    E, W = len(SIZES), 2 * FF
    x, w1 = torch.randn(M, H), torch.randn(E, H, W)
    h, y = torch.full((M, W), float("nan")), torch.full((M, FF), float("nan"))
    cfg = make_config(0, x.dtype, M, FF, H, E, activation="swiglu")
    launch.forward_act(x, w1, torch.tensor(SIZES), h, y, cfg, "swiglu", probs=torch.rand(M))
    assert not h.isnan().any() and not y.isnan().any()
    assert not h[sum(SIZES):].any() and not y[sum(SIZES):].any()
    dh = torch.full((M, W), float("nan"))
    part = launch.dgrad_act(torch.randn(M, H), torch.randn(E, FF, H).transpose(1, 2),
                            torch.tensor(SIZES), h, dh, cfg, "swiglu", probs=torch.rand(M))
    assert not dh.isnan().any() and not part.isnan().any()
    assert not dh[sum(SIZES):].any() and not part[:, sum(SIZES):].any()


def test_structure_four_gemm_launches_and_no_elementwise_pass(monkeypatch):
    settings.configure(poison_outputs=False)  # the suite's NaN fill is not the op's work
    t, dout = _inputs(torch.float32, "swiglu", True, True, seed=5)
    leaves = [t[k].clone().requires_grad_() for k in ("x", "w1", "w2", "probs", "b1", "b2")]
    counts = torch.tensor(SIZES)
    with count_host_syncs() as syncs, count_traffic() as fwd:
        y = ops.grouped_mlp(*leaves[:3], counts, *leaves[3:], validate=False, backend="triton")
    with count_host_syncs() as bsyncs, count_traffic() as bwd:
        y.backward(dout)
    names = [launch.name for launch in fwd.launches]
    assert names == ["grouped_gemm_act_kernel", "grouped_gemm_kernel"], names
    assert fwd.num_aten_ops == 0, [a.name for a in fwd.aten]
    # Backward: bias2 sum, wgrad2, fused dgrad2 + activation backward, bias1 sum, wgrad1, dgrad1.
    bnames = sorted(launch.name for launch in bwd.launches)
    assert bnames.count("grouped_gemm_dact_kernel") == 1, bnames
    assert "_bias_act_bwd_kernel" not in bnames and len(bnames) == 6, bnames
    # Aten work of the backward: the dprob partial sum ([tiles, M] fp32) and gradient copies;
    # nothing reads or writes an [M, F] tensor.
    mf_bytes = M * FF * 4
    assert all(a.read < mf_bytes and a.write < mf_bytes for a in bwd.aten), bwd.aten
    assert syncs.count == 0 and bsyncs.count == 0


def test_bytes_fused_vs_unfused(monkeypatch):
    """The fused step moves less than the unfused chain: forward, its epilogue writes h and y
    once (the chain also re-reads h, writes and re-reads the activation and the scaled copy);
    backward, dh comes out of fc2's data-gradient epilogue."""
    settings.configure(poison_outputs=False)
    t, _ = _inputs(torch.float32, "swiglu", True, True, seed=6)
    counts = torch.tensor(SIZES)
    args = [t[k] for k in ("x", "w1", "w2")]
    leaves = [t[k].clone().requires_grad_() for k in ("x", "w1", "w2", "probs", "b1", "b2")]
    dout = torch.randn(M, H)
    with count_traffic() as fused:
        y = ops.grouped_mlp(*leaves[:3], counts, *leaves[3:], backend="triton", validate=False)
    with count_traffic() as fused_bwd:
        y.backward(dout)
    mlp = GroupedMLP(len(SIZES), H, FF, activation="swiglu", bias=True, backend="triton",
                     bias_activation_fusion=False)  # fmt: skip
    x, probs = t["x"].clone().requires_grad_(), t["probs"].clone().requires_grad_()
    with count_traffic() as unfused:
        y = mlp(x, counts, probs)
    with count_traffic() as unfused_bwd:
        y.backward(dout)
    mfs = M * FF * 4
    saved = 5 * mfs  # read h (2F), write the activation, read it again, write y
    assert unfused.bytes_program - fused.bytes_program > 0.8 * saved, (
        unfused.bytes_program, fused.bytes_program)
    # Backward: no dL/dy written and re-read, no separate scaling and activation passes.
    assert unfused_bwd.bytes_program - fused_bwd.bytes_program > 3 * mfs, (
        unfused_bwd.bytes_program, fused_bwd.bytes_program)


@pytest.mark.parametrize("act, probs_after_fc2", [
    ("swiglu", False), ("swiglu", True), ("gelu", False), ("gelu", True),
    ("clamped_swiglu", True),  # GPT-OSS: interleaved, clamped, probabilities after fc2
])  # fmt: skip
def test_grouped_mlp_fused_matches_unfused(act, probs_after_fc2):
    torch.manual_seed(11)
    kw = dict(activation=act, bias=True, backend="triton", probs_after_fc2=probs_after_fc2,
              activation_limit=CLAMP)
    fused = GroupedMLP(len(SIZES), H, FF, **kw)
    plain = GroupedMLP(len(SIZES), H, FF, bias_activation_fusion=False, **kw)
    plain.load_state_dict(fused.state_dict())
    x, probs, dout = torch.randn(M, H), torch.rand(M), torch.randn(M, H)
    outs = []
    for mlp in (fused, plain):
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with count_traffic() as t:
            y = mlp(xx, torch.tensor(SIZES), pp)
        y.backward(dout)
        outs.append((y, xx.grad, pp.grad, *(p.grad for p in mlp.parameters()), t))
    assert "grouped_gemm_act_kernel" in [launch.name for launch in outs[0][-1].launches]
    assert "grouped_gemm_act_kernel" not in [launch.name for launch in outs[1][-1].launches]
    for a, b in zip(outs[0][:-1], outs[1][:-1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_gradient_accumulation_fusion_in_fused_path():
    torch.manual_seed(12)
    mlp = GroupedMLP(len(SIZES), H, FF, activation="swiglu", backend="triton",
                     gradient_accumulation_fusion=True)  # fmt: skip
    ref = GroupedMLP(len(SIZES), H, FF, activation="swiglu", backend="triton")
    ref.load_state_dict(mlp.state_dict())
    for p in mlp.parameters():
        p.main_grad = torch.full_like(p, 0.5)
    x, probs, dout = torch.randn(M, H), torch.rand(M), torch.randn(M, H)
    mlp(x, torch.tensor(SIZES), probs).backward(dout)
    ref(x, torch.tensor(SIZES), probs).backward(dout)
    for p, q in zip(mlp.parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, q.grad + 0.5, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument():
    t, _ = _inputs(torch.float32, "swiglu", False, True, seed=1)
    counts = torch.tensor(SIZES)
    with pytest.raises(ValueError, match="activation"):
        ops.grouped_mlp(t["x"], t["w1"], t["w2"], counts, activation="relu")
    with pytest.raises(ValueError, match="weight2"):
        ops.grouped_mlp(t["x"], t["w1"], t["w2"][:, :-1], counts)
    with pytest.raises(ValueError, match="probs"):
        ops.grouped_mlp(t["x"], t["w1"], t["w2"], counts, t["probs"][:-1])
    with pytest.raises(TypeError, match="weight2"):
        ops.grouped_mlp(t["x"], t["w1"], t["w2"].double(), counts)
    with pytest.raises(ValueError, match="even"):
        ops.grouped_mlp(t["x"], t["w1"][:, :, :-1], t["w2"], counts)
    with pytest.raises(ValueError, match="bias2"):
        ops.grouped_mlp(t["x"], t["w1"], t["w2"], counts, bias2=torch.zeros(len(SIZES), H + 1))
    with pytest.raises(ValueError, match="tokens_per_expert|sum"):
        ops.grouped_mlp(t["x"], t["w1"], t["w2"], torch.tensor([M, 1, 0, 0]), validate="sync")
    with pytest.raises(RuntimeError, match="tokens_per_expert"):  # default: a device-side check
        ops.grouped_mlp(t["x"], t["w1"], t["w2"], torch.tensor([M, 1, 0, 0]))


# --- AOT: tensor cores, no spills -----------------------------------------------------------


def _tensor_args(forward: bool) -> dict[str, str]:
    """The bf16 / fp32 tensor arguments both kernel families take (pointer and TMA)."""
    names = (["a_ptr", "b_ptr", "h_ptr", "y_ptr", "bias_ptr", "p_ptr"] if forward
             else ["g_ptr", "b_ptr", "h_ptr", "p_ptr", "dh_ptr", "y_ptr"])  # fmt: skip
    signature = {n: "*bf16" for n in names}
    signature["p_ptr"] = "*fp32"
    if not forward:
        signature["part_ptr"] = "*fp32"
    return signature


def _build(kernel_name: str, act: str, M_rows: int, gather: bool = False):
    """The pointer activation kernels as a launch builds them; ``gather``: fc1 reading its rows
    through a row index (writing the rows' probabilities), or the data gradient rewriting fc1's
    output for fc2's weight gradient."""
    forward = kernel_name == "act"
    cfg = make_config(9, torch.bfloat16, M_rows, 4096, 4096, 8, activation=act,
                      gather=gather and forward, recompute=gather and not forward)
    signature = _tensor_args(forward)
    signature.update({"counts_ptr": "*i32", "M": "i32", "F": "i32", "K": "i32", "E": "i32"})
    lead = "stride_am" if forward else "stride_gm"
    strides = [lead, "stride_be", "stride_hm", "stride_ym" if forward else "stride_dm"]
    strides.append("stride_bk" if forward else "stride_bn")
    if not forward:
        strides.append("stride_ym")
    signature.update({s: "i32" for s in strides})
    constexprs = {
        ("stride_ak" if forward else "stride_gk"): 1, ("stride_bn" if forward else "stride_bk"): 1,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "BLOCK_E": 8,
        "GROUP_M": cfg.group_m, "PERSISTENT": True, "ACT": ACTIVATIONS[act],
        "HAS_PROB": True, "UPCAST_DOT": False, "DOT_PRECISION": "ieee",
        "LIMIT": 7.0, "ALPHA": 1.702,
    }
    if forward:
        constexprs.update(HAS_BIAS=True, GATHER=gather, ROW_PROBS=gather, stride_pe=int(gather))
        signature.update({"g_ptr": "*i64", "pp_ptr": "*fp32"})
        if gather:
            signature["stride_ps"] = "i32"  # E: a [T, E] probs tensor read through the index
        else:
            constexprs["stride_ps"] = 1
    else:
        constexprs["RECOMPUTE"] = gather
    kernel = pointer.grouped_gemm_act_kernel if forward else pointer.grouped_gemm_dact_kernel
    return compile_for_targets(kernel, signature, constexprs, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages,
                               divisible_by_16=strides + ["F", "K"])  # fmt: skip


def _check_tensor_cores(builds) -> None:
    assert "wgmma" in builds[90].ptx, "no wgmma in the sm_90a PTX"
    assert "tcgen05" in builds[100].ptx, "no tcgen05 in the sm_100a PTX"
    for cc, build in builds.items():
        assert build.fits_shared_memory, f"sm_{cc}: {build.shared} bytes of shared memory"
        info = build.ptxas()
        assert info is None or not info.spills, f"sm_{cc} spills:\n{info.output}"


@pytest.mark.parametrize("kernel_name", ["act", "dact"])
@pytest.mark.parametrize("act", ["swiglu", "gelu", "clamped_swiglu"])
@pytest.mark.parametrize("rows", [100, 1 << 20], ids=["small_groups", "large_groups"])
def test_aot_tensor_cores_no_spills(kernel_name, act, rows):
    _check_tensor_cores(_build(kernel_name, act, rows))


@pytest.mark.parametrize("kernel_name", ["act", "dact"])
@pytest.mark.parametrize("rows", [100, 1 << 20], ids=["small_groups", "large_groups"])
def test_aot_gathered_fc1_and_recomputing_dact_no_spills(kernel_name, rows):
    """fc1 reading its rows through the dispatch's row index (and writing the rows'
    probabilities), and fc2's data gradient rewriting fc1's output: tensor cores, no spills."""
    _check_tensor_cores(_build(kernel_name, "swiglu", rows, gather=True))


def test_compiled_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) traces the fused experts (custom ops with fakes inside an
    autograd.Function): outputs and gradients equal eager."""
    torch.manual_seed(13)
    mlp = GroupedMLP(len(SIZES), H, FF, activation="swiglu", bias=True, backend="triton")
    x, probs, dout = torch.randn(M, H), torch.rand(M), torch.randn(M, H)
    results = []
    for fn in (torch.compile(mlp, fullgraph=True, backend="aot_eager"), mlp):
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = fn(xx, torch.tensor(SIZES), pp)
        grads = torch.autograd.grad(y, [xx, pp, *mlp.parameters()], dout)
        results.append((y, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("rows_per_expert", [48, 700], ids=["small_groups", "large_groups"])
def test_gpu_fused_matches_float64_bf16(act, rows_per_expert):
    """Compiled kernels (both tile regimes) at a realistic width, skewed counts with an empty
    expert, output and gradients against float64."""
    torch.manual_seed(21)
    E, Hd, Fd = 8, 1024, 1536
    sizes = [rows_per_expert * (e % 3) for e in range(E)]
    Mr = sum(sizes) + 37
    W = 2 * Fd if act == "swiglu" else Fd
    dev, dtype = "cuda", torch.bfloat16
    t = [torch.randn(Mr, Hd, device=dev), torch.randn(E, Hd, W, device=dev) / Hd**0.5,
         torch.randn(E, Fd, Hd, device=dev) / Fd**0.5, torch.rand(Mr, device=dev),
         torch.randn(E, W, device=dev), torch.randn(E, Hd, device=dev)]  # fmt: skip
    leaves = [v.to(dtype if i != 3 else torch.float32).requires_grad_() for i, v in enumerate(t)]
    counts = torch.tensor(sizes, device=dev)
    y = ops.grouped_mlp(*leaves[:3], counts, *leaves[3:], activation=act)
    dout = torch.randn_like(y)
    y.backward(dout)
    ref = [v.detach().double().requires_grad_() for v in leaves]
    out, row = [], 0
    for e, m in enumerate(sizes):
        h = ref[0][row:row + m] @ ref[1][e] + ref[4][e]
        out.append((_act64(h, act) * ref[3][row:row + m, None]) @ ref[2][e] + ref[5][e])
        row += m
    out.append(ref[0].new_zeros(Mr - row, Hd))
    want = torch.cat(out)
    want.backward(dout.double())
    assert _rel(y, want) < 2e-2
    for leaf, r in zip(leaves, ref):
        assert _rel(leaf.grad, r.grad) < 3e-2


# --- TMA kernels (kernels/grouped_gemm_details/tma.py) -----------------------------------------------


@pytest.mark.parametrize("act, dtype, bias, with_probs", [
    ("swiglu", torch.bfloat16, True, True), ("gelu", torch.float16, False, True),
], ids=str)  # fmt: skip
def test_tma_kernels_match_float64(act, dtype, bias, with_probs):
    """Descriptors run under the interpreter: the TMA path (override(kernel="tma")) against
    float64, and the launches are the TMA kernels."""
    with count_traffic() as t, override(kernel="tma"):
        test_output_and_gradients_match_float64(act, dtype, bias, with_probs, "triton")
    names = {launch.name for launch in t.launches}
    assert {"grouped_gemm_act_tma_kernel", "grouped_gemm_dact_tma_kernel"} <= names, names
    assert not names & {"grouped_gemm_act_kernel", "grouped_gemm_dact_kernel"}, names


def _tma_build(cc: int, forward: bool, act: str, rows: int):
    cfg = make_config(9, torch.bfloat16, rows, 4096, 4096, 8, activation=act, tma_ok=True,
                      recompute=not forward)  # as the launches ask: fc2's rewrites fc1's output
    assert cfg.kernel == "tma", cfg
    signature = _tensor_args(forward)
    strides = (["stride_am", "stride_be", "stride_bk", "stride_hm", "stride_ym"] if forward
               else ["stride_gm", "stride_be", "stride_bn", "stride_hm", "stride_dm",
                     "stride_ym"])  # fmt: skip
    signature.update({"map_ptr": "*i32", "M": "i32", "F": "i32", "K": "i32", "E": "i32"})
    signature.update({s: "i32" for s in strides})
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "GROUP_M": cfg.group_m, "FLATTEN": True, "UPCAST_DOT": False,
                  "ACT": ACTIVATIONS[act], "HAS_PROB": True,
                  "MAP_OFF": head_size(8)}  # the launch's constant (8 experts)  # fmt: skip
    if forward:
        constexprs["HAS_BIAS"] = True
    else:
        constexprs["RECOMPUTE"] = True  # fc2's weight gradient reads fc1's output rewritten
    kernel = ktma.grouped_gemm_act_tma_kernel if forward else ktma.grouped_gemm_dact_tma_kernel
    return compile_for_targets(kernel, signature, constexprs, targets=(cc,),
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                               divisible_by_16=strides + ["F", "K"])[cc]  # fmt: skip


@pytest.mark.parametrize("cc", [90, 100])
@pytest.mark.parametrize("forward", [True, False], ids=["fc1_act", "fc2_dgrad_dact"])
@pytest.mark.parametrize("act, rows", [("swiglu", 1 << 20), ("gelu", 100)],
                         ids=["swiglu_large", "gelu_small"])
def test_aot_tma_kernels_tma_loads_tensor_cores_no_spills(cc, forward, act, rows):
    from test_grouped_gemm_tma import _sass

    build = _tma_build(cc, forward, act, rows)
    info, sass = _sass(build)
    assert build.fits_shared_memory, build.shared
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", info), info
    assert "UTMALDG" in sass, "no TMA loads in the SASS"
    if cc == 90:
        assert "HGMMA" in sass, "no wgmma in the sm_90a SASS"
    else:
        assert re.search(r"UTC\w*MMA", sass), "no tcgen05 MMA in the sm_100a SASS"
