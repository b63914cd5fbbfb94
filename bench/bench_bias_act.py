"""Fused bias + activation: ``mtp.ops.bias_gelu`` (tanh GeLU, the one Megatron fuses) and
``mtp.ops.bias_swiglu``.

Compared with: mtp's backends (``triton``, ``reference``), ``torch.compile`` of the reference,
Megatron-Core's ``bias_gelu_impl`` / ``bias_swiglu_impl`` and Liger-Kernel's
``LigerSiLUMulFunction`` when they are installed. Liger's SwiGLU has no bias and takes gate and
up as two tensors: it is timed on ``silu(a) * g`` with ``a``, ``g`` the two halves of ``x + bias``
made contiguous outside the timed call (no bias add, no bias gradient: less work than the
others; its records say so), and checked after its ``da``, ``dg`` are joined into ``dx`` and
summed into ``dbias``.

Bytes (``s`` = element size of ``x``, ``sb`` of the bias, ``M`` rows; see the op docstrings):

==================  ===========================  =============================
op                  forward                      backward (dx and dbias)
==================  ===========================  =============================
bias_gelu  [M, H]   read x, bias; write y:       read dy, x, bias; write dx,
                    ``2*M*H*s + H*sb``           dbias: ``3*M*H*s + 2*H*sb``
bias_swiglu [M,2H]  read x [M,2H], bias [2H];    read dy [M,H], x, bias; write
                    write y [M,H]:               dx [M,2H], dbias [2H]:
                    ``3*M*H*s + 2*H*sb``         ``5*M*H*s + 4*H*sb``
==================  ===========================  =============================

The fp32 partial sums of the two-stage ``dbias`` reduction (at most ~4 MiB) are left out: the
floor counts only what must cross HBM.
"""

from __future__ import annotations

import torch

import mtp.ops as ops
from mtp.ops.bias_act import bias_gelu_reference, bias_swiglu_reference

from .core import (
    FLOAT64,
    Case,
    Provider,
    Run,
    compiled,
    import_peer,
    needs_compile,
    peer_attr,
    randn,
    seeded,
    upcast,
)

FAMILY = "bias_act"
OPS = ("bias_gelu", "bias_swiglu")
BACKENDS = ("triton", "reference")

_MEGATRON = "megatron.core.fusions"
LIGER_NOTE = "no bias (Liger's SwiGLU has none); gate/up pre-split, contiguous"

_SHAPES = {  # (M rows, H output width)
    "smoke": {"bias_gelu": [(7, 40), (33, 130)], "bias_swiglu": [(7, 24), (33, 96)]},
    "quick": {"bias_gelu": [(8192, 16384)], "bias_swiglu": [(8192, 14336)]},
    "full": {
        "bias_gelu": [(4096, 11008), (8192, 16384), (16384, 16384)],
        "bias_swiglu": [(4096, 11008), (8192, 14336), (16384, 14336)],
    },
}


# --------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------


def bias_gelu_bytes(M: int, H: int, s: int, sb: int, pass_: str) -> int:
    """Fewest HBM bytes of ``bias_gelu`` on ``x [M, H]`` (see the module table)."""
    fwd = 2 * M * H * s + H * sb
    bwd = 3 * M * H * s + 2 * H * sb
    return fwd if pass_ == "fwd" else fwd + bwd


def bias_swiglu_bytes(M: int, H: int, s: int, sb: int, pass_: str) -> int:
    """Fewest HBM bytes of ``bias_swiglu`` on ``x [M, 2H]`` -> ``y [M, H]``."""
    fwd = 3 * M * H * s + 2 * H * sb
    bwd = 5 * M * H * s + 4 * H * sb
    return fwd if pass_ == "fwd" else fwd + bwd


# --------------------------------------------------------------------------------------------
# Cases and providers
# --------------------------------------------------------------------------------------------


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    s = torch.empty((), dtype=dtype).element_size()
    out = []
    for op, formula in (("bias_gelu", bias_gelu_bytes), ("bias_swiglu", bias_swiglu_bytes)):
        for M, H in _SHAPES[size][op]:
            width = H if op == "bias_gelu" else 2 * H
            for pass_ in ("fwd", "fwd+bwd"):
                out.append(Case(
                    op, f"M={M} H={width}", {"M": M, "H": H}, dtype, pass_,
                    bytes=formula(M, H, s, s, pass_),
                ))  # fmt: skip
    return out


def traffic_cases(dtype: torch.dtype) -> list[Case]:
    """Mid-size shapes for the CPU bytes / floor figures (512 x 1024)."""
    s = torch.empty((), dtype=dtype).element_size()
    out = []
    for op, formula, width in (("bias_gelu", bias_gelu_bytes, 1024),
                               ("bias_swiglu", bias_swiglu_bytes, 2048)):
        for pass_ in ("fwd", "fwd+bwd"):
            out.append(Case(op, f"M=512 H={width}", {"M": 512, "H": 1024}, dtype, pass_,
                            bytes=formula(512, 1024, s, s, pass_)))
    return out  # fmt: skip


def providers(op: str) -> list[Provider]:
    megatron = "fused_bias_gelu" if op == "bias_gelu" else "fused_bias_swiglu"
    impl = "bias_gelu_impl" if op == "bias_gelu" else "bias_swiglu_impl"
    found = [
        Provider("triton", "mtp"),
        Provider("reference", "baseline"),
        Provider("torch.compile", "baseline", cpu=False, needs=needs_compile),
        Provider(
            "megatron", "peer", cpu=False,
            needs=lambda d: import_peer(f"{_MEGATRON}.{megatron}", impl),
        ),  # fmt: skip
    ]
    if op == "bias_swiglu":
        found.append(Provider(
            "liger", "peer", cpu=False,
            needs=lambda d: import_peer("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
            note=LIGER_NOTE,
        ))  # fmt: skip
    return found


# --------------------------------------------------------------------------------------------
# Setup factories
# --------------------------------------------------------------------------------------------


def _inputs(case: Case, device: torch.device, provider: str):
    M, H = case.params["M"], case.params["H"]
    width = H if case.op == "bias_gelu" else 2 * H
    gen = seeded(case, device)
    x = randn((M, width), case.dtype, device, gen).requires_grad_(case.pass_ != "fwd")
    bias = randn((width,), case.dtype, device, gen, 0.5).requires_grad_(case.pass_ != "fwd")
    dy = randn((M, H), case.dtype, device, gen)
    return upcast(x, provider), upcast(bias, provider), upcast(dy, provider)


def gelu_tanh_reference(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain-PyTorch reference of the benched GeLU (tanh approximation, as Megatron's)."""
    return bias_gelu_reference(x, bias, approximate="tanh")


def _forward_fn(op: str, provider: str):
    """``f(x, bias) -> y`` for one provider."""
    reference = gelu_tanh_reference if op == "bias_gelu" else bias_swiglu_reference
    if provider in (FLOAT64, "reference"):
        return reference
    if provider == "torch.compile":
        return compiled(reference)
    if provider == "megatron":
        gelu = op == "bias_gelu"
        module = f"{_MEGATRON}.fused_bias_gelu" if gelu else f"{_MEGATRON}.fused_bias_swiglu"
        impl = peer_attr(module, "bias_gelu_impl" if gelu else "bias_swiglu_impl")
        return lambda x, b: impl(x, b)
    if op == "bias_gelu":
        return lambda x, b: ops.bias_gelu(x, b, approximate="tanh", backend=provider)
    return lambda x, b: ops.bias_swiglu(x, b, backend=provider)


def _liger_run(case: Case, device: torch.device) -> Run:
    """Liger's ``silu(a) * g`` on the two halves of ``x + bias``, prepared outside the call."""
    silu_mul = peer_attr("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
    x, bias, dy = _inputs(case, device, "liger")
    grad = case.pass_ != "fwd"
    with torch.no_grad():
        a, g = (h.contiguous().requires_grad_(grad) for h in torch.chunk(x + bias, 2, dim=-1))
    if not grad:
        return Run(lambda: (silu_mul.apply(a, g),), inputs=[a, g])

    def fwd_bwd():
        y = silu_mul.apply(a, g)
        return (y, *torch.autograd.grad(y, (a, g), dy))

    def as_reference(out):  # (y, da, dg) -> (y, dx, dbias), the reference's outputs
        y, da, dg = out
        dx = torch.cat([da, dg], dim=-1)
        return (y, dx, dx.float().sum(0).to(dx.dtype))

    return Run(fwd_bwd, inputs=[a, g, dy], for_check=as_reference)


def _run(case: Case, provider: str, device: torch.device) -> Run:
    if provider == "liger":
        return _liger_run(case, device)
    x, bias, dy = _inputs(case, device, provider)
    f = _forward_fn(case.op, provider)
    if case.pass_ == "fwd":
        return Run(lambda: (f(x, bias),), inputs=[x, bias])

    def fwd_bwd():
        y = f(x, bias)
        return (y, *torch.autograd.grad(y, (x, bias), dy))

    return Run(fwd_bwd, inputs=[x, bias, dy])


def setup_bias_gelu(case: Case, provider: str, device: torch.device) -> Run:
    """``gelu(x + bias)`` (tanh approximation), forward or forward+backward, for ``provider``."""
    return _run(case, provider, device)


def setup_bias_swiglu(case: Case, provider: str, device: torch.device) -> Run:
    """``silu(a) * g`` of ``x + bias``, forward or forward+backward, for ``provider``."""
    return _run(case, provider, device)


SETUP = {"bias_gelu": setup_bias_gelu, "bias_swiglu": setup_bias_swiglu}
