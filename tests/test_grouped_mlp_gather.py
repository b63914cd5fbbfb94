"""``mtp.ops.grouped_mlp(..., gather_index=, token_map=)``: the MoE dispatch's row gather fused
into fc1 (the rows and their probabilities read through the row map, no permuted copy), the
backward's per-token sum of the rows' gradients and the ``[T, E]`` probability gradient.

Output and every gradient against float64 autograd of the materialised gather, under the
interpreter: dropless and capacity (padding rows, dropped tokens), an empty expert, top-1 to
top-8, biases on and off, fp32/bf16/fp16; outputs poisoned before the kernels write them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp import ops, settings
from mtp.ops.moe_permute import moe_permute_row_map

LIMIT = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def _poison():
    with settings.override(poison_outputs=True):
        yield


def _routing(T, E, k, gen, empty_expert=True):
    """A top-``k`` routing map with expert ``E - 1`` left empty, and ``[T, E]`` probabilities
    (zero where not routed)."""
    scores = torch.rand(T, E, generator=gen)
    if empty_expert:
        scores[:, E - 1] = -1.0
    idx = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.rand(T, E, generator=gen) * routing_map
    return routing_map, probs


def _reference(x, w1, w2, probs, b1, b2, gather, counts):
    """float64: the gathered rows (zeros for padding rows) through both GEMMs, per expert."""
    rows = torch.where((gather >= 0)[:, None], x[gather.clamp(min=0)], 0)
    out, start = [], 0
    for e, m in enumerate(counts.tolist()):
        sl = slice(start, start + m)
        src = gather[sl]
        h = rows[sl] @ w1[e] + (0 if b1 is None else b1[e])
        a, g = h.chunk(2, -1)
        p = torch.where(src >= 0, probs[src.clamp(min=0), e], 0)
        o = (F.silu(a) * g * p[:, None]) @ w2[e] + (0 if b2 is None else b2[e])
        out.append(o)  # padding rows (src -1): zeros in, probability 0, so b2 out
        start += m
    out.append(rows.new_zeros(gather.shape[0] - start, x.shape[1]))
    return torch.cat(out)


CASES = [  # (T, E, k, capacity, bias, dtype)
    (12, 5, 2, None, False, torch.float32),
    (12, 5, 1, None, True, torch.float32),
    (10, 9, 8, None, False, torch.float32),
    (14, 6, 2, 3, True, torch.float32),  # capacity: padding rows and dropped tokens
    (12, 5, 2, None, True, torch.bfloat16),
    (12, 5, 3, None, False, torch.float16),
]


@pytest.mark.parametrize("T,E,k,capacity,bias,dtype", CASES)
def test_gathered_mlp_matches_float64(T, E, k, capacity, bias, dtype):
    gen = torch.Generator().manual_seed(T * 100 + E * 10 + k)
    H, F_ = 16, 24
    routing_map, probs = _routing(T, E, k, gen)
    n = E * capacity if capacity else T * k
    rm = moe_permute_row_map(routing_map, n, drop_and_pad=capacity is not None,
                             capacity=capacity or 0, backend="triton", token_map=True, width=k,
                             pair=False)  # fmt: skip
    gather, counts = rm.row_id_map, rm.tokens_per_expert
    want_counts = routing_map.sum(0) if capacity is None else torch.full((E,), capacity)
    assert torch.equal(counts, want_counts)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w1 = (torch.randn(E, H, 2 * F_, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, F_, H, generator=gen) / F_**0.5).to(dtype)
    b1 = torch.randn(E, 2 * F_, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
    dy = torch.randn(n, H, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_() if t is not None else None
              for t in (x, w1, w2, probs, b1, b2)]  # fmt: skip
    out = ops.grouped_mlp(leaves[0], leaves[1], leaves[2], counts, leaves[3], leaves[4],
                          leaves[5], activation="swiglu", backend="triton", gather_index=gather,
                          token_map=rm.token_map)  # fmt: skip
    out.backward(dy)
    ref_leaves = [t.double().requires_grad_() if t is not None else None
                  for t in (x, w1, w2, probs, b1, b2)]  # fmt: skip
    ref = _reference(*ref_leaves, gather, counts)
    ref.backward(dy.double())
    tol = LIMIT[dtype]
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    assert out.dtype == dtype and rel(out, ref) < tol, rel(out, ref)
    for name, got, want in zip(("x", "w1", "w2", "probs", "b1", "b2"), leaves, ref_leaves):
        if got is None:
            continue
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        assert rel(got.grad, want.grad) < 2 * tol, (name, rel(got.grad, want.grad))
    # the probability gradient is exactly zero off the routed (and kept) pairs
    kept = torch.zeros(T, E, dtype=torch.bool)
    for r, t in enumerate(gather.tolist()):
        if t >= 0:
            kept[t, int(torch.searchsorted(counts.cumsum(0), r, right=True))] = True
    assert torch.all(leaves[3].grad[~kept] == 0)


def test_gathered_equals_materialised_bitwise():
    """The fused gather reads the same rows and probabilities as a permuted copy: the same
    output bits as grouped_mlp on ``x[gather]`` with the permuted probabilities."""
    gen = torch.Generator().manual_seed(7)
    T, E, k, H, F_ = 16, 6, 2, 16, 24
    routing_map, probs = _routing(T, E, k, gen)
    rm = moe_permute_row_map(routing_map, T * k, backend="triton", token_map=True, width=k,
                             pair=False)  # fmt: skip
    gather, counts = rm.row_id_map, rm.tokens_per_expert
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, 2 * F_, generator=gen) / H**0.5
    w2 = torch.randn(E, F_, H, generator=gen) / F_**0.5
    fused = ops.grouped_mlp(x, w1, w2, counts, probs, activation="swiglu", backend="triton",
                            gather_index=gather, token_map=rm.token_map)  # fmt: skip
    expert = torch.repeat_interleave(torch.arange(E), counts)
    plain = ops.grouped_mlp(x[gather], w1, w2, counts, probs[gather, expert],
                            activation="swiglu", backend="triton")  # fmt: skip
    assert torch.equal(fused, plain)


def test_gather_bad_inputs_name_the_argument():
    gen = torch.Generator().manual_seed(3)
    T, E, k, H, F_ = 8, 4, 2, 16, 8
    routing_map, probs = _routing(T, E, k, gen)
    rm = moe_permute_row_map(routing_map, T * k, backend="triton", token_map=True, width=k)
    x, w1, w2 = torch.randn(T, H), torch.randn(E, H, 2 * F_), torch.randn(E, F_, H)
    counts = rm.tokens_per_expert
    kw = dict(activation="swiglu", backend="triton")
    with pytest.raises(TypeError, match="token_map"):
        ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=rm.row_id_map, **kw)
    with pytest.raises(ValueError, match="probs"):
        ops.grouped_mlp(x, w1, w2, counts, probs[:, :2], gather_index=rm.row_id_map,
                        token_map=rm.token_map, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="token_map"):
        ops.grouped_mlp(x, w1, w2, counts, None, token_map=rm.token_map, **kw)
    with pytest.raises((TypeError, ValueError), match="gather_index"):
        ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=rm.row_id_map.float(),
                        token_map=rm.token_map, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="scatter_index"):
        ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=rm.row_id_map,
                        token_map=rm.token_map, scatter_index=torch.arange(3), **kw)  # fmt: skip
    with pytest.raises((TypeError, ValueError), match="scatter_index"):
        ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=rm.row_id_map,
                        token_map=rm.token_map, scatter_index=rm.row_id_map.float(), **kw)
    # values: out of range, or two rows stored at one place, on either path, in both the
    # default (device) and the "sync" mode; validate=False skips the check
    M = rm.row_id_map.shape[0]
    bad_scatter = torch.arange(M).flip(0)
    bad_scatter[1] = bad_scatter[0]
    bad_gather = rm.row_id_map.clone()
    bad_gather[0] = T
    for validate, err in ((True, RuntimeError), ("sync", ValueError)):
        with pytest.raises(err, match="scatter_index must hold rows in .* each at most once"):
            ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=rm.row_id_map,
                            token_map=rm.token_map, scatter_index=bad_scatter,
                            validate=validate, **kw)  # fmt: skip
        with pytest.raises(err, match=rf"gather_index must hold rows in \[0, {T}\)"):
            ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=bad_gather,
                            token_map=rm.token_map, validate=validate, **kw)  # fmt: skip
    out_of_range = torch.arange(M)
    out_of_range[-1] = M
    with pytest.raises(ValueError, match="scatter_index must hold rows"):
        ops.grouped_mlp(x, w1, w2, counts, probs, gather_index=rm.row_id_map,
                        token_map=rm.token_map, scatter_index=out_of_range, validate="sync",
                        **kw)  # fmt: skip
    from mtp.ops.grouped_gemm.checks import check_index_values

    check_index_values(rm.row_id_map, T, torch.arange(M).flip(0), M, "sync")  # valid: no error


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scattered_fc2_equals_unscattered_bitwise(backend, dtype):
    """``scatter_index`` (a permutation; here with fc1 reading an EP receive buffer through the
    inverse one, ``[S]`` probabilities): fc2 stores row ``r`` at ``out[perm[r]]``: the same bits
    as the unscattered output permuted, and every gradient the same bits (the backward reads
    the output gradient through the index)."""
    gen = torch.Generator().manual_seed(11)
    E, H, F_, counts = 3, 16, 8, torch.tensor([5, 0, 6])
    M = int(counts.sum())
    perm = torch.randperm(M, generator=gen)
    inverse = torch.empty_like(perm).index_copy_(0, perm, torch.arange(M))
    from mtp.moe.ep_exchange import received_token_map

    leaves = [torch.randn(M, H, generator=gen), torch.randn(E, H, 2 * F_, generator=gen) / 4,
              torch.randn(E, F_, H, generator=gen) / 3, torch.rand(M, generator=gen),
              torch.randn(E, 2 * F_, generator=gen), torch.randn(E, H, generator=gen)]
    leaves = [t.to(dtype).requires_grad_(True) for t in leaves]
    dy = torch.randn(M, H, generator=gen).to(dtype)
    kw = dict(activation="swiglu", backend=backend, gather_index=perm,
              token_map=received_token_map(inverse))

    def run(scatter):
        x, w1, w2, p, b1, b2 = leaves
        out = ops.grouped_mlp(x, w1, w2, counts, p, b1, b2, scatter_index=scatter, **kw)
        return (out, *torch.autograd.grad(out, leaves, dy if scatter is not None else dy[perm]))

    scattered, plain = run(perm), run(None)
    assert torch.equal(scattered[0][perm], plain[0])
    for a, b in zip(scattered[1:], plain[1:]):
        assert torch.equal(a, b)
