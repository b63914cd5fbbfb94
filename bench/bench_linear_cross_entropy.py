"""Fused LM head + cross-entropy: ``mtp.ops.linear_cross_entropy`` (the logits never exist whole).

mtp backends: ``triton`` (cuBLAS GEMM per chunk + Triton loss kernels), ``fused`` (the forward's
GEMM in Triton with the row statistics in its epilogue, no logits written) and ``torch``.
Timed on one GPU, ``reduction="mean"``, ``validate=False``, no bias: ``N`` tokens, hidden
``H``, vocab ``V``. The issue's shapes: ``N=8192, H=4096`` with ``V`` = 128256 (Llama 3) and
151936 (Qwen 2), and the shard one rank of ``tp=8`` holds (``V/8``, timed at tp=1: the same
GEMMs and loss maths, without the all-gather of three fp32 per row). Compared with:

- ``unfused``: mtp's unfused pair, ``F.linear`` + :func:`mtp.ops.vocab_parallel_cross_entropy`
  (the whole ``[N, V]`` logits and their gradient live at once);
- ``reference``: ``F.linear`` + mtp's PyTorch cross-entropy (fp32 maths; the GPU check's
  reference);
- ``torch.compile`` of ``F.linear`` + ``F.cross_entropy(logits.float())``;
- Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` when installed.

GPU runs also time ``triton`` at other chunk sizes (:data:`CHUNK_VARIANTS`: ``N/4`` and
``N/16`` rows against the default ``N/8``): the fp32 ``d_weight`` GEMM-add reads and writes
``V x H x 8`` bytes per chunk, so larger chunks trade memory (their peak column) for time.

The goal: at least 1.2x faster than ``unfused`` at a tenth of its peak memory.

FLOPs: the op is GEMM-bound. Forward ``2*N*H*V`` (one GEMM); forward+backward ``6*N*H*V`` (the
forward GEMM and the two gradient GEMMs). mtp's fused loss does exactly these for the mean loss
timed here (the gradient GEMMs run chunk by chunk in the forward, the backward only scales);
one that recomputes the logits in the backward (``reduction="none"``) does ``8*N*H*V``.

Bytes (the floor of the unfused pair would be dominated by the logits; the fused op's is its
operands): read ``hidden`` and ``weight`` (and the targets), write the loss; backward also writes
``d_hidden`` and ``d_weight``.

Structure (CPU, :func:`structure`): per backend and reduction, the bytes the loss maths move
beyond the GEMMs (Triton launches and non-GEMM aten ops, counted by address under the
interpreter) over ``N*V*s`` (the logits' size), forward and backward; dtype casts apart (on CUDA the Triton
path's half-precision gradient GEMMs write fp32 directly, on CPU they cast). That peak memory does not grow with ``N``
is asserted in ``tests/test_ops_linear_cross_entropy.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mtp.ops as ops
from mtp.ops.cross_entropy import vocab_parallel_cross_entropy_reference

from .core import (
    FLOAT64,
    Case,
    Provider,
    Run,
    compiled,
    dtype_name,
    import_peer,
    needs_compile,
    peer_attr,
    randn,
    seeded,
    upcast,
)

FAMILY = "linear_cross_entropy"
OPS = ("linear_cross_entropy",)
BACKENDS = ("triton", "fused", "torch")
#: provider -> the divisor of ``N`` giving its chunk rows (``backend="triton"``; GPU only)
CHUNK_VARIANTS = {"triton-chunk/4": 4, "triton-chunk/16": 16}

_SHAPES = {  # (N, H, V, label suffix)
    "smoke": [(16, 8, 50, ""), (40, 16, 300, "")],
    "quick": [(8192, 4096, 128256, ""), (8192, 4096, 128256 // 8, " (tp=8 shard)")],
    "full": [
        (8192, 4096, 128256, ""), (8192, 4096, 128256 // 8, " (tp=8 shard)"),
        (8192, 4096, 151936, ""), (8192, 4096, 151936 // 8, " (tp=8 shard)"),
    ],
}  # fmt: skip


def linear_cross_entropy_flops(n: int, h: int, v: int, pass_: str) -> int:
    """GEMM FLOPs the loss needs (no recompute): ``2NHV`` forward, ``6NHV`` forward+backward."""
    return (2 if pass_ == "fwd" else 6) * n * h * v


def linear_cross_entropy_bytes(n: int, h: int, v: int, s: int, pass_: str) -> int:
    """Fewest bytes: the operands in (and targets), the loss out; backward the two gradients."""
    once = (n * h + v * h) * s + 8 * n + 4
    return once if pass_ == "fwd" else 2 * once


def _case(n, h, v, suffix, dtype, pass_) -> Case:
    s = torch.empty((), dtype=dtype).element_size()
    return Case("linear_cross_entropy", f"N={n} H={h} V={v}{suffix}", {"n": n, "h": h, "v": v},
                dtype, pass_, bytes=linear_cross_entropy_bytes(n, h, v, s, pass_),
                flops=linear_cross_entropy_flops(n, h, v, pass_))  # fmt: skip


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    return [_case(*shape, dtype, p) for shape in _SHAPES[size] for p in ("fwd", "fwd+bwd")]


def providers(op: str = "linear_cross_entropy") -> list[Provider]:
    return [
        Provider("triton", "mtp"),
        Provider("fused", "mtp"),
        Provider("torch", "mtp"),
        *(Provider(name, "mtp", cpu=False, note=f"chunk_size=N/{f}")
          for name, f in CHUNK_VARIANTS.items()),
        Provider("unfused", "baseline"),
        Provider("reference", "baseline"),
        Provider("torch.compile", "baseline", cpu=False, needs=needs_compile),
        Provider("liger", "peer", cpu=False,
                 needs=lambda d: import_peer("liger_kernel.transformers",
                                             "LigerFusedLinearCrossEntropyLoss")),
    ]  # fmt: skip


def pytorch_linear_cross_entropy(h, w, t):
    """Plain PyTorch: the logits in the input dtype, the loss in fp32."""
    return F.cross_entropy(F.linear(h, w).float(), t)


def _loss_fn(provider: str):
    """``f(hidden [N, H], weight [V, H], target [N]) -> scalar mean loss``."""
    if provider == FLOAT64:
        return lambda h, w, t: F.cross_entropy(F.linear(h, w), t)
    if provider == "torch.compile":
        return compiled(pytorch_linear_cross_entropy)
    if provider == "reference":
        return lambda h, w, t: vocab_parallel_cross_entropy_reference(
            F.linear(h, w), t, reduction="mean", validate=False
        )
    if provider == "unfused":
        return lambda h, w, t: ops.vocab_parallel_cross_entropy(
            F.linear(h, w), t, reduction="mean", validate=False
        )
    if provider in CHUNK_VARIANTS:
        f = CHUNK_VARIANTS[provider]
        return lambda h, w, t: ops.linear_cross_entropy(
            h, w, t, validate=False, backend="triton", chunk_size=max(1, h.shape[0] // f))
    if provider == "liger":
        loss = peer_attr("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss")()

        def liger(h, w, t):
            out = loss(w, h, t)
            return out[0] if isinstance(out, tuple) else out

        return liger
    return lambda h, w, t: ops.linear_cross_entropy(h, w, t, validate=False, backend=provider)


def setup_linear_cross_entropy(case: Case, provider: str, device: torch.device) -> Run:
    """Mean loss of ``hidden @ weight^T`` against random targets, forward or forward+backward
    (``d_hidden`` and ``d_weight`` through ``torch.autograd.grad``)."""
    n, h, v = case.params["n"], case.params["h"], case.params["v"]
    gen = seeded(case, device)
    grad = case.pass_ != "fwd"
    hidden = randn((n, h), case.dtype, device, gen).requires_grad_(grad)
    weight = randn((v, h), case.dtype, device, gen, h**-0.5).requires_grad_(grad)
    target = torch.randint(0, v, (n,), generator=gen, device=device)
    hidden, weight = upcast(hidden, provider), upcast(weight, provider)
    f = _loss_fn(provider)
    if not grad:
        return Run(lambda: (f(hidden, weight, target),), inputs=[hidden, weight, target])

    def fwd_bwd():
        loss = f(hidden, weight, target)
        return (loss, *torch.autograd.grad(loss, (hidden, weight)))

    return Run(fwd_bwd, inputs=[hidden, weight, target])


SETUP = {"linear_cross_entropy": setup_linear_cross_entropy}


# --------------------------------------------------------------------------------------------
# Structure: bytes of the loss maths beyond the GEMMs, and memory that does not grow with N
# --------------------------------------------------------------------------------------------

_GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")
# dtype casts: on CUDA the Triton path's half-precision GEMMs write fp32 themselves (out_dtype);
# CPU has no such GEMM, so its casts are counted apart
_CASTS = ("aten::_to_copy",)


def _loss_maths_bytes(backend: str, n: int, h: int, v: int, chunk: int, dtype,
                      reduction: str) -> dict:
    from mtp.testing.traffic import count_traffic

    gen = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * h**-0.5).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    with count_traffic() as fwd:
        loss = ops.linear_cross_entropy(hidden, weight, target, chunk_size=chunk,
                                        label_smoothing=0.1, backend=backend,
                                        reduction=reduction)  # fmt: skip
    with count_traffic() as bwd:
        loss.sum().backward()
    logits = n * v * torch.empty((), dtype=dtype).element_size()
    out = {"backend": backend, "reduction": reduction, "N": n, "H": h, "V": v, "chunk": chunk,
           "dtype": dtype_name(dtype)}  # fmt: skip
    for name, t in (("fwd", fwd), ("bwd", bwd)):
        maths = sum(x.bytes_program for x in t.launches)
        maths += sum(a.read + a.write for a in t.aten if a.name not in _GEMMS + _CASTS)
        casts = sum(a.read + a.write for a in t.aten if a.name in _CASTS)
        out[f"{name}_loss_bytes_over_logits"] = round(maths / logits, 3)
        out[f"{name}_cast_bytes_over_logits"] = round(casts / logits, 3)
        out[f"{name}_triton_launches"] = t.num_launches
        out[f"{name}_host_syncs"] = t.num_host_syncs
    return out


def structure(size: str) -> dict:
    """Loss-maths bytes per backend (fp32 and bf16 at ``N=256, H=32, V=2048``, 64-row chunks),
    for the mean loss (gradients in the forward) and ``reduction="none"`` (recomputed)."""
    rows = [
        _loss_maths_bytes(backend, 256, 32, 2048, 64, dtype, reduction)
        for reduction in ("mean", "none")
        for dtype in (torch.float32, torch.bfloat16)
        for backend in ("triton", "torch")  # "fused" has no logits to compare with
    ]
    return {"linear_cross_entropy_loss_bytes": rows}
