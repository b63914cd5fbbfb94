"""Grouped GEMM for MoE experts: ``mtp.ops.grouped_gemm`` on the MoE shapes that matter.

Every backend of the op (``triton``, ``cutlass`` when built, ``torch`` =
``F.grouped_mm``, ``multistream``, ``sequential``, ``reference``) on

- Mixtral-like: E=8, top-2, H=4096, F=14336 (few large groups; fc1 is K=4096, N=14336);
- DeepSeek-like (V3): E=256, top-8, H=7168, F=2048 (many small groups; K=7168, N=2048);
- Qwen3-30B-A3B: E=128, top-8, H=2048, F=768 (K=2048, N=768: small GEMMs, launch-bound);
- OLMoE-like: E=64, top-8, H=2048, F=1024 (E >= 64, where one launch must beat multi-stream);

each with balanced routing (equal rows per expert) and, in the full run, skewed routing
(Zipf-like: rows per expert proportional to ``1 / (rank + 1) ** 1.2`` over a shuffled expert
order, some experts empty), forward and forward+backward. The quick run (a lent GPU's 15
minutes) keeps the balanced routing and orders the models by what their figures decide: the
Qwen3 and DeepSeek shapes (the fraction-of-peak goals), the E=64 shape (against multi-stream),
then Mixtral. ``fc1`` is ``[M, H] x [E, H, F]``; the full run adds
``fc2`` (``[M, F] x [E, F, H]``).

``torch`` is mtp's backend on PyTorch's grouped GEMM (it stores exact zeros in the tail rows and
empty groups, :mod:`mtp.kernels.grouped_gemm_details.fill`); ``F.grouped_mm`` is the raw PyTorch
call on the same operands (no zeroing, offsets computed in the call), the peer the goals name.

The counts live on the GPU, as in an MoE layer: the loop
backends (``sequential``, ``multistream``, ``reference``) copy them to the host once per call
(one sync), the single-launch backends read them on the device. Calls use ``validate=False``,
as :class:`mtp.moe.GroupedMLP` does.

On sm_90+ the ``triton`` backend takes the TMA kernels
(:mod:`mtp.kernels.grouped_gemm_details.tma`); the ``triton-ptr`` provider (GPU only) times the
pointer kernels on the same case (inside :func:`mtp.ops.grouped_gemm.config.override` with
``kernel="pointer"``, forward and backward), to compare the two paths and tune the TMA config
table.

Peers when installed: Transformer Engine's ``GroupedLinear`` (multi-stream cuBLAS, host
``m_splits``) and the ``grouped_gemm`` package's ``gmm`` (CUTLASS, host batch sizes; the one
Megatron-Core's legacy ``GroupedMLP`` uses). They receive host sizes through a device-to-host
copy inside the timed call, as the loop backends do. ``torch.compile`` of the reference is not
timed: the per-expert loop reads the sizes on the host, so it compiles to one graph per expert
(the ``torch`` backend is PyTorch's own grouped GEMM).

FP8 (:mod:`mtp.bench.fp8_providers`): ``triton-fp8`` / ``triton-mxfp8`` (the op's
``fp8_recipe``) and the FP8 peers (``torch._scaled_grouped_mm``, Transformer Engine's
``GroupedLinear`` in FP8, DeepGEMM) on the same cases, checked with the recipes' tolerance and
their floor at the FP8 rate.

FLOPs (``M`` routed rows): forward ``2*M*K*N``; forward+backward adds the data gradient
(``2*M*K*N``) and the weight gradient (``2*M*K*N``): ``6*M*K*N``.
Bytes (``s`` = element size; each GEMM reads its operands once and writes its result once):
forward ``M*K*s + E*K*N*s + M*N*s + 8*E``; the backward adds
``M*N*s + E*K*N*s + M*K*s`` (data gradient) and ``M*K*s + M*N*s + E*K*N*s`` (weight gradient).
"""

from __future__ import annotations

import torch

from mtp.ops.grouped_gemm import (
    GROUPED_GEMM_BACKENDS,
    grouped_gemm,
    grouped_gemm_reference,
    torch_grouped_mm,
)
from mtp.ops.grouped_gemm.config import override

from . import fp8_providers as fp8
from .core import (FLOAT64, Case, Provider, Run, Skip, import_peer, needs_cuda, peer_attr, randn,
                   seeded)  # fmt: skip

FAMILY = "grouped_gemm"
OPS = ("grouped_gemm",)
BACKENDS = tuple(GROUPED_GEMM_BACKENDS)

#: name -> (E, k, H, F), in the order the quick run takes them (most decisive first)
MODELS = {
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "DeepSeek-like": (256, 8, 7168, 2048),
    "OLMoE-like": (64, 8, 2048, 1024),
    "Mixtral-like": (8, 2, 4096, 14336),
}
#: size -> routings timed
_SKEWS = {"quick": ("balanced",), "full": ("balanced", "skewed")}
#: The raw PyTorch grouped GEMM provider (``torch.nn.functional.grouped_mm``).
RAW_TORCH = "F.grouped_mm"

#: size -> (tokens per model, gemms); smoke sizes are below.
_GPU_SIZES = {"quick": (4096, ("fc1",)), "full": (8192, ("fc1", "fc2"))}

#: CPU: checked through the interpreter at tiny sizes, then structure-only (launches recorded,
#: kernels not executed) at the real expert counts. (name, E, k, T, K, N, check)
_SMOKE = [
    ("Mixtral-like", 8, 2, 24, 40, 24, True),
    ("tiny-E16", 16, 4, 12, 24, 40, True),
    ("Mixtral-like", 8, 2, 64, 16, 16, False),
    ("Qwen3-30B-A3B", 128, 8, 64, 16, 16, False),
    ("DeepSeek-like", 256, 8, 64, 16, 16, False),
]

SKEW_EXPONENT = 1.2


def expert_counts(M: int, E: int, skew: str, seed: int = 0) -> list[int]:
    """Rows per expert summing to ``M``: ``"balanced"`` (equal, the remainder on the first
    experts) or ``"skewed"`` (Zipf-like, :data:`SKEW_EXPONENT`, over a seeded shuffle)."""
    if skew == "balanced":
        return [M // E + (1 if e < M % E else 0) for e in range(E)]
    if skew != "skewed":
        raise ValueError(f"skew must be 'balanced' or 'skewed', got {skew!r}")
    weights = [1.0 / (r + 1) ** SKEW_EXPONENT for r in range(E)]
    total = sum(weights)
    counts = [int(M * w / total) for w in weights]
    counts[0] += M - sum(counts)
    order = torch.randperm(E, generator=torch.Generator().manual_seed(seed)).tolist()
    return [counts[order[e]] for e in range(E)]


def grouped_gemm_flops(M: int, K: int, N: int, pass_: str) -> int:
    """FLOPs of the grouped GEMM of ``M`` routed rows (``[M, K] x [K, N]`` per expert)."""
    return 2 * M * K * N * (1 if pass_ == "fwd" else 3)


def grouped_gemm_bytes(M: int, K: int, N: int, E: int, s: int, pass_: str) -> int:
    """Fewest HBM bytes (each GEMM's operands read once, result written once)."""
    fwd = M * K * s + E * K * N * s + M * N * s + 8 * E
    if pass_ == "fwd":
        return fwd
    dgrad = M * N * s + E * K * N * s + M * K * s
    wgrad = M * K * s + M * N * s + E * K * N * s
    return fwd + dgrad + wgrad


def _case(name, E, k, T, K, N, gemm, skew, dtype, pass_, check=True, execute=True) -> Case:
    s = torch.empty((), dtype=dtype).element_size()
    M = T * k
    params = {"model": name, "E": E, "k": k, "T": T, "M": M, "K": K, "N": N, "gemm": gemm,
              "skew": skew}  # fmt: skip
    return Case(
        "grouped_gemm", f"{name} {gemm} {skew} E={E} M={M} K={K} N={N}", params, dtype, pass_,
        bytes=grouped_gemm_bytes(M, K, N, E, s, pass_), flops=grouped_gemm_flops(M, K, N, pass_),
        group=f"{name} {skew}", check=check, execute=execute,
    )  # fmt: skip


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    out = []
    if size == "smoke":
        for name, E, k, T, K, N, check in _SMOKE:
            skews = ("skewed",) if name.startswith("tiny") else ("balanced", "skewed")
            for skew in skews:
                for pass_ in ("fwd", "fwd+bwd") if check else ("fwd",):
                    out.append(_case(name, E, k, T, K, N, "fc1", skew, dtype, pass_, check, check))
        return out
    tokens, gemms = _GPU_SIZES[size]
    for name, (E, k, H, F) in MODELS.items():
        for gemm in gemms:
            K, N = (H, F) if gemm == "fc1" else (F, H)
            for skew in _SKEWS[size]:
                for pass_ in ("fwd", "fwd+bwd"):
                    out.append(_case(name, E, k, tokens, K, N, gemm, skew, dtype, pass_))
    return out


def backend_ready(name: str):
    def needs(device: torch.device) -> str | None:
        check = GROUPED_GEMM_BACKENDS[name].check
        if name == "cutlass" and device.type != "cuda":
            return "needs a CUDA GPU and the CUTLASS extension"
        if check is not None:
            try:
                probe = dict(dtype=torch.bfloat16, device=device)
                check(torch.empty(0, 1, **probe), torch.empty(1, 1, 1, **probe))
            except (TypeError, ValueError) as exc:
                return str(exc).split(". ")[0]
        return None

    return needs


def providers(op: str = "grouped_gemm") -> list[Provider]:
    out = []
    for name in BACKENDS:
        kind = "baseline" if name == "reference" else "mtp"
        out.append(Provider(name, kind, cpu=name != "cutlass", needs=backend_ready(name)))
    out += [
        Provider("triton-ptr", "mtp", cpu=False,
                 needs=lambda d: needs_cuda(d) or backend_ready("triton")(d)),
        Provider(RAW_TORCH, "baseline", cpu=False,
                 needs=lambda d: needs_cuda(d) or backend_ready("torch")(d)),
        Provider("torch.compile", "baseline", cpu=False,
                 needs=lambda d: "not timed: the reference's per-expert loop reads the sizes on "
                                 "the host (see the 'torch' backend for PyTorch's grouped GEMM)"),
        Provider("te", "peer", cpu=False,
                 needs=lambda d: needs_cuda(d)
                 or import_peer("transformer_engine.pytorch", "GroupedLinear")),
        Provider("grouped_gemm_pkg", "peer", cpu=False,
                 needs=lambda d: needs_cuda(d) or import_peer("grouped_gemm", "ops.gmm")),
    ]  # fmt: skip
    return out + fp8.mtp_providers(backend_ready("triton")) + fp8.peers()


def _te_layer(w: torch.Tensor):
    """A Transformer Engine ``GroupedLinear`` holding ``w [E, K, N]`` (its weights are
    ``[N, K]`` per expert)."""
    te = peer_attr("transformer_engine.pytorch", "GroupedLinear")
    E, K, N = w.shape
    layer = te(E, K, N, bias=False, params_dtype=w.dtype, device=w.device)
    with torch.no_grad():
        for e in range(E):
            getattr(layer, f"weight{e}").copy_(w[e].t())
    return layer


def _tma_off(fn):
    """``fn`` on the pointer kernels (the grouped GEMM config's scoped override), forward and
    backward."""

    def call():
        with override(kernel="pointer"):
            return fn()

    return call


def _provider_fn(provider: str, w: torch.Tensor, sizes: list[int] | None = None):
    """``(f(x, counts) -> y, the weight tensors to differentiate)`` (``sizes``: the counts on
    the host, for the peers that need them at setup)."""
    if provider == FLOAT64:
        return (lambda x, c: grouped_gemm_reference(x, w, c)), [w]
    if provider == "te":
        layer = _te_layer(w.detach())
        params = [getattr(layer, f"weight{e}") for e in range(w.shape[0])]
        return (lambda x, c: layer(x, c.tolist())), params
    if provider == RAW_TORCH:
        mm = torch_grouped_mm()

        def raw(x, c):
            return mm(x, w, offs=torch.cumsum(c, 0, dtype=torch.int32))

        return raw, [w]
    if provider == "grouped_gemm_pkg":
        gmm = peer_attr("grouped_gemm", "ops.gmm")
        return (lambda x, c: gmm(x, w, c.cpu(), trans_b=False)), [w]
    if provider in fp8.MTP_FP8:
        recipe = fp8.MTP_FP8[provider]
        return (lambda x, c: grouped_gemm(x, w, c, backend="triton", validate=False,
                                          fp8_recipe=recipe)), [w]  # fmt: skip
    if provider not in GROUPED_GEMM_BACKENDS and provider != "triton-ptr":
        return fp8.peer_fn(provider, w, _te_layer, sizes)
    backend = "triton" if provider == "triton-ptr" else provider
    return (lambda x, c: grouped_gemm(x, w, c, backend=backend, validate=False)), [w]


def setup_grouped_gemm(case: Case, provider: str, device: torch.device) -> Run:
    """``y = grouped_gemm(x [M, K], w [E, K, N], counts)``: forward, or forward+backward
    (data and weight gradients)."""
    p = case.params
    E, M, K, N = p["E"], p["M"], p["K"], p["N"]
    dtype = torch.float64 if provider == FLOAT64 else case.dtype
    grad = case.pass_ != "fwd"
    gen = seeded(case, device)
    x = randn((M, K), case.dtype, device, gen).to(dtype).requires_grad_(grad)
    w = randn((E, K, N), case.dtype, device, gen, K**-0.5).to(dtype).requires_grad_(grad)
    dy = randn((M, N), case.dtype, device, gen).to(dtype)
    sizes = expert_counts(M, E, p["skew"])
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    f, weights = _provider_fn(provider, w, sizes)
    if grad and weights is None:
        raise Skip(f"{provider} has no backward: timed for the forward only")
    if not grad:
        fwd = (lambda: (f(x, counts),))
        return Run(_tma_off(fwd) if provider == "triton-ptr" else fwd, inputs=[x, w, counts])

    def fwd_bwd():
        y = f(x, counts)
        dx, *dw = torch.autograd.grad(y, [x, *weights], dy)
        if len(dw) > 1:  # per-expert weights (Transformer Engine): [E, N, K] -> [E, K, N]
            dw = [torch.stack(dw).transpose(1, 2)]
        return (y, dx, *dw)

    return Run(_tma_off(fwd_bwd) if provider == "triton-ptr" else fwd_bwd,
               inputs=[x, w, counts, dy])


SETUP = {"grouped_gemm": setup_grouped_gemm}
