"""Shared pieces of the mtp.optim tests: a tiny model, its data, and plain single-process
PyTorch references (nothing of mtp.optim is used to compute expected values)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IN, HID, OUT, ROWS = 8, 16, 4, 12
# Reverse parameter order: head.bias 4, head.weight 32, fc2.bias 8, fc2.weight 128, fc1.bias 16,
# fc1.weight 128: with bucket_size=40 the buckets hold 44, 128 and 144 elements (no padding at
# d = 1, 2, 4), so the measured bytes per parameter equal the formula exactly.
BUCKET = 40
TP_PLAN = {"fc1": "column", "fc2": "row"}


class Net(nn.Module):
    """``head(gelu(fc2(gelu(fc1(x)))))``; ``tie=True`` uses ``head.weight`` a second time in
    the same forward (a shared parameter); ``unused=True`` adds a parameter no forward uses."""

    def __init__(self, dtype=torch.float32, tie=False, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID, dtype=dtype)
        self.fc2 = nn.Linear(HID, IN, dtype=dtype)
        self.head = nn.Linear(IN, OUT, dtype=dtype)
        self.tie = tie
        if unused:
            self.unused = nn.Parameter(torch.ones(3, dtype=dtype))

    def forward(self, x):
        h = F.gelu(self.fc2(F.gelu(self.fc1(x))))
        out = self.head(h)
        if self.tie:
            out = out + 0.5 * F.linear(h, self.head.weight)
        return out


def make_net(seed=0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def batch(step: int, rows: int = ROWS, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, IN, generator=g)
    y = torch.randn(rows, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def local_rows(x, rank, world):
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def loss_fn(out, y):
    return F.mse_loss(out.float(), y.float())


def reference_train(model, opt, steps, *, start=0, micro=1, clip=None, master=None):
    """Single-process training on the global batches ``start..start+steps-1``.

    ``micro``: split each global batch in that many micro-batches (loss / micro).
    ``clip``: ``torch.nn.utils.clip_grad_norm_`` max norm; returns the norms.
    ``master``: fp32 master copies of a low-precision ``model`` (what ``opt`` updates): grads
    are cast to fp32, the step runs on the masters, and the model gets them back rounded.
    """
    norms = []
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(start, start + steps):
        x, y = batch(step)
        for p in model.parameters():
            p.grad = None
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model(xm.to(params[0].dtype)), ym) / micro).backward()
        if master is not None:
            for p, m in zip(params, master):
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            grads_of = master
        else:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads_of = params
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(grads_of, clip))
        opt.step()
        if master is not None:
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
    return norms
