"""VocabParallelLinearCrossEntropy at tp=2 (gloo) equals an nn.Linear head + F.cross_entropy
built from the same seed, with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.tensor_parallel import ColumnParallelLinear, VocabParallelLinearCrossEntropy
from mtp.testing import run_distributed

S, B, H, V = 6, 2, 16, 40


def _reference(seed):
    torch.manual_seed(seed)
    head = nn.Linear(H, V, bias=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (S, B), generator=g)
    target[0, 1] = -100
    loss = F.cross_entropy(head(hidden).reshape(-1, V), target.reshape(-1), label_smoothing=0.1)
    loss.backward()
    return hidden, target, loss, head


def _worker(rank, world):
    out = []
    for sp in (False, True):
        hidden_ref, target, loss_ref, head_ref = _reference(7)
        torch.manual_seed(7)
        module = VocabParallelLinearCrossEntropy(
            H, V, bias=True, sequence_parallel=sp, group=dist.group.WORLD, dtype=torch.float64,
            label_smoothing=0.1, chunk_size=5,
        )  # fmt: skip
        rows = S // world
        hidden = hidden_ref.detach()[rank * rows : (rank + 1) * rows] if sp else hidden_ref.detach()
        hidden = hidden.clone().requires_grad_()
        loss = module(hidden, target)
        loss.backward()
        shard = slice(rank * V // world, (rank + 1) * V // world)
        dh_ref = hidden_ref.grad[rank * rows : (rank + 1) * rows] if sp else hidden_ref.grad
        torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(hidden.grad, dh_ref, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(module.weight.grad, head_ref.weight.grad[shard], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(module.bias.grad, head_ref.bias.grad[shard], rtol=1e-6, atol=1e-9)
        out.append(float(loss))
    # from_column_parallel shares the head's parameters
    head = ColumnParallelLinear(H, V, bias=False, group=dist.group.WORLD)
    fused = VocabParallelLinearCrossEntropy.from_column_parallel(head, reduction="sum")
    assert fused.weight is head.weight and fused.bias is None
    with pytest.raises(ValueError, match="gather_output"):
        VocabParallelLinearCrossEntropy.from_column_parallel(
            ColumnParallelLinear(H, V, gather_output=True, group=dist.group.WORLD)
        )
    return out


def test_module_matches_linear_head_and_cross_entropy():
    losses = run_distributed(_worker, 2, timeout=120)
    assert losses[0] == losses[1]


def _backends_worker(rank, world):
    hidden_ref, target, loss_ref, head_ref = _reference(3)
    grads = []
    for backend in ("triton", "torch"):
        torch.manual_seed(3)
        module = VocabParallelLinearCrossEntropy(
            H, V, bias=True, group=dist.group.WORLD, dtype=torch.float32, label_smoothing=0.1,
            chunk_size=5, backend=backend,
        )  # fmt: skip
        with torch.no_grad():  # the fp64 head's values (fp32 init draws other numbers)
            module.weight.copy_(head_ref.weight)
            module.bias.copy_(head_ref.bias)
        hidden = hidden_ref.detach().float().requires_grad_()
        loss = module(hidden, target)
        loss.backward()
        torch.testing.assert_close(loss.double(), loss_ref.detach(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(module.weight.grad.double(), head_ref.weight.grad,
                                   rtol=2e-5, atol=2e-5)  # fmt: skip
        grads.append(hidden.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-5, atol=2e-6)
    bad = VocabParallelLinearCrossEntropy(H, V, group=dist.group.WORLD, backend="cutlass")
    with pytest.raises(ValueError, match="backend"):
        bad(torch.randn(4, H), torch.zeros(4, dtype=torch.long))
    return True


def test_module_backends_agree_and_bad_backend_fails():
    """tp = 1: the Triton loss kernels (interpreter) and the PyTorch maths both equal the
    float64 head + F.cross_entropy within fp32 rounding; an unknown backend is a ValueError."""
    assert run_distributed(_backends_worker, 1, timeout=120) == [True]


def test_from_column_parallel_names_classes_by_module():
    """Megatron-Core has a ColumnParallelLinear too: the error tells the two apart."""
    import types

    from mtp.tensor_parallel import VocabParallelLinearCrossEntropy

    other = types.new_class("ColumnParallelLinear", (torch.nn.Module,))
    other.__module__ = "megatron.core.tensor_parallel.layers"
    with pytest.raises(TypeError) as info:
        VocabParallelLinearCrossEntropy.from_column_parallel(other())
    assert str(info.value) == (
        "head must be a mtp.tensor_parallel.ColumnParallelLinear, got "
        "megatron.core.tensor_parallel.layers.ColumnParallelLinear"
    )
