"""Per-chunk maths of :func:`mtp.ops.linear_cross_entropy` in plain PyTorch.

The ``"torch"`` backend's row statistics (:func:`chunk_stats`) and gradient
(:func:`chunk_grad`), and what every backend shares: the logits GEMM of a chunk
(:func:`chunk_logits`), the merge of statistics computed over column shares (:func:`merge_stats`,
:func:`combine`), the gradient GEMMs with an fp32 result (:func:`mm_into`,
:func:`add_weight_grad`) and the backward's scaling of the gradients (:func:`scaled`).
Accumulation in fp32, or fp64 for fp64 inputs.
"""

from __future__ import annotations

import torch

__all__ = [
    "accumulation_dtype",
    "add_weight_grad",
    "chunk_grad",
    "chunk_logits",
    "chunk_stats",
    "combine",
    "merge_stats",
    "mm_into",
    "scaled",
]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_logits(out: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``out = h @ weight_t (+ bias)``: the ``[rows, V/tp]`` logits in the input dtype, written
    into the chunk buffer ``out``; the bias is added in the GEMM's epilogue."""
    if bias is None:
        return torch.mm(h, weight_t, out=out)
    return torch.addmm(bias, h, weight_t, out=out)


def chunk_stats(x, local_t, owns, coef_target, coef_uniform) -> torch.Tensor:
    """``[rows, 3]`` fp32 ``(max, sum exp(x - max), (1-eps) x_t + eps/V sum x)`` of a shard."""
    x = x.to(accumulation_dtype(x.dtype))
    m = x.amax(-1)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.exp(x - m_ref[:, None]).sum(-1)
    x_t = torch.where(owns, x.gather(1, local_t[:, None])[:, 0], torch.zeros_like(m))
    c = coef_target * x_t + coef_uniform * x.sum(-1)
    return torch.stack([m, s, c], dim=-1)


def merge_stats(parts: torch.Tensor) -> torch.Tensor:
    """``[rows, 3]`` statistics of whole rows from ``[k, rows, 3]`` ones of ``k`` column shares
    (the ranks' vocab shards, or the fused GEMM's vocab splits)."""
    if parts.shape[0] == 1:
        return parts[0]
    m_all, s_all, c_all = parts.unbind(-1)
    m = m_all.amax(0)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return torch.stack([m, (s_all * torch.exp(m_all - m_ref)).sum(0), c_all.sum(0)], dim=-1)


def combine(gathered, valid, z_loss_weight):
    """``(loss [rows], rowstat [rows, 2])`` from every rank's ``[world, rows, 3]`` statistics."""
    m, s, c = merge_stats(gathered).unbind(-1)
    log_s = torch.log(s)
    lse = m + log_s
    loss = (m - c) + log_s + z_loss_weight * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss)), torch.stack([m, s], dim=-1)


def chunk_grad(x, rowstat, local_t, owns, scale, coef_target, coef_uniform, z):
    """``scale[row] * d loss / d logits`` of a chunk, fp32 ``[rows, V/tp]`` (``scale``: the
    rows' upstream gradient, 0 for ignored rows); the softmax as PyTorch computes it,
    ``exp(x - m) * (1 / s)`` (not ``exp(x - lse)``, whose rounded ``lse`` costs precision at
    large logits)."""
    m, s = rowstat.unbind(-1)
    lse = m + torch.log(s)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(x.to(accumulation_dtype(x.dtype)) - m_ref[:, None]) * (1.0 / s)[:, None]
    g = p * (1.0 + 2.0 * z * lse)[:, None] - coef_uniform
    hit = torch.where(owns, -coef_target, torch.zeros_like(lse))
    g.scatter_add_(1, local_t[:, None], hit[:, None].to(g.dtype))
    return g * scale.to(g.dtype)[:, None]


_HALF = (torch.float16, torch.bfloat16)
#: whether cuBLAS's fp32-output GEMMs on half inputs work here (``out_dtype=float32``, CUDA):
#: ``"mm"`` / ``"addmm"`` -> bool, learnt at the first call
_FUSED: dict[str, bool] = {}


def _fused(op: str, out: torch.Tensor, a: torch.Tensor) -> bool:
    return out.is_cuda and a.dtype in _HALF and out.dtype == torch.float32 and _FUSED.get(op, True)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, ``out`` in ``a``'s dtype or its accumulation dtype (fp32 accumulation;
    on CUDA the half-precision GEMM writes fp32 itself)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
        return
    if _fused("mm", out, a):
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            _FUSED["mm"] = True
            return
        except (RuntimeError, TypeError):
            _FUSED["mm"] = False
    torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def add_weight_grad(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``dw += g^T h`` with fp32 accumulation (``dw`` fp32; ``g``, ``h`` in the input dtype)."""
    if _fused("addmm", dw, g):
        try:  # cuBLAS: half inputs, fp32 C read and written in the epilogue
            torch.addmm(dw, g.t(), h, out_dtype=torch.float32, out=dw)
            _FUSED["addmm"] = True
            return
        except (RuntimeError, TypeError):
            _FUSED["addmm"] = False
    if dw.dtype == g.dtype:
        dw.addmm_(g.t(), h)
    elif dw.is_cuda and g.dtype in _HALF:
        dw.add_(torch.mm(g.t(), h, out_dtype=torch.float32))
    else:
        dw.addmm_(g.t().to(dw.dtype), h.to(dw.dtype))


def scaled(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc * scale`` in ``dtype``, rounded once: in place when ``acc`` has that dtype (its
    version is bumped: a second backward through the same graph fails autograd's check)."""
    if acc.dtype == dtype:
        return acc.mul_(scale)
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    return torch.mul(acc, scale, out=out)
