"""The LM head's GEMM with the cross-entropy row statistics in its epilogue: the logits of a
chunk are never written (``backend="fused"`` of :func:`mtp.ops.linear_cross_entropy`, forward).

``_lce_gemm_stats_kernel``: program ``(i, j)`` computes rows ``[i*BM, (i+1)*BM)`` of the logits
``h @ w^T (+ bias)`` over its share ``j`` of the vocab, one ``[BM, BN]`` tile at a time (a K loop
of ``tl.dot`` over the hidden size), rounds each tile to the input dtype (the logits the unfused
GEMM would have stored, so forward and recomputing backward agree) and folds it into running
per-row statistics: the max ``m``, ``s = sum exp(x - m)`` (online softmax), the target logit and,
with label smoothing, ``sum x``. It writes ``(m, s, c)`` per (vocab share, row), with
``c = coef_target * x[t] + coef_uniform * sum(x)``. :func:`gemm_stats` returns them as
``[splits, rows, 3]`` (a few bytes per row); the op merges the shares as it merges the ranks'
statistics.

Bytes: ``h`` and ``w`` (re-read by each row block, as any GEMM) and 12 B per row per share; no
``[rows, V]`` tensor. Splitting the vocab gives the GPU enough programs when the chunk has few
row blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp.kernels._common import dot_upcast, fp32_dot_precision, gpu_like, interpreting
from mtp.kernels.linear_cross_entropy import _vocab


@triton.jit
def _lce_gemm_stats_kernel(
    h_ptr, w_ptr, bias_ptr, target_ptr, vinfo_ptr, part_ptr,
    n_rows, V_local, H, stride_hm, stride_wv, tiles_per_split, ignore_index, eps,
    HAS_BIAS: tl.constexpr, SMOOTHING: tl.constexpr, TP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < n_rows
    rows64 = rows.to(tl.int64)
    start, _ = _vocab(vinfo_ptr, V_local, TP)
    t = tl.load(target_ptr + rows, mask=mask_m, other=ignore_index).to(tl.int64)
    # a column only when this shard owns it; int32 like the columns (fewer registers)
    target = tl.where(t != ignore_index, t - start, -1).to(tl.int32)
    ks = tl.arange(0, BLOCK_K)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    sum_x = tl.zeros([BLOCK_M], tl.float32)
    x_t = tl.zeros([BLOCK_M], tl.float32)
    for j in range(tiles_per_split):
        cols = (split * tiles_per_split + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < V_local
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            a = tl.load(h_ptr + rows64[:, None] * stride_hm + kk[None, :],
                        mask=mask_m[:, None] & (kk < H)[None, :], other=0.0)
            b = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_wv + kk[:, None],
                        mask=(kk < H)[:, None] & mask_n[None, :], other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # the logits in the input dtype
        x = tl.where(mask_n[None, :], acc, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no column yet
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref[:, None]), axis=1)
        m = m_new
        x_t += tl.sum(tl.where(cols[None, :] == target[:, None], acc, 0.0), axis=1)
        if SMOOTHING:
            sum_x += tl.sum(tl.where(mask_n[None, :], acc, 0.0), axis=1)
    c = (1.0 - eps) * x_t
    if SMOOTHING:
        _, vocab = _vocab(vinfo_ptr, V_local, TP)  # loaded here: a register less in the loop
        c += (eps / vocab.to(tl.float32)) * sum_x
    out = part_ptr + (split.to(tl.int64) * n_rows + rows64) * 3
    tl.store(out, m, mask=mask_m)
    tl.store(out + 1, s, mask=mask_m)
    tl.store(out + 2, c, mask=mask_m)


def _tiles(dtype: torch.dtype, on_gpu: bool) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``."""
    if not on_gpu:
        return 16, 16, 16, 4, 1  # interpreter: several tiles even at test sizes
    if dtype == torch.float32:  # CUDA cores unless TF32 is allowed; BLOCK_K=32 spills on sm_90a
        return 64, 64, 16, 4, 3
    return 128, 128, 64, 8, 3


def gemm_stats(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
               target: torch.Tensor, vinfo: torch.Tensor | None, *, ignore_index: int,
               eps: float) -> torch.Tensor:
    """fp32 ``[splits, rows, 3]``: ``(m, s, c)`` of the logits ``h @ w^T (+ bias)`` over each
    share of the vocab, without forming the logits.

    ``h``: ``[rows, H]``, ``w``: ``[V_local, H]`` (same dtype, unit last stride), ``bias``:
    ``[V_local]`` or None; ``target``: ``[rows]`` contiguous global ids (or ``ignore_index``);
    ``vinfo``: int64 ``[2]`` ``(first id of the shard, global vocab)`` on the device at tp > 1,
    None at tp = 1; ``eps``: the label smoothing.
    """
    rows, hidden = h.shape
    v_local = w.shape[0]
    assert h.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == hidden and h.dtype == w.dtype
    assert target.is_contiguous() and target.numel() == rows
    on_gpu = gpu_like(h.device) and not interpreting()
    bm, bn, bk, warps, stages = _tiles(h.dtype, on_gpu)
    row_blocks, tiles = triton.cdiv(max(rows, 1), bm), triton.cdiv(v_local, bn)
    want = 2 * torch.cuda.get_device_properties(h.device).multi_processor_count if on_gpu else 2
    splits = min(tiles, max(1, triton.cdiv(want, row_blocks)))
    per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per_split)
    part = torch.empty((splits, rows, 3), dtype=torch.float32, device=h.device)
    if rows:
        _lce_gemm_stats_kernel[(row_blocks, splits)](
            h, w, h if bias is None else bias, target, target if vinfo is None else vinfo, part,
            rows, v_local, hidden, h.stride(0), w.stride(0), per_split, ignore_index, eps,
            HAS_BIAS=bias is not None, SMOOTHING=eps > 0.0, TP=vinfo is not None, BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk, UPCAST_DOT=dot_upcast(h.dtype),
            DOT_PRECISION=fp32_dot_precision() if h.dtype == torch.float32 else "ieee",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return part
