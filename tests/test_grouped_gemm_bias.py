"""Per-expert bias of the grouped GEMM (``mtp.ops.grouped_gemm(..., bias=)``): added in the Triton
kernels' epilogue (plain and TMA, under the interpreter), after the GEMM on the other backends;
output and the three gradients against float64; the bias costs no extra launch or aten op on
the Triton backend; GroupedMLP with biases against its float64 per-expert reference."""

from __future__ import annotations

import pytest
import torch

from mtp import ops, settings
from mtp.kernels.grouped_gemm_details import launch
from mtp.ops.grouped_gemm.config import make_config
from mtp.moe import GroupedMLP
from mtp.testing.traffic import count_traffic
from test_grouped_gemm_tma import FAMILIES, SIZES, K, M, N

LIMIT = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(dtype, trans_b, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn((len(SIZES), N, K) if trans_b else (len(SIZES), K, N), generator=g)
         / K**0.5).to(dtype)  # fmt: skip
    bias = torch.randn(len(SIZES), N, generator=g).to(dtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    return x, w, bias, dy


def _reference(x, w, bias, trans_b):
    """float64 per-expert loop; rows past the routed ones are zero."""
    out, row = [], 0
    for e, m in enumerate(SIZES):
        we = w[e].t() if trans_b else w[e]
        out.append(x[row : row + m] @ we + bias[e])
        row += m
    out.append(x.new_zeros(M - row, N))
    return torch.cat(out)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_output_and_gradients_match_float64(backend, trans_b, dtype):
    x, w, bias, dy = _inputs(dtype, trans_b, seed=hash((backend, trans_b)) % 100)
    leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
    y = ops.grouped_gemm(leaves[0], leaves[1], torch.tensor(SIZES), trans_b=trans_b,
                         backend=backend, bias=leaves[2])  # fmt: skip
    y.backward(dy)
    ref_leaves = [t.double().requires_grad_() for t in (x, w, bias)]
    ref = _reference(*ref_leaves, trans_b)
    ref.backward(dy.double())
    assert _rel(y, ref) < LIMIT[dtype], _rel(y, ref)
    assert torch.equal(y[sum(SIZES):], torch.zeros_like(y[sum(SIZES):])), "rows past the routed"
    for leaf, want, name in zip(leaves, ref_leaves, ("x", "w", "bias")):
        assert leaf.grad.dtype == dtype
        assert _rel(leaf.grad, want.grad) < LIMIT[dtype], (name, _rel(leaf.grad, want.grad))
    for e, m in enumerate(SIZES):
        if m == 0:
            assert torch.equal(leaves[2].grad[e], torch.zeros(N, dtype=dtype)), f"dbias[{e}]"


def test_tma_kernel_bias_epilogue():
    x, w, bias, _ = _inputs(torch.bfloat16, False, seed=4)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    launch.forward(x, w, torch.tensor(SIZES, dtype=torch.int32), out, FAMILIES["large"],
                   bias=bias)  # fmt: skip
    ref = _reference(x.double(), w.double(), bias.double(), False)
    assert _rel(out, ref) < 1e-2 and torch.equal(out[sum(SIZES):], torch.zeros_like(out[61:]))


def test_bias_costs_no_extra_launch_or_aten_op(monkeypatch):
    """Triton: the bias is read in the epilogue (E x N elements), nothing else is added."""
    settings.configure(poison_outputs=False)
    x, w, bias, _ = _inputs(torch.float32, False, seed=5)
    counts = torch.tensor(SIZES)
    seen = []
    for b in (None, bias):
        ops.grouped_gemm(x, w, counts, backend="triton", bias=b, validate=False)  # warm-up
        with count_traffic() as t:
            ops.grouped_gemm(x, w, counts, backend="triton", bias=b, validate=False)
        seen.append(t)
    plain, fused = seen
    assert fused.num_launches == plain.num_launches and fused.num_aten_ops == plain.num_aten_ops
    extra = fused.bytes_program - plain.bytes_program
    assert 0 < extra <= bias.numel() * 4 * 8, extra  # the bias rows, once per row tile at most


def test_bad_bias_names_the_argument():
    x, w, bias, _ = _inputs(torch.float32, False)
    counts = torch.tensor(SIZES)
    with pytest.raises(ValueError, match="bias must be"):
        ops.grouped_gemm(x, w, counts, bias=bias[:, :5])
    with pytest.raises(TypeError, match="bias"):
        ops.grouped_gemm(x, w, counts, bias=bias.long())
    with pytest.raises(ValueError, match="bias"):
        launch.forward(x, w, counts, torch.empty(M, N),
                       make_config(0, x.dtype, M, N, K, len(SIZES)), bias=bias.t())  # fmt: skip


def test_opcheck_with_bias():
    x, w, bias, _ = _inputs(torch.float32, False)
    counts = torch.tensor(SIZES)
    torch.library.opcheck(torch.ops.mtp.grouped_gemm_out.default,
                          (x, w, counts, torch.empty(M, N), False, "reference", bias, None,
                           None, "none", 7.0, 1.702, None, None, None))  # fmt: skip
    torch.library.opcheck(torch.ops.mtp.grouped_gemm_out.default,  # bias before an activation
                          (x, w, counts, torch.empty(M, N), False, "reference", bias,
                           torch.empty(M, N), None, "gelu", 7.0, 1.702, None, None,
                           None))  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_mlp_biases_against_float64(backend):
    """fc1 bias + GeLU + probabilities + fc2 bias, per expert in float64; the biases'
    gradients included."""
    torch.manual_seed(2)
    mlp = GroupedMLP(3, 16, 12, activation="gelu", bias=True, backend=backend)
    with torch.no_grad():
        mlp.bias1.normal_()
        mlp.bias2.normal_()
    counts = torch.tensor([5, 0, 9])
    x = torch.randn(16, 16, requires_grad=True)
    probs = torch.rand(16)
    y = mlp(x, counts, probs)
    y.square().sum().backward()
    p64 = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    x64 = x.detach().double()
    rows, out = 0, []
    for e, m in enumerate(counts.tolist()):
        h = x64[rows : rows + m] @ p64["weight1"][e] + p64["bias1"][e]
        h = torch.nn.functional.gelu(h) * probs[rows : rows + m, None].double()
        out.append(h @ p64["weight2"][e] + p64["bias2"][e])
        rows += m
    out.append(torch.zeros(16 - rows, 16, dtype=torch.float64))
    ref = torch.cat(out)
    ref.square().sum().backward()
    assert _rel(y, ref) < 1e-5
    for name, p in mlp.named_parameters():
        assert _rel(p.grad, p64[name].grad) < 1e-5, name
