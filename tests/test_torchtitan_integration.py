"""mtp.integrations.torchtitan (torchtitan 0.3.0): the GroupedExperts override keeps torchtitan's
parameters and state dict, copies no weight per call, and equals the stock GroupedExperts: in
fp32 (ours against float64 within a few fp32 roundings; stock rounds to bf16 on every call) and
in bf16 (ours no worse than stock against float64); mtp's grouped GEMMs run (counted)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchtitan.models.common.moe")

E, D, FF = 4, 16, 24  # bf16 grouped_mm needs 16-byte strides


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _stock(dtype):
    from torchtitan.models.common.moe import GroupedExperts

    m = GroupedExperts(GroupedExperts.Config(dim=D, hidden_dim=FF, num_experts=E))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.to(dtype)


def _reference(x, w1, w2, w3, counts):
    out, row = torch.zeros_like(x), 0
    for e, n in enumerate(counts.tolist()):
        xe = x[row:row + n]
        out[row:row + n] = (F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T
        row += n
    return out


def _run(module, x, counts, dy):
    x = x.clone().requires_grad_()
    y = module(x, counts)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in (module.w1_EFD, module.w2_EDF, module.w3_EFD)]


def _err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_override_equals_stock(dtype):
    from mtp.integrations.torchtitan import GroupedExperts, apply_to_model

    stock = _stock(dtype)
    model = torch.nn.ModuleDict({"experts": copy.deepcopy(stock)})
    assert apply_to_model(model) == 1 and type(model["experts"]) is GroupedExperts
    ours = model["experts"]
    assert ours.state_dict().keys() == stock.state_dict().keys()  # checkpoints unchanged
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 3, 6])  # an empty expert, 2 padding rows
    x = torch.randn(16, D, generator=g).to(dtype)
    dy = torch.randn(16, D, generator=g).to(dtype)
    with _Ops() as ops:
        got = _run(ours, x, counts, dy)
    want = _run(stock, x, counts, dy)
    leaves = [x.double().requires_grad_()] + [
        p.detach().double().requires_grad_() for p in (stock.w1_EFD, stock.w2_EDF, stock.w3_EFD)]
    ref_y = _reference(leaves[0], leaves[1], leaves[2], leaves[3], counts)
    ref_y.backward(dy.double())
    ref = [ref_y] + [t.grad for t in leaves]
    eps = torch.finfo(dtype).eps
    routed = int(counts.sum())  # stock grouped_mm leaves the rows past the routed ones unwritten
    got[:2], want[:2], ref[:2] = ([t[:routed] for t in ts[:2]] for ts in (got, want, ref))
    for name, a, b, r in zip(("y", "dx", "dw1", "dw2", "dw3"), got, want, ref):
        scale = float(r.detach().abs().max())
        assert _err(a, r) <= max(2 * _err(b, r), 8 * eps * scale), (name, _err(a, r), _err(b, r))
    with torch.no_grad():  # rows past the routed ones: zeros
        assert float(ours(x, counts)[routed:].abs().max()) == 0.0
    # the one grouped GEMM op: gate and up written into one buffer (no concatenation), fc2, and
    # the three data gradients (the weight gradients are mtp::grouped_gemm_wgrad)
    assert ops.names.count("mtp::grouped_gemm_out") == 6 and "mtp::bias_swiglu" in ops.names
    assert ops.names.count("mtp::grouped_gemm_wgrad") == 3 and "aten::cat" not in ops.names
    # no weight copy: no aten op produced a tensor of a weight's shape in the forward
    assert "aten::_to_copy" not in ops.names or dtype != torch.float32


def test_grouped_swiglu_experts_errors():
    from mtp.integrations.torchtitan import apply_to_model, grouped_swiglu_experts

    x = torch.randn(4, D)
    w1, w2 = torch.randn(E, FF, D), torch.randn(E, D, FF)
    with pytest.raises(ValueError, match="w3 must be"):
        grouped_swiglu_experts(x, w1, w2, w1[:, :3], torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="num_tokens_per_expert must be"):
        grouped_swiglu_experts(x, w1, w2, w1, torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="builtins.int"):
        apply_to_model(3)
