"""Launch-plan keys checked against Triton's own build choice (run by test_host_budget.py in its
null-GPU subprocess, with ``mtp.kernels._launch.set_verify(True)``): each op on inputs whose
alignment, strides, dtypes and options differ from the host benchmark's, so that a plan key that
misses something Triton specialises on raises instead of launching the wrong build."""

from __future__ import annotations

import torch


def _misaligned(shape, dtype):
    """A tensor of ``shape`` whose address is not a multiple of 16 bytes."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


def _bias_act():
    from mtp.ops import bias_gelu, bias_swiglu

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for make in (lambda s: torch.randn(s).to(dtype), lambda s: _misaligned(s, dtype)):
            for rows in (1, 16, 33):
                x = make((rows, 96)).requires_grad_()
                b = make((96,)).requires_grad_()
                for fn in (lambda: bias_gelu(x, b), lambda: bias_gelu(x, None, "tanh"),
                           lambda: bias_swiglu(x, b)):
                    y = fn()
                    y.backward(torch.ones_like(y))


def _cross_entropy():
    from mtp.ops import vocab_parallel_cross_entropy

    for dtype in (torch.float32, torch.bfloat16):
        for make in (lambda s: torch.randn(s).to(dtype), lambda s: _misaligned(s, dtype)):
            for rows, ignore in ((1, -100), (16, 1), (33, 16), (5, 0)):
                for reduction in ("none", "mean", "sum"):
                    x = make((rows, 160)).requires_grad_()
                    t = torch.randint(0, 160, (rows,), dtype=torch.int32)
                    loss = vocab_parallel_cross_entropy(
                        x, t, ignore_index=ignore, reduction=reduction, label_smoothing=0.1,
                        z_loss_weight=1e-3 if rows > 1 else 0.0)
                    loss.backward(torch.ones_like(loss) * 2)
                    with torch.no_grad():
                        vocab_parallel_cross_entropy(x, t.long(), ignore_index=ignore)


def run() -> None:
    _bias_act()
    _cross_entropy()
