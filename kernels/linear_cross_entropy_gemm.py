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


@triton.jit
def _lce_gemm_stats_kernel(
    h_ptr, w_ptr, bias_ptr, local_t_ptr, coef_ptr, part_ptr,
    n_rows, V_local, H, stride_hm, stride_wv, tiles_per_split,
    HAS_BIAS: tl.constexpr, SMOOTHING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < n_rows
    rows64 = rows.to(tl.int64)
    target = tl.load(local_t_ptr + rows, mask=mask_m, other=-1)
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
    c = tl.load(coef_ptr) * x_t
    if SMOOTHING:
        c += tl.load(coef_ptr + 1) * sum_x
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
               local_t: torch.Tensor, coefs: torch.Tensor, smoothing: bool) -> torch.Tensor:
    """fp32 ``[splits, rows, 3]``: ``(m, s, c)`` of the logits ``h @ w^T (+ bias)`` over each
    share of the vocab, without forming the logits.

    ``h``: ``[rows, H]``, ``w``: ``[V_local, H]`` (same dtype, unit last stride), ``bias``:
    ``[V_local]`` or None; ``local_t``: int64 ``[rows]`` local target ids (-1: another rank's);
    ``coefs``: fp32 ``[2]`` ``(1 - eps, eps / V)``; ``smoothing``: ``eps > 0``.
    """
    rows, hidden = h.shape
    v_local = w.shape[0]
    assert h.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == hidden and h.dtype == w.dtype
    assert local_t.dtype == torch.int64 and local_t.is_contiguous() and coefs.numel() == 2
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
            h, w, h if bias is None else bias, local_t, coefs, part,
            rows, v_local, hidden, h.stride(0), w.stride(0), per_split,
            HAS_BIAS=bias is not None, SMOOTHING=smoothing, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, UPCAST_DOT=dot_upcast(h.dtype),
            DOT_PRECISION=fp32_dot_precision() if h.dtype == torch.float32 else "ieee",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return part
