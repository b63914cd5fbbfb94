"""mtp.ops.permute / unpermute: Megatron-Core row order, float64 references, gradients,
drop-and-pad, the indices= form, graph safety, AOT compilation, bad input.

The expected values come from an independent per-expert Python loop (Megatron-Core's order:
expert-major, ascending token within an expert) evaluated in float64 with autograd; nothing here
calls the code under test to produce an expected value.
"""

from __future__ import annotations

import pytest
import torch

from mtp import settings
import mtp.ops
from mtp.kernels import moe_permute as kernels
from mtp.ops import permute, unpermute
from mtp.testing import assert_close, assert_graph_safe, compile_for_targets, count_host_syncs

BACKENDS = ("triton", "reference")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- independent float64 oracle --------------------------------------------------------------


def loop_rows(routing_map: torch.Tensor, drop_and_pad: bool = False, capacity: int = 0):
    """(token, expert) of each permuted row, None for an empty drop-and-pad slot."""
    num_tokens, num_experts = routing_map.shape
    table = routing_map.tolist()
    rows = []
    for e in range(num_experts):
        mine = [(t, e) for t in range(num_tokens) if table[t][e]]
        if drop_and_pad:
            mine = mine[:capacity]
            mine += [None] * (capacity - len(mine))
        rows += mine
    return rows


def loop_permute(tokens64, probs64, rows):
    zero = tokens64.new_zeros(tokens64.shape[1])
    permuted = [tokens64[r[0]] if r else zero for r in rows]
    permuted = torch.stack(permuted) if rows else tokens64.new_zeros((0, tokens64.shape[1]))
    pprobs = None
    if probs64 is not None:
        pprobs = [probs64[r[0], r[1]] if r else probs64.new_zeros(()) for r in rows]
        pprobs = torch.stack(pprobs) if rows else probs64.new_zeros(0)
    return permuted, pprobs


def loop_unpermute(x64, rows, num_tokens, probs64=None):
    out = [x64.new_zeros(x64.shape[1]) for _ in range(num_tokens)]
    for i, r in enumerate(rows):
        if r is None:
            continue
        t, e = r
        out[t] = out[t] + (x64[i] if probs64 is None else probs64[t, e] * x64[i])
    return torch.stack(out) if num_tokens else x64.new_zeros((0, x64.shape[1]))


def row_tokens(rows):
    return torch.tensor([r[0] if r else -1 for r in rows], dtype=torch.int64)


# --- inputs ----------------------------------------------------------------------------------


def topk_routing(num_tokens, num_experts, k, *, experts=None, seed=0):
    """Top-k routing over `experts` (default all): (routing_map, probs [T, E], indices)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if experts is not None:
        banned = torch.ones(num_experts, dtype=torch.bool)
        banned[list(experts)] = False
        logits[:, banned] = float("-inf")
    top = logits.topk(k, dim=1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, top.indices, True)
    probs = torch.zeros(num_tokens, num_experts).scatter_(1, top.indices, top.values.softmax(1))
    return routing_map, probs, top.indices


def ragged_routing(num_tokens, num_experts, seed=0):
    """Any number of experts per token (some tokens go nowhere, some experts get nothing)."""
    g = torch.Generator().manual_seed(seed)
    routing_map = torch.rand(num_tokens, num_experts, generator=g) < 0.3
    routing_map[:, 0] = False  # an empty expert
    probs = torch.rand(num_tokens, num_experts, generator=g) * routing_map
    return routing_map, probs


CASES = {
    # name: (T, E, k or None for ragged, H, experts used)
    "top2": (37, 8, 2, 33, None),
    "one_expert": (19, 1, 1, 8, None),
    "empty_experts": (16, 6, 2, 7, (0, 3, 5)),
    "dense_k_equals_e": (5, 4, 4, 1, None),
    "ragged": (29, 5, None, 65, None),
}


def make_case(name, seed=0):
    num_tokens, num_experts, k, hidden, experts = CASES[name]
    if k is None:
        routing_map, probs = ragged_routing(num_tokens, num_experts, seed)
    else:
        routing_map, probs, _ = topk_routing(num_tokens, num_experts, k, experts=experts, seed=seed)
    return routing_map, probs, hidden


# --- forward + backward against the loop -----------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_permute_unpermute_match_megatron_loop(case, dtype, backend):
    routing_map, probs, hidden = make_case(case)
    num_tokens = routing_map.shape[0]
    rows = loop_rows(routing_map)
    n = len(rows)
    tokens = torch.randn(num_tokens, hidden).to(dtype).requires_grad_(True)
    probs = probs.requires_grad_(True)

    permuted, pprobs, row_id_map = permute(tokens, routing_map, probs, n, backend=backend)

    tokens64 = tokens.detach().double().requires_grad_(True)
    probs64 = probs.detach().double().requires_grad_(True)
    exp_permuted, exp_pprobs = loop_permute(tokens64, probs64, rows)
    assert row_id_map.dtype == torch.int64
    assert torch.equal(row_id_map, row_tokens(rows)), "row order differs from Megatron-Core's"
    assert permuted.dtype == dtype and pprobs.dtype == probs.dtype
    assert torch.equal(permuted.double(), exp_permuted.detach()), "permute must copy rows exactly"
    assert torch.equal(pprobs.double(), exp_pprobs.detach())

    # permute backward: tokens grad is a per-token sum of row grads, probs grad a scatter.
    g_rows = torch.randn(n, hidden).to(dtype)
    g_probs = torch.randn(n)
    torch.autograd.backward((permuted, pprobs), (g_rows, g_probs))
    torch.autograd.backward((exp_permuted, exp_pprobs), (g_rows.double(), g_probs.double()))
    assert_close(tokens.grad, tokens64.grad, dtype, msg="permute: tokens grad")
    assert_close(probs.grad, probs64.grad, torch.float32, msg="permute: probs grad")

    # unpermute with probs (the expert outputs are fresh rows) and its two gradients.
    x = torch.randn(n, hidden).to(dtype).requires_grad_(True)
    probs.grad = None
    out = unpermute(x, row_id_map, tokens.shape, probs, routing_map, backend=backend)
    x64 = x.detach().double().requires_grad_(True)
    probs64.grad = None
    expected = loop_unpermute(x64, rows, num_tokens, probs64)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert_close(out, expected, dtype, msg="unpermute")
    g_out = torch.randn(num_tokens, hidden).to(dtype)
    out.backward(g_out)
    expected.backward(g_out.double())
    assert_close(x.grad, x64.grad, dtype, msg="unpermute: permuted grad")
    # <x_i, g_t> sums H products of dtype-rounded inputs in fp32: dtype-level error.
    assert_close(probs.grad, probs64.grad, dtype, msg="unpermute: probs grad")

    # unpermute without probs: plain per-token sum.
    out_plain = unpermute(x.detach(), row_id_map, tokens.shape, backend=backend)
    assert_close(out_plain, loop_unpermute(x64.detach(), rows, num_tokens), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpermute_inverts_permute(backend):
    """Dropless top-k without probs: unpermute(permute(x)) == k * x, in fp32 exactly."""
    routing_map, _, _ = topk_routing(41, 6, 3, seed=3)
    tokens = torch.randn(41, 17)
    permuted, _, rid = permute(tokens, routing_map, num_out_tokens=41 * 3, backend=backend)
    restored = unpermute(permuted, rid, tokens.shape, backend=backend)
    assert_close(restored, 3 * tokens.double())


# --- drop and pad ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_drop_and_pad(dtype, backend):
    """Capacity 9 over 5 experts: some experts overflow (first tokens kept), some underflow
    (zero slots, row_id_map -1); unpermute needs no routing_map with probs here."""
    routing_map, probs, _ = topk_routing(23, 5, 2, seed=7)
    counts = routing_map.sum(0)
    capacity = 9
    assert (counts > capacity).any() and (counts < capacity).any()
    rows = loop_rows(routing_map, drop_and_pad=True, capacity=capacity)
    tokens = torch.randn(23, 9).to(dtype).requires_grad_(True)
    probs.requires_grad_(True)
    permuted, pprobs, rid = permute(
        tokens, routing_map, probs, drop_and_pad=True, capacity=capacity, backend=backend
    )
    tokens64 = tokens.detach().double().requires_grad_(True)
    probs64 = probs.detach().double().requires_grad_(True)
    exp_permuted, exp_pprobs = loop_permute(tokens64, probs64, rows)
    assert permuted.shape == (5 * capacity, 9)
    assert torch.equal(rid, row_tokens(rows))
    assert torch.equal(permuted.double(), exp_permuted.detach())
    assert torch.equal(pprobs.double(), exp_pprobs.detach())
    g_rows, g_probs = torch.randn(5 * capacity, 9).to(dtype), torch.randn(5 * capacity)
    torch.autograd.backward((permuted, pprobs), (g_rows, g_probs))
    torch.autograd.backward((exp_permuted, exp_pprobs), (g_rows.double(), g_probs.double()))
    assert_close(tokens.grad, tokens64.grad, dtype)
    assert_close(probs.grad, probs64.grad, torch.float32)

    # Megatron's convention: capacity from num_out_tokens // E gives the same result.
    same = permute(tokens, routing_map, probs, 5 * capacity, drop_and_pad=True, backend=backend)
    assert torch.equal(same[2], rid) and torch.equal(same[0], permuted)

    # Expert outputs are nonzero in the empty slots (e.g. a bias): unpermute must skip them.
    x = torch.randn(5 * capacity, 9).to(dtype).requires_grad_(True)
    probs.grad = None
    out = unpermute(x, rid, tokens.shape, probs, drop_and_pad=True, backend=backend)
    x64 = x.detach().double().requires_grad_(True)
    probs64.grad = None
    expected = loop_unpermute(x64, rows, 23, probs64)
    assert_close(out, expected, dtype)
    g = torch.randn(23, 9).to(dtype)
    out.backward(g)
    expected.backward(g.double())
    assert_close(x.grad, x64.grad, dtype)
    assert_close(probs.grad, probs64.grad, dtype)
    # Passing routing_map as well (Megatron's signature) changes nothing.
    again = unpermute(x.detach(), rid, tokens.shape, probs, routing_map, True, backend=backend)
    assert torch.equal(again, out.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_and_pad_capacity_above_token_count(backend):
    routing_map, probs, _ = topk_routing(3, 2, 1, seed=1)
    rows = loop_rows(routing_map, drop_and_pad=True, capacity=5)
    tokens = torch.randn(3, 4)
    permuted, pprobs, rid = permute(tokens, routing_map, probs, None, True, 5, backend=backend)
    exp_permuted, exp_pprobs = loop_permute(tokens.double(), probs.double(), rows)
    assert torch.equal(rid, row_tokens(rows))
    assert torch.equal(permuted.double(), exp_permuted)
    assert torch.equal(pprobs.double(), exp_pprobs)


# --- indices= form, empty inputs, defaults ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_indices_form_gives_the_same_order(backend):
    routing_map, probs, indices = topk_routing(31, 7, 3, seed=5)
    tokens = torch.randn(31, 10)
    by_map = permute(tokens, routing_map, probs, 31 * 3, backend=backend)
    by_idx = permute(tokens, probs=probs, indices=indices, backend=backend)  # N = T * k
    by_idx32 = permute(tokens, indices=indices.int(), num_experts=7, backend=backend)
    for a, b in zip(by_map, by_idx):
        assert torch.equal(a, b)
    assert torch.equal(by_idx32[0], by_map[0]) and torch.equal(by_idx32[2], by_map[2])
    assert by_idx32[1] is None
    x = torch.randn(31 * 3, 10)
    out_map = unpermute(x, by_map[2], tokens.shape, probs, routing_map, backend=backend)
    out_idx = unpermute(x, by_map[2], tokens.shape, probs, indices=indices, backend=backend)
    assert torch.equal(out_map, out_idx)
    dropped_map = permute(tokens, routing_map, drop_and_pad=True, capacity=6, backend=backend)
    dropped_idx = permute(
        tokens, indices=indices, num_experts=7, drop_and_pad=True, capacity=6, backend=backend
    )
    assert torch.equal(dropped_map[2], dropped_idx[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    tokens = torch.randn(0, 6)
    routing_map = torch.zeros(0, 4, dtype=torch.bool)
    permuted, pprobs, rid = permute(tokens, routing_map, torch.zeros(0, 4), 0, backend=backend)
    assert permuted.shape == (0, 6) and pprobs.shape == (0,) and rid.shape == (0,)
    assert unpermute(permuted, rid, (0, 6), backend=backend).shape == (0, 6)
    # No tokens (an EP rank that received nothing): the output keeps its autograd link, so the
    # rank still takes part in backward.
    rows = torch.randn(3, 6, requires_grad=True)
    out = unpermute(rows, torch.full((3,), -1), (0, 6), backend=backend)
    assert out.shape == (0, 6) and out.requires_grad
    out.sum().backward()
    assert torch.equal(rows.grad, torch.zeros(3, 6))
    # Tokens routed nowhere: nothing permuted, unpermute gives zeros.
    tokens = torch.randn(5, 6)
    routing_map = torch.zeros(5, 4, dtype=torch.bool)
    permuted, _, rid = permute(tokens, routing_map, num_out_tokens=0, backend=backend)
    assert permuted.shape == (0, 6)
    out = unpermute(permuted, rid, (5, 6), torch.rand(5, 4), routing_map, backend=backend)
    assert torch.equal(out, torch.zeros(5, 6))
    # drop_and_pad with no routed token: all slots empty.
    permuted, _, rid = permute(tokens, routing_map, drop_and_pad=True, capacity=2, backend=backend)
    assert torch.equal(permuted, torch.zeros(8, 6)) and torch.equal(rid, torch.full((8,), -1))


def test_num_out_tokens_default_counts_routed_pairs():
    routing_map, _ = ragged_routing(13, 4, seed=2)
    tokens = torch.randn(13, 5)
    permuted, _, rid = permute(tokens, routing_map, backend="triton")
    assert torch.equal(rid, row_tokens(loop_rows(routing_map)))


def test_validate_false_pads_or_truncates_like_megatron():
    routing_map, _, _ = topk_routing(9, 3, 2, seed=4)
    rows = loop_rows(routing_map)
    tokens = torch.randn(9, 3)
    for backend in BACKENDS:
        longer = permute(tokens, routing_map, None, 22, backend=backend, validate=False)
        assert torch.equal(longer[2], row_tokens(rows + [None] * 4))
        assert torch.equal(longer[0][18:], torch.zeros(4, 3))
        shorter = permute(tokens, routing_map, None, 15, backend=backend, validate=False)
        assert torch.equal(shorter[2], row_tokens(rows[:15]))


def test_auto_backend_on_cpu_is_the_reference(monkeypatch):
    settings.configure(backend=None)
    routing_map, probs, _ = topk_routing(11, 4, 2)
    tokens = torch.randn(11, 5)
    auto = permute(tokens, routing_map, probs, 22)
    ref = mtp.ops.moe_permute.permute_reference(tokens, routing_map, probs, 22)
    for a, b in zip(auto, ref):
        assert torch.equal(a, b)
    x = torch.randn(22, 5)
    assert torch.equal(
        unpermute(x, auto[2], (11, 5), probs, routing_map),
        mtp.ops.moe_permute.unpermute_reference(x, auto[2], (11, 5), probs, routing_map),
    )


def test_unpermute_is_deterministic():
    routing_map, probs, _ = topk_routing(20, 3, 3, seed=9)
    x = torch.randn(60, 12)
    rid = row_tokens(loop_rows(routing_map))
    first = unpermute(x, rid, (20, 12), probs, routing_map, backend="triton")
    second = unpermute(x, rid, (20, 12), probs, routing_map, backend="triton")
    assert torch.equal(first, second)


# --- graph safety ----------------------------------------------------------------------------


class _Into:
    """Copies a routine's outputs into buffers allocated once (fixed addresses, as in a CUDA
    graph's static outputs), so assert_graph_safe can check the routine itself."""

    def __init__(self, fn, *buffers):
        self.fn, self.buffers = fn, buffers

    def __call__(self, *args):
        outs = [t for t in self.fn(*args) if t is not None]
        for buf, t in zip(self.buffers, outs):
            buf.copy_(t.detach())
        return self.buffers


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("drop_and_pad", [False, True], ids=["dropless", "drop_and_pad"])
def test_permute_and_unpermute_are_graph_safe(drop_and_pad, backend):
    routing_map, probs, indices = topk_routing(24, 6, 2, seed=11)
    tokens = torch.randn(24, 10)
    n = 24 if drop_and_pad else 48
    kw = dict(drop_and_pad=True, capacity=4) if drop_and_pad else dict(num_out_tokens=n)

    def routine(tokens, routing_map, probs):
        permuted, pprobs, rid = permute(tokens, routing_map, probs, backend=backend, **kw)
        out = unpermute(
            permuted * 2, rid, tokens.shape, probs, routing_map, drop_and_pad, backend=backend
        )
        return permuted, pprobs, rid, out

    fn = _Into(
        routine, torch.empty(n, 10), torch.empty(n), torch.empty(n, dtype=torch.int64),
        torch.empty(24, 10),
    )
    assert_graph_safe(fn, tokens, routing_map, probs)

    def by_indices(tokens, indices, probs):
        return permute(tokens, probs=probs, indices=indices, backend=backend, **kw)

    fn = _Into(by_indices, torch.empty(n, 10), torch.empty(n), torch.empty(n, dtype=torch.int64))
    assert_graph_safe(fn, tokens, indices, probs)


def test_backward_is_graph_safe():
    routing_map, probs, _ = topk_routing(16, 4, 2, seed=12)

    def step(tokens, routing_map, probs, g):
        tokens = tokens.detach().requires_grad_(True)
        probs = probs.detach().requires_grad_(True)
        permuted, _, rid = permute(tokens, routing_map, probs, 32, backend="triton")
        out = unpermute(permuted * 3, rid, tokens.shape, probs, routing_map, backend="triton")
        return torch.autograd.grad(out, (tokens, probs), g)

    fn = _Into(step, torch.empty(16, 8), torch.empty(16, 4))
    assert_graph_safe(fn, torch.randn(16, 8), routing_map, probs, torch.randn(16, 8))


def test_no_host_sync_without_validation():
    routing_map, probs, _ = topk_routing(10, 4, 2)
    tokens = torch.randn(10, 4)
    with count_host_syncs() as syncs:
        _, _, rid = permute(tokens, routing_map, probs, 20, backend="triton", validate=False)
        unpermute(torch.randn(20, 4), rid, (10, 4), probs, routing_map, validate=False,
                  backend="triton")
    assert syncs.count == 0, syncs.events


def test_custom_ops_pass_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch of the three ops."""
    x = torch.randn(6, 5, requires_grad=True)
    index = torch.tensor([2, -1, 0, 5, 2, 1, 3])
    scale = torch.rand(7, requires_grad=True)
    rows = torch.randn(7, 5, requires_grad=True)
    ops = torch.ops.mtp
    torch.library.opcheck(ops.moe_gather_rows.default, (x, index, scale))
    torch.library.opcheck(ops.moe_combine_rows.default, (rows, index, scale, 6))
    torch.library.opcheck(
        ops.moe_gather_rows_dot.default, (x.detach(), index, None, rows.detach(), False)
    )


def test_token_map_custom_ops_pass_opcheck():
    """The fused ops (row map + scatter, token-major combine, both backwards)."""
    routing_map, probs, indices = topk_routing(12, 5, 2, seed=14)
    probs.requires_grad_(True)
    x = torch.randn(12, 6, requires_grad=True)
    ops = torch.ops.mtp
    torch.library.opcheck(ops.moe_permute.default, (x, routing_map, probs, 24, 5, -1, True))
    torch.library.opcheck(ops.moe_permute.default, (x, indices, None, 15, 5, 3, True))
    torch.library.opcheck(ops.moe_row_map.default, (routing_map, 24, -1))
    out = ops.moe_permute(x.detach(), routing_map, probs.detach(), 24, 5, -1, True)
    rid, rows, experts, count = out[2:6]
    y = torch.randn(24, 6, requires_grad=True)
    torch.library.opcheck(ops.moe_unpermute.default, (y, rows, experts, count, rid, probs))
    torch.library.opcheck(
        ops.moe_permute_backward.default,
        (y.detach(), torch.randn(24), rows, experts, count, 6, 5, torch.float32, torch.float32),
    )
    torch.library.opcheck(
        ops.moe_unpermute_backward.default,
        (torch.randn(12, 6), y.detach(), rows, experts, count, rid, probs.detach(), True),
    )
    torch.library.opcheck(ops.moe_invert_row_map.default, (rid, routing_map, 12, 5, 5, -1, True,
                                                           True))  # fmt: skip
    torch.library.opcheck(ops.moe_invert_row_map.default, (rid, None, 12, 5, 5, 4, False, True))
    torch.library.opcheck(ops.moe_scatter_rows.default, (x, rows, experts, count, rid))


def test_torch_compile_fullgraph():
    routing_map, probs, _ = topk_routing(12, 4, 2, seed=13)

    def layer(tokens, routing_map, probs):
        permuted, _, rid = permute(tokens, routing_map, probs, 24, backend="triton")
        return unpermute(permuted * 2, rid, tokens.shape, probs, routing_map, backend="triton")

    tokens = torch.randn(12, 6, requires_grad=True)
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(tokens, routing_map, probs)
    out.backward(torch.ones_like(out))
    expected = 2 * tokens.detach() * probs.sum(1, keepdim=True)
    assert_close(out, expected.double())
    assert_close(tokens.grad, 2 * probs.sum(1, keepdim=True).expand(12, 6).double())


# --- ahead-of-time compilation ----------------------------------------------------------------

_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _gather_build(dtype, has_scale, write_out, has_dot, hidden=7168):
    block, warps = kernels.block_config(hidden)
    t = "*" + _TL[dtype]
    sig = {
        "x_ptr": t, "index_ptr": "*i64", "scale_ptr": "*fp32", "other_ptr": t, "out_ptr": t,
        "dot_ptr": "*fp32", "num_src_rows": "i32", "hidden": "i32",
    }
    const = dict(HAS_SCALE=has_scale, WRITE_OUT=write_out, HAS_DOT=has_dot, BLOCK_H=block)
    return compile_for_targets(kernels._gather_rows_kernel, sig, const, num_warps=warps)


def _combine_build(dtype, has_weight, hidden=7168):
    block, warps = kernels.block_config(hidden)
    t = "*" + _TL[dtype]
    sig = {
        "x_ptr": t, "rows_ptr": "*i64", "offsets_ptr": "*i64", "weight_ptr": "*fp32",
        "out_ptr": t, "hidden": "i32",
    }
    const = dict(HAS_WEIGHT=has_weight, BLOCK_H=block)
    return compile_for_targets(kernels._combine_rows_kernel, sig, const, num_warps=warps)


def _check_builds(builds):
    for cc, build in builds.items():
        assert build.fits_shared_memory, (cc, build.shared)
        info = build.ptxas()
        if info is not None:
            assert info.registers <= 255 and not info.spills, (cc, info.output)
        # 64-bit row offsets: the index is widened before it scales the hidden size.
        assert "mul.lo.s64" in build.ptx or "mul.wide.s32" in build.ptx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_compile_for_sm90_and_sm100(dtype):
    """Every kernel variant the ops launch (forward and backward) for the default config."""
    _check_builds(_gather_build(dtype, False, True, False))  # permute forward
    _check_builds(_combine_build(dtype, True))  # unpermute forward (probs) / backward
    if dtype == torch.bfloat16:
        _check_builds(_combine_build(dtype, False))  # unpermute without probs / permute bwd
        _check_builds(_gather_build(dtype, True, True, False))  # unpermute bwd, permuted grad
        _check_builds(_gather_build(dtype, True, True, True))  # ... with the probs grad
        _check_builds(_gather_build(dtype, False, False, True))  # probs grad only


# --- bad input -------------------------------------------------------------------------------


def test_bad_permute_arguments():
    routing_map, probs, indices = topk_routing(8, 4, 2)
    tokens = torch.randn(8, 5)
    with pytest.raises(TypeError, match="routing_map must have dtype in \\(bool\\), got int64"):
        permute(tokens, routing_map.long(), num_out_tokens=16)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="num_out_tokens=15 but routing_map routes 16"):
            permute(tokens, routing_map, num_out_tokens=15, backend=backend, validate="sync")
        # default: checked on the device, no host sync (on CPU the assert raises at once)
        with pytest.raises(RuntimeError, match="num_out_tokens=15 must equal the number of"):
            permute(tokens, routing_map, num_out_tokens=15, backend=backend)
    with pytest.raises(ValueError, match="tokens must be 2-D"):
        permute(tokens[None], routing_map, num_out_tokens=16)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        permute(tokens.long(), routing_map, num_out_tokens=16)
    with pytest.raises(ValueError, match="routing_map must be \\[T, E\\] with T=8"):
        permute(tokens, routing_map[:7], num_out_tokens=14)
    with pytest.raises(ValueError, match="probs must have routing_map's shape"):
        permute(tokens, routing_map, probs[:, :3], num_out_tokens=16)
    with pytest.raises(ValueError, match="routing_map must be on cpu"):
        permute(tokens, routing_map.to("meta"), num_out_tokens=16)
    with pytest.raises(ValueError, match="exactly one of routing_map"):
        permute(tokens, routing_map, indices=indices)
    with pytest.raises(ValueError, match="exactly one of routing_map"):
        permute(tokens)
    with pytest.raises(ValueError, match="needs num_experts"):
        permute(tokens, indices=indices)
    dup = torch.zeros(8, 2, dtype=torch.int64)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="expert numbers in \\[0, 3\\)"):
            permute(tokens, indices=indices, num_experts=3, backend=backend, validate="sync")
        with pytest.raises(ValueError, match="must not repeat an expert"):
            permute(tokens, indices=dup, num_experts=4, backend=backend, validate="sync")
        for bad, e in ((indices, 3), (dup, 4)):
            msg = f"indices must hold k distinct expert numbers in \\[0, {e}\\)"
            with pytest.raises(RuntimeError, match=msg):
                permute(tokens, indices=bad, num_experts=e, backend=backend)
    with pytest.raises(ValueError, match="num_out_tokens=15 but indices route T \\* k = 16"):
        permute(tokens, indices=indices, num_out_tokens=15, num_experts=4)
    with pytest.raises(TypeError, match="num_out_tokens must be a Python int"):
        permute(tokens, routing_map, num_out_tokens=16.0)
    with pytest.raises(TypeError, match="indices must have dtype"):
        permute(tokens, indices=indices.float(), num_experts=4)
    with pytest.raises(ValueError, match="needs capacity="):
        permute(tokens, routing_map, drop_and_pad=True)
    with pytest.raises(ValueError, match="only used with drop_and_pad"):
        permute(tokens, routing_map, num_out_tokens=16, capacity=4)
    with pytest.raises(ValueError, match="must equal E \\* capacity"):
        permute(tokens, routing_map, num_out_tokens=12, drop_and_pad=True, capacity=4)
    with pytest.raises(ValueError, match="multiple of the number of experts 4"):
        permute(tokens, routing_map, num_out_tokens=10, drop_and_pad=True)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        permute(tokens, routing_map, num_out_tokens=16, backend="cuda")
    # validate=False: the count check is skipped (the caller vouches for num_out_tokens).
    permute(tokens, routing_map, num_out_tokens=15, validate=False)


def test_bad_unpermute_arguments():
    routing_map, probs, _ = topk_routing(8, 4, 2)
    x = torch.randn(16, 5)
    rid = row_tokens(loop_rows(routing_map))
    with pytest.raises(ValueError, match="one entry per permuted row \\(16\\), got 15"):
        unpermute(x, rid[:15], (8, 5))
    with pytest.raises(TypeError, match="row_id_map must have dtype"):
        unpermute(x, rid.float(), (8, 5))
    with pytest.raises(ValueError, match="must end in permuted's hidden size 5"):
        unpermute(x, rid, (8, 6))
    with pytest.raises(ValueError, match="restore_shape must be \\(T, H\\)"):
        unpermute(x, rid, (8,))
    with pytest.raises(ValueError, match="token numbers in \\[0, 8\\) or -1, got values in"):
        unpermute(x, rid + 1, (8, 5), validate="sync")
    with pytest.raises(RuntimeError, match="token numbers in \\[0, 8\\) or -1"):
        unpermute(x, rid + 1, (8, 5))
    with pytest.raises(ValueError, match="needs routing_map"):
        unpermute(x, rid, (8, 5), probs)
    with pytest.raises(ValueError, match="does not match routing_map: [0-9]+ rows"):
        unpermute(x, rid.flip(0), (8, 5), probs, routing_map, validate="sync")
    with pytest.raises(RuntimeError, match="does not match routing_map"):
        unpermute(x, rid.flip(0), (8, 5), probs, routing_map)
    with pytest.raises(ValueError, match="probs must be \\[T, E\\] with T=8"):
        unpermute(x, rid, (8, 5), probs[:7], routing_map)
    with pytest.raises(ValueError, match="not a multiple of E=3"):
        unpermute(x, rid, (8, 5), probs[:, :3], drop_and_pad=True)
    with pytest.raises(ValueError, match="permuted must be on cpu|row_id_map must be on"):
        unpermute(x, rid.to("meta"), (8, 5))


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_matches_loop(dtype):
    routing_map, probs, _ = topk_routing(300, 16, 4, seed=21)
    rows = loop_rows(routing_map)
    tokens = torch.randn(300, 1000).to(dtype)
    permuted, pprobs, rid = permute(tokens.cuda(), routing_map.cuda(), probs.cuda(), 1200)
    exp_permuted, _ = loop_permute(tokens.double(), probs.double(), rows)
    assert torch.equal(rid.cpu(), row_tokens(rows))
    assert torch.equal(permuted.cpu().double(), exp_permuted)
    x = torch.randn(1200, 1000).to(dtype)
    out = unpermute(x.cuda(), rid, (300, 1000), probs.cuda(), routing_map.cuda())
    assert_close(out.cpu(), loop_unpermute(x.double(), rows, 300, probs.double()), dtype)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """num_out_tokens * H > 2**31 elements: rows at the end must land where they belong."""
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    num_tokens, k, hidden = 131072, 2, 8320  # N * H = 2.18e9
    routing_map, _, _ = topk_routing(num_tokens, 8, k, seed=22)
    routing_map = routing_map.cuda()
    tokens = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    permuted, _, rid = permute(tokens, routing_map, None, num_tokens * k, validate=False)
    tail = torch.arange(permuted.shape[0] - 64, permuted.shape[0], device="cuda")
    assert torch.equal(permuted[tail], tokens[rid[tail]])
    out = unpermute(permuted, rid, tokens.shape, validate=False)
    last = rid[-1]
    assert torch.equal(out[last].float(), 2 * tokens[last].float())
