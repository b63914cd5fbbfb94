"""Plain-PyTorch reference of :mod:`mtp.ops.cross_entropy` (fp32 copies of the shard are fine
here): the same row statistics, metadata rows and collective as the kernels, used by the
``backend="reference"`` path that tests and benches compare with."""

from __future__ import annotations

import torch

__all__ = ["reference_forward"]


def _coefs(label_smoothing: float, vocab_size: int) -> tuple[float, float]:
    return 1.0 - label_smoothing, label_smoothing / vocab_size


def _target_meta(t, ignore_index, vocab_size, v_local) -> torch.Tensor:
    """int32 ``[2, 3]``: ``(shard size, valid count, checksum), (in range, rows, 0)``."""
    valid = t != ignore_index
    in_range = ~(valid & ((t < 0) | (t >= vocab_size))).any()
    i = torch.arange(t.numel(), device=t.device)
    checksum = ((t + 1) * (2 * i + 1)).sum()
    folded = ((checksum ^ (checksum >> 32)) & 0xFFFFFFFF).to(torch.int64)
    folded = torch.where(folded >= 2**31, folded - 2**32, folded)
    row0 = torch.stack([torch.tensor(v_local, device=t.device), valid.sum(), folded])
    zero = torch.zeros((), dtype=torch.int64, device=t.device)
    row1 = torch.stack([in_range.long(), zero + t.numel(), zero])
    return torch.stack([row0, row1]).to(torch.int32)


def _info(meta: torch.Tensor, rank: int) -> torch.Tensor:
    """int32 ``[world + 1, 4]`` from the gathered metadata ``[world, 2, 3]``."""
    size, n_valid, checksum = meta[:, 0].unbind(-1)
    in_range = meta[:, 1, 0]
    bad = (size != size[rank]) | (checksum != checksum[rank]) | (in_range == 0)
    ok = (~bad.any()).to(torch.int32)
    rows = torch.stack([size, n_valid, checksum, in_range], dim=-1)
    last = torch.stack([ok, ok * 0, ok * 0, ok * 0])[None]
    return torch.cat([rows, last]).to(torch.int32)


def reference_forward(
    logits, target, eps, ignore_index, z, vocab_start, vocab_size, group_name, rank,
    reduction, compute_grad, all_gather,
):  # fmt: skip
    """``(loss, grad or None, info)`` in plain PyTorch (same statistics and collective;
    ``all_gather(stats, group_name)`` returns ``[world, rows + 2, 3]``)."""
    v_local = logits.shape[-1]
    x = logits.reshape(-1, v_local).float()
    t = target.reshape(-1).long()
    m = x.amax(-1) if x.shape[0] else x.new_zeros(0)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    s = torch.exp(x - m_ref[:, None]).sum(-1)
    local = t - vocab_start
    owns = (local >= 0) & (local < v_local)
    local = local.clamp(0, v_local - 1)
    x_t = torch.where(owns, x.gather(1, local[:, None])[:, 0], torch.zeros_like(m))
    coef_target, coef_uniform = _coefs(eps, vocab_size)
    c = coef_target * x_t
    if eps > 0:
        c = c + coef_uniform * x.sum(-1)
    meta = _target_meta(t, ignore_index, vocab_size, v_local)
    if group_name:
        stats = torch.cat([torch.stack([m, s, c], dim=-1), meta.view(torch.float32)])
        gathered = all_gather(stats, group_name)
        rows = t.numel()
        m_all, s_all, c_all = gathered[:, :rows].unbind(-1)
        meta_all = gathered[:, rows:].contiguous().view(torch.int32)
        m = m_all.amax(0)
        m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        s = (s_all * torch.exp(m_all - m_ref)).sum(0)
        c = c_all.sum(0)
        info = _info(meta_all, rank)
    else:
        info = _info(meta[None], 0)
    log_s = torch.log(s)
    lse = m + log_s
    valid = t != ignore_index
    loss = torch.where(valid, (m - c) + log_s + z * lse * lse, torch.zeros_like(m))
    n_valid = info[rank, 1].float()
    grad = None
    if compute_grad:
        scale = 1.0 / n_valid if reduction == "mean" else torch.ones_like(n_valid)
        scale = torch.where(valid, scale, torch.zeros_like(scale))
        p = torch.exp(x - m_ref[:, None]) * (1.0 / s)[:, None]  # as PyTorch, not exp(x - lse)
        g = p * (1.0 + 2.0 * z * lse)[:, None] - coef_uniform
        g.scatter_add_(1, local[:, None], torch.where(owns, -coef_target, 0.0)[:, None])
        grad = (g * scale[:, None]).to(logits.dtype).reshape(logits.shape)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / n_valid
    else:
        loss = loss.reshape(target.shape)
    return loss, grad, info
