"""Byte floor, launch counts and host syncs of permute / unpermute / bias-act, plus
their robustness cases, AOT builds of the new kernels and the shared token map.

Bytes are counted by address under the Triton interpreter (:mod:`mtp.testing.traffic`: unique
bytes per program, summed) and divided by the fewest bytes each op must move (the formulas of
``bench/bench_permute.py`` and ``bench/bench_bias_act.py``, plus the probabilities where the
call reads or writes them). Outputs are not poisoned here: the NaN fill is a test-suite extra.
"""

from __future__ import annotations

import pytest
import torch

from mtp import settings
import mtp.ops
from mtp.kernels import bias_act as bias_kernels
from mtp.kernels import moe_token_major as token_kernels
from mtp.kernels import moe_row_map as map_kernels
from mtp.ops import permute, unpermute
from mtp.testing import assert_close, compile_for_targets, count_host_syncs
from mtp.testing.traffic import count_traffic

T, E, K, H = 256, 16, 4, 256  # mid-size permute shape
N = T * K
MAX_RATIO = 1.10


@pytest.fixture(autouse=True)
def _no_poison(monkeypatch):
    settings.configure(poison_outputs=False)


def _routing(seed=0, tokens=T):
    g = torch.Generator().manual_seed(seed)
    top = torch.randn(tokens, E, generator=g).topk(K, dim=1)
    routing_map = torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, top.indices, True)
    probs = torch.zeros(tokens, E).scatter_(1, top.indices, top.values.softmax(1))
    return routing_map, probs


def _check(traffic, floor, launches, name):
    ratio = traffic.ratio(floor)
    assert ratio <= MAX_RATIO, f"{name}: {ratio:.3f} x the byte floor ({traffic.summary(floor)})"
    assert traffic.device_ops <= launches, f"{name}: {traffic.summary(floor)}"
    assert traffic.num_host_syncs == 0, f"{name}: host syncs {traffic.host_syncs}"


def test_permute_unpermute_bytes_launches_syncs():
    """Default arguments (validate=True: checks on the device), fp32, with probabilities."""
    routing_map, probs = _routing()
    s = 4
    x = torch.randn(T, H, requires_grad=True)
    p = probs.clone().requires_grad_(True)
    with count_traffic() as t:
        permuted, pprobs, rid, tm = permute(x, routing_map, p, N, backend="triton",
                                            return_token_map=True)
    # read tokens, routing map, the routed probs; write rows, row map, permuted probs
    _check(t, T * H * s + T * E + N * H * s + 8 * N + N * s + N * s, 4, "permute fwd")
    # scan + place (a routing this small is counted in it: no count launch), scatter (+ the
    # device-side assert)
    assert t.num_launches == 2

    g_rows, g_probs = torch.randn(N, H), torch.randn(N)
    with count_traffic() as t:
        torch.autograd.backward((permuted, pprobs), (g_rows, g_probs))
    # read row grads, the map, the probs grads; write tokens grad and the [T, E] probs grad
    _check(t, N * H * s + 8 * N + N * s + T * H * s + T * E * s, 2, "permute bwd")

    y = torch.randn(N, H, requires_grad=True)
    p.grad = None
    with count_traffic() as t:
        out = unpermute(y, rid, (T, H), p, routing_map, backend="triton", token_map=tm)
    _check(t, N * H * s + 8 * N + T * E + N * s + T * H * s, 2, "unpermute fwd")
    assert t.num_launches == 1

    g_out = torch.randn(T, H)
    with count_traffic() as t:
        out.backward(g_out)
    floor = T * H * s + N * H * s + 8 * N + T * E + N * s + N * H * s + T * E * s
    _check(t, floor, 2, "unpermute bwd")
    assert t.num_launches == 1

    # correctness of what was measured, against float64
    exp_rows = x.detach().double()[rid]
    assert torch.equal(permuted.double(), exp_rows)
    expected = torch.zeros(T, H, dtype=torch.float64).index_add_(
        0, rid, y.detach().double() * probs.double()[rid, _experts_of_rows(routing_map)][:, None]
    )
    assert_close(out, expected)


def _experts_of_rows(routing_map):
    counts = routing_map.sum(0)
    return torch.repeat_interleave(torch.arange(E), counts)


@pytest.mark.parametrize("programs", [None, 132 * 4, 132 * 8], ids=["cpu", "h100x4", "h100x8"])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_bias_act_bytes_launches_syncs(act, programs, monkeypatch):
    """The interpreter's small grid and grids of an H100's size (132 SMs x 4 or 8 resident
    programs): bias re-reads and dbias partials must stay within the floor's 10 %."""
    if programs is not None:
        monkeypatch.setattr(bias_kernels, "resident_programs", lambda *a, **k: programs)
    dtype, s = torch.bfloat16, 2
    M, W = 512, 1024
    width = 2 * W if act == "swiglu" else W
    x = torch.randn(M, width, dtype=dtype, requires_grad=True)
    b = torch.randn(width, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, W, dtype=dtype)

    def op(x, b):
        if act == "swiglu":
            return mtp.ops.bias_swiglu(x, b, backend="triton")
        return mtp.ops.bias_gelu(x, b, "tanh", backend="triton")

    with count_traffic() as t:
        y = op(x, b)
    _check(t, (M * width + M * W) * s + width * s, 1, f"{act} fwd")
    with count_traffic() as t:
        y.backward(dy)
    _check(t, (M * W + 2 * M * width) * s + 2 * width * s, 2, f"{act} bwd")
    # what was measured is right
    x64 = x.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    u = x64 + b64
    if act == "swiglu":
        a, gate = u.chunk(2, -1)
        ref = torch.nn.functional.silu(a) * gate
    else:
        ref = torch.nn.functional.gelu(u, approximate="tanh")
    ref.backward(dy.double())
    assert_close(y, ref, dtype)
    assert_close(x.grad, x64.grad, dtype)
    assert_close(b.grad, b64.grad, dtype)


def test_bias_act_programs_load_bias_once():
    """Each program of the forward reads its bias slice once whatever its row count."""
    M, W = 3 * bias_kernels.CPU_PROGRAMS * 4 + 1, 64
    x, b = torch.randn(M, W), torch.randn(W)
    with count_traffic() as t:
        mtp.ops.bias_gelu(x, b, backend="triton")
    (launch,) = t.launches
    assert launch.programs == bias_kernels.row_programs(M, W, bias_kernels.CPU_PROGRAMS)
    assert launch.read_program == (M * W + launch.programs * W) * 4


def test_no_host_sync_with_default_arguments():
    tokens = 24
    routing_map, probs = _routing(1, tokens)
    x = torch.randn(tokens, 8, requires_grad=True)
    p = probs.requires_grad_(True)
    n = tokens * K
    with count_host_syncs() as syncs:
        permuted, _, rid = permute(x, routing_map, p, n, backend="triton")
        out = unpermute(permuted, rid, x.shape, p, routing_map, backend="triton")
        out.sum().backward()
        dropped = permute(x, routing_map, p, drop_and_pad=True, capacity=5, backend="triton")
        unpermute(dropped[0], dropped[2], x.shape, p, drop_and_pad=True, backend="triton")
        for backend in ("triton", "reference"):
            permute(x, routing_map, p, n, backend=backend)
            unpermute(permuted, rid.clone(), x.shape, p, routing_map, backend=backend)
        y = mtp.ops.bias_swiglu(torch.randn(4, 16, requires_grad=True), torch.randn(16))
        y.sum().backward()
    assert syncs.count == 0, syncs.events


# --- the shared token map ---------------------------------------------------------------------


def test_unpermute_uses_the_token_map_it_is_given():
    tokens = 32
    routing_map, probs = _routing(2, tokens)
    x = torch.randn(tokens, 8)
    permuted, _, rid, tm = permute(x, routing_map, probs, tokens * K, backend="triton",
                                   return_token_map=True)
    assert tm is not None
    y = torch.randn(tokens * K, 8)
    with count_traffic() as fast:
        a = unpermute(y, rid, x.shape, probs, routing_map, backend="triton", token_map=tm)
    # without the map (another routing tensor with the same values, a copied row map, a row map
    # modified in place): the map is inverted again (more launches) and the result is the same
    others = [
        (rid, routing_map.clone()),
        (rid.clone(), routing_map),
    ]
    for r, m in others:
        with count_traffic() as slow:
            b = unpermute(y, r, x.shape, probs, m, backend="triton")
        assert slow.device_ops > fast.device_ops
        assert_close(a, b)
    rid.add_(0)  # modified in place, no map
    with count_traffic() as slow:
        b = unpermute(y, rid, x.shape, probs, routing_map, backend="triton")
    assert slow.device_ops > fast.device_ops
    assert_close(a, b)


def test_unpermute_without_a_token_map_says_why(monkeypatch, caplog):
    """Inverting the row map is logged once, eagerly and from a fullgraph-compiled call alike;
    the result is the one with the map (same kernel, same order). Without probs or a routing
    to bound a token's rows, the sort fallback says so."""
    from mtp.ops.moe_permute import token_map

    tokens = 16
    routing_map, probs = _routing(4, tokens)
    x = torch.randn(tokens, 8)
    _, _, rid, tm = permute(x, routing_map, probs, tokens * K, backend="triton",
                            return_token_map=True)
    y = torch.randn(tokens * K, 8)

    def run(token_map):
        return unpermute(y, rid, x.shape, probs, routing_map, backend="triton",
                         token_map=token_map)

    for fn in (run, torch.compile(run, backend="aot_eager", fullgraph=True)):
        monkeypatch.setattr(token_map, "_SAID", set())
        caplog.clear()
        with caplog.at_level("INFO", logger="mtp"):
            fast, slow, again = fn(tm), fn(None), fn(None)
        said = [r.getMessage() for r in caplog.records if "no token_map" in r.getMessage()]
        assert len(said) == 1 and "inverted on the device first" in said[0], said
        assert torch.equal(fast, slow) and torch.equal(slow, again)
    caplog.clear()
    with caplog.at_level("INFO", logger="mtp"):
        plain = unpermute(y, rid, x.shape, backend="triton")
    said = [r.getMessage() for r in caplog.records if "no token_map" in r.getMessage()]
    assert len(said) == 1 and "sort" in said[0], said
    assert_close(plain, unpermute(y, rid, x.shape, backend="triton", token_map=tm))


def _counted_by(monkeypatch, fused: bool) -> None:
    """Count small routings in the programs that need the counts (``fused``) or in a count
    launch, with launch plans made for this setting only."""
    from mtp.ops import moe_permute as ops_permute
    from mtp.ops.moe_permute import token_map

    monkeypatch.setattr(map_kernels, "FUSE_COUNT", 10**9 if fused else 0)
    for module in (ops_permute, token_map, map_kernels):
        monkeypatch.setattr(module, "_PLANS", type(module._PLANS)())


@pytest.mark.parametrize("fused", [False, True], ids=["count_launch", "fused_count"])
def test_row_map_kernels_over_many_chunks(monkeypatch, fused):
    """More chunks than the count table holds in one program's tile: scan across chunks (the
    table a count launch wrote, or counts each place program makes itself)."""
    monkeypatch.setattr(map_kernels, "TILE", 64)
    monkeypatch.setattr(map_kernels, "MAX_CHUNKS", 5)
    _counted_by(monkeypatch, fused)
    tokens = 45
    routing_map, probs = _routing(3, tokens)
    x = torch.randn(tokens, 3)
    e_block, sub_t, per_chunk, chunks = map_kernels.map_config(tokens, E)
    assert chunks == 5 and per_chunk > sub_t
    for kw in (dict(num_out_tokens=tokens * K), dict(drop_and_pad=True, capacity=9)):
        got = permute(x, routing_map, probs, backend="triton", **kw)
        ref = permute(x, routing_map, probs, backend="reference", **kw)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True], ids=["count_launch", "fused_count"])
def test_unpermute_inverts_the_row_map(monkeypatch, fused):
    """Without a token map the row map is inverted (experts from the count table or counted in
    the inversion's programs): the result of the map permute built, and the device check."""
    _counted_by(monkeypatch, fused)
    tokens = 24
    routing_map, probs = _routing(5, tokens)
    indices = routing_map.float().topk(K, dim=1).indices
    x = torch.randn(tokens, 6)
    for kw in (dict(num_out_tokens=tokens * K), dict(drop_and_pad=True, capacity=5)):
        drop = kw.get("drop_and_pad", False)
        _, _, rid, tm = permute(x, routing_map, probs, backend="triton", return_token_map=True,
                                **kw)  # fmt: skip
        y = torch.randn(rid.shape[0], 6)
        want = unpermute(y, rid, x.shape, probs, routing_map, drop, backend="triton",
                         token_map=tm)  # fmt: skip
        for routing in (dict(routing_map=routing_map), dict(indices=indices)):
            got = unpermute(y, rid, x.shape, probs, drop_and_pad=drop, backend="triton",
                            **routing)  # fmt: skip
            assert torch.equal(got, want)
        if not drop:
            with pytest.raises(RuntimeError, match="does not match routing_map"):
                unpermute(y, rid.flip(0), x.shape, probs, routing_map, backend="triton")


# --- robustness --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_permute_non_contiguous_and_meta_inputs(backend):
    routing_map, probs = _routing(4)
    big = torch.randn(H, T).t()  # [T, H] with a column stride
    x = big[:, :40]
    rm_t = routing_map.t().contiguous().t()  # non-contiguous routing map
    got = permute(x, rm_t, probs.t().contiguous().t(), N, backend=backend)
    ref = permute(x.contiguous(), routing_map, probs, N, backend="reference")
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    out = unpermute(got[0], got[2], x.shape, probs, routing_map, backend=backend)
    assert_close(out, x.double() * probs.sum(1, keepdim=True).double())
    meta = permute(x.to("meta"), routing_map.to("meta"), probs.to("meta"), N, backend=backend)
    assert meta[0].shape == (N, 40) and meta[0].device.type == "meta"
    assert meta[1].shape == (N,) and meta[2].shape == (N,)
    out = unpermute(meta[0], meta[2], (T, 40), probs.to("meta"), routing_map.to("meta"),
                    backend=backend)
    assert out.shape == (T, 40) and out.device.type == "meta"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("act", ["none", "tanh", "swiglu"])
def test_bias_act_zero_width_and_meta(act, backend):
    def op(x, b):
        if act == "swiglu":
            return mtp.ops.bias_swiglu(x, b, backend=backend)
        return mtp.ops.bias_gelu(x, b, act, backend=backend)

    x = torch.randn(3, 0, requires_grad=True)
    b = torch.randn(0, requires_grad=True)
    y = op(x, b)
    assert y.shape == (3, 0)
    y.sum().backward()
    assert x.grad.shape == (3, 0) and b.grad.shape == (0,)
    m = op(torch.empty(5, 8, device="meta"), torch.empty(8, device="meta"))
    assert m.shape == (5, 4 if act == "swiglu" else 8) and m.device.type == "meta"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("act", ["none", "tanh", "swiglu"])
def test_bias_act_double_backward(act, backend):
    torch.manual_seed(5)
    x = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    b = torch.randn(6, requires_grad=True)

    def fwd(x, b, ref=False):
        if ref:
            u = x + b
            if act == "swiglu":
                a, g = u.chunk(2, -1)
                return torch.nn.functional.silu(a) * g
            return torch.nn.functional.gelu(u, approximate=act)
        if act == "swiglu":
            return mtp.ops.bias_swiglu(x, b, backend=backend)
        return mtp.ops.bias_gelu(x, b, act, backend=backend)

    gx, gb = torch.autograd.grad(fwd(x, b).pow(2).sum(), (x, b), create_graph=True)
    hx, hb = torch.autograd.grad(gx.sum() + gb.pow(2).sum(), (x, b))
    x64 = x.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    ex, eb = torch.autograd.grad(fwd(x64, b64, True).pow(2).sum(), (x64, b64), create_graph=True)
    ehx, ehb = torch.autograd.grad(ex.sum() + eb.pow(2).sum(), (x64, b64))
    assert_close(hx, ehx, rtol=1e-4, atol=1e-4)
    assert_close(hb, ehb, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bias_act_infinite_inputs(backend):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[inf, -inf, 1e30, -1e30, nan, 2.0]], requires_grad=True)
    for approximate in ("none", "tanh"):
        x.grad = None
        y = mtp.ops.bias_gelu(x, torch.zeros(6), approximate, backend=backend)
        expected_y = torch.tensor([[inf, 0.0, 1e30, 0.0, nan, 0.0]])
        expected_y[0, 5] = torch.nn.functional.gelu(torch.tensor(2.0), approximate=approximate)
        assert torch.equal(y.isnan(), expected_y.isnan())
        assert torch.equal(y[0, :4], expected_y[0, :4])
        assert_close(y[0, 5], expected_y[0, 5])
        y.sum().backward()
        assert torch.equal(x.grad[0, :4], torch.tensor([1.0, 0.0, 1.0, 0.0]))
        assert x.grad[0, 4].isnan()
    x = torch.tensor([[inf, -inf, 2.0, 3.0]], requires_grad=True)
    y = mtp.ops.bias_swiglu(x, None, backend=backend)
    assert torch.equal(y, torch.tensor([[inf, -0.0]]))
    y.backward(torch.ones(1, 2))
    assert torch.isfinite(x.grad[0, :2]).all() and x.grad[0, 1] == 0


# --- ahead-of-time builds of the new kernels -------------------------------------------------


def _no_spills(builds, name):
    for cc, build in builds.items():
        assert build.fits_shared_memory, (name, cc)
        info = build.ptxas()
        if info is not None:
            assert info.registers <= 255 and not info.spills, (name, cc, info.output)


def _combine_tokens_build(s_block, hidden, grad_probs, slot=1):
    """``_combine_tokens_kernel`` as ``combine_tokens`` launches it (hidden a multiple of 16,
    as Triton specialises it; ``slot=2``: the token map an inversion made)."""
    block, warps = token_kernels.combine_block(hidden)
    return compile_for_targets(
        token_kernels._combine_tokens_kernel,
        dict(x_ptr="*bf16", out_ptr="*bf16", gpp_ptr="*fp32", gprobs_ptr="*fp32", T="i32",
             E="i32", hidden="i32", S="i32", trows_ptr="*i32", texp_ptr="*i32",
             tcount_ptr="*i32", probs_ptr="*fp32", parts="i32", part_stride="i32"),
        dict(HAS_PROBS=True, GRAD_PROBS=grad_probs, S_BLOCK=s_block, E_BLOCK=256,
             BLOCK_H=block, SLOT=slot),
        num_warps=warps, divisible_by_16=("hidden", "S", "E"),
    )  # fmt: skip


@pytest.mark.parametrize("s_block, hidden", [(8, 4096), (8, 7168), (2, 4096)])
def test_unpermute_combine_sums_in_registers_with_16_byte_loads(s_block, hidden):
    """The unpermute forward (and permute backward) kernel: no shared memory, no barrier, one
    16-byte load per row of the chunk. On the H200 (Nsight Compute, Mixtral's T=8192 H=4096
    top-2, S_BLOCK 8) its ``[S_BLOCK, BLOCK_H]`` tile summed over axis 0 went through 8 KB of
    shared memory with 5 barriers: L1 96 % busy at 12 % of DRAM, 330 us against a 45 us floor."""
    for cc, build in _combine_tokens_build(s_block, hidden, grad_probs=False).items():
        assert build.shared == 0, (cc, build.shared)
        assert "bar.sync" not in build.ptx and "st.shared" not in build.ptx, cc
        assert build.ptx.count("ld.global.v4") >= s_block, (cc, build.ptx.count("ld.global.v4"))


def test_new_permute_kernels_compile_for_sm90_and_sm100():
    e_block, sub_t, _, _ = map_kernels.map_config(8192, 256)
    for is_idx, k in ((False, 1), (True, 8)):
        route = "*i64" if is_idx else "*i1"
        common = dict(IS_INDICES=is_idx, K=k, SUB_T=sub_t, E_BLOCK=e_block)
        _no_spills(compile_for_targets(
            map_kernels._count_kernel,
            dict(route_ptr=route, counts_ptr="*i32", T="i32", E="i32", tokens_per_chunk="i32"),
            common, num_warps=map_kernels.NUM_WARPS), "count")
        _no_spills(compile_for_targets(
            map_kernels._place_kernel,
            dict(route_ptr=route, probs_ptr="*fp32", counts_ptr="*i32", row_id_ptr="*i64",
                 pair_ptr="*i64", pprobs_ptr="*fp32", trows_ptr="*i32", texp_ptr="*i32",
                 tcount_ptr="*i32", status_ptr="*i1", tpe_ptr="*i64", T="i32", E="i32", N="i32",
                 capacity="i32", tokens_per_chunk="i32", num_chunks="i32",
                 rows_per_chunk="i32", S="i32"),
            dict(DROP=False, HAS_PROBS=True, WRITE_PAIR=True,
                 ROW_BLOCK=max(1, map_kernels.TILE // e_block), FUSED=is_idx,
                 WRITE_COUNTS=True, **common),
            num_warps=map_kernels.NUM_WARPS), "place")  # fmt: skip
        _no_spills(compile_for_targets(
            map_kernels._invert_kernel,
            dict(row_id_ptr="*i64", route_ptr=route, counts_ptr="*i32", packed_ptr="*i64",
                 tcount_ptr="*i32", N="i32", T="i32", E="i32", W="i32", capacity="i32",
                 num_chunks="i32", tokens_per_chunk="i32", rows_per_program="i32"),
            dict(ROUTE=2 if is_idx else 1, K=k, EXPERTS=2, COUNTS=True, CHECK=True,
                 SUB_R=max(16, map_kernels.INVERT_TILE // e_block), E_BLOCK=e_block,
                 SUB_T=sub_t, FUSED=is_idx),
            num_warps=4), "invert")  # fmt: skip
    s_block, hidden = 8, 7168
    block, warps = token_kernels.token_block(hidden, max(s_block, token_kernels.ZERO_ROWS))
    _no_spills(compile_for_targets(
        token_kernels._scatter_tokens_kernel,
        dict(x_ptr="*bf16", trows_ptr="*i32", tcount_ptr="*i32", row_id_ptr="*i64",
             out_ptr="*bf16", T="i32", N="i32", hidden="i32", S="i32"),
        dict(S_BLOCK=s_block, BLOCK_H=block, ZERO_ROWS=token_kernels.ZERO_ROWS),
        num_warps=warps), "scatter")  # fmt: skip
    ptrs = dict(trows_ptr="*i32", texp_ptr="*i32", tcount_ptr="*i32", probs_ptr="*fp32")
    _no_spills(_combine_tokens_build(s_block, hidden, grad_probs=True), "combine")
    _no_spills(_combine_tokens_build(s_block, hidden, grad_probs=False, slot=2), "combine")
    block, warps = token_kernels.token_block(hidden, max(s_block, token_kernels.ZERO_ROWS))
    _no_spills(compile_for_targets(
        token_kernels._unpermute_bwd_kernel,
        dict(g_ptr="*bf16", x_ptr="*bf16", row_id_ptr="*i64", gx_ptr="*bf16",
             gprobs_ptr="*fp32", T="i32", N="i32", E="i32", hidden="i32", S="i32", **ptrs),
        dict(HAS_PROBS=True, NEED_GX=True, NEED_GPROBS=True, S_BLOCK=s_block, E_BLOCK=256,
             BLOCK_H=block, ZERO_ROWS=token_kernels.ZERO_ROWS, SLOT=1),
        num_warps=warps), "unpermute bwd")  # fmt: skip


@pytest.mark.parametrize("drop_and_pad", [False, True], ids=["dropless", "drop_and_pad"])
def test_moe_permute_row_map_triton_matches_reference(drop_and_pad):
    """The MoE preprocess's row map: same maps from the kernels; unpermute then reuses the
    token-major map (one launch)."""
    from mtp.ops.moe_permute import moe_permute_row_map

    tokens = 40
    routing_map, _ = _routing(6, tokens)
    kw = dict(drop_and_pad=True, capacity=7) if drop_and_pad else {}
    n = E * 7 if drop_and_pad else tokens * K
    row_map = moe_permute_row_map(routing_map, n, backend="triton", token_map=True, **kw)
    rid, pair = row_map.row_id_map, row_map.pair
    ref_rid, ref_pair = moe_permute_row_map(routing_map, n, backend="reference", **kw)
    assert torch.equal(rid, ref_rid) and torch.equal(pair, ref_pair)
    y = torch.randn(n, 5)
    with count_traffic() as t:
        out = unpermute(y, rid, (tokens, 5), backend="triton", validate=False,
                        token_map=row_map.token_map)
    assert t.device_ops == 1
    # the row kernels (sort path) sum in another fixed order: equal up to fp32 rounding
    assert_close(out, unpermute(y, ref_rid, (tokens, 5), backend="triton", validate=False))


def test_tokens_with_more_rows_than_one_chunk():
    """12 experts per token: the token-major kernels take a token's rows in chunks of
    MAX_S_BLOCK; forward and backward of both ops against float64."""
    tokens, experts, hidden = 7, 12, 10
    assert experts > token_kernels.MAX_S_BLOCK
    g = torch.Generator().manual_seed(7)
    routing_map = torch.rand(tokens, experts, generator=g) < 0.9
    routing_map[0] = True  # all 12 experts
    probs = (torch.rand(tokens, experts, generator=g) * routing_map).requires_grad_(True)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    n = int(routing_map.sum())
    permuted, pprobs, rid = permute(x, routing_map, probs, n, backend="triton")
    # float64: rows expert-major, ascending token
    pairs = [(t, e) for e in range(experts) for t in range(tokens) if routing_map[t, e]]
    x64 = x.detach().double().requires_grad_(True)
    p64 = probs.detach().double().requires_grad_(True)
    exp_rows = torch.stack([x64[t] for t, _ in pairs])
    exp_pp = torch.stack([p64[t, e] for t, e in pairs])
    assert torch.equal(rid, torch.tensor([t for t, _ in pairs]))
    assert torch.equal(permuted.double(), exp_rows.detach())
    g_rows, g_pp = torch.randn(n, hidden, generator=g), torch.randn(n, generator=g)
    torch.autograd.backward((permuted, pprobs), (g_rows, g_pp))
    torch.autograd.backward((exp_rows, exp_pp), (g_rows.double(), g_pp.double()))
    assert_close(x.grad, x64.grad)
    assert_close(probs.grad, p64.grad)
    y = torch.randn(n, hidden, generator=g, requires_grad=True)
    probs.grad = None
    p64.grad = None
    out = unpermute(y, rid, x.shape, probs, routing_map, backend="triton")
    y64 = y.detach().double().requires_grad_(True)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for i, (t, e) in enumerate(pairs):
        expected = expected.index_add(0, torch.tensor([t]), (p64[t, e] * y64[i])[None])
    assert_close(out, expected)
    g_out = torch.randn(tokens, hidden, generator=g)
    out.backward(g_out)
    expected.backward(g_out.double())
    assert_close(y.grad, y64.grad)
    assert_close(probs.grad, p64.grad)
