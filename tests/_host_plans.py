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


def _linear_cross_entropy():
    """Reduced (gradients in the forward) and unreduced (the recomputing backward, its upstream
    gradient broadcast or per row) losses over several chunks whose per-row slices start at
    every alignment; misaligned operands, bias, smoothing, z-loss, an ignore_index that is a
    valid id, int32 targets, no-grad."""
    from mtp.ops import linear_cross_entropy

    for dtype in (torch.float32, torch.bfloat16):
        for make in (lambda s: torch.randn(s).to(dtype), lambda s: _misaligned(s, dtype)):
            h = make((11, 24)).requires_grad_()
            w = make((40, 24)).requires_grad_()
            b = make((40,)).requires_grad_()
            for t in (torch.randint(0, 40, (11,)), torch.randint(0, 40, (11,), dtype=torch.int32)):
                for reduction, ignore in (("mean", -100), ("sum", 3), ("none", -100)):
                    loss = linear_cross_entropy(h, w, t, bias=b, ignore_index=ignore,
                                                label_smoothing=0.1, z_loss_weight=1e-3,
                                                reduction=reduction, chunk_size=5)
                    loss.backward(torch.ones_like(loss) if reduction != "none"
                                  else torch.rand(loss.shape))
                    linear_cross_entropy(h, w, t, reduction="none").sum().backward()
                    with torch.no_grad():
                        linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=4)


# --- grouped_gemm / grouped_mlp --------------------------------------------------------------


def _grouped_backward(y):
    y.backward(torch.ones_like(y))


def _grouped():
    """Both ops on ragged and empty groups, every routing empty, misaligned operands, trans_b,
    the bias / activation / probs epilogues and fp32 / bf16 / fp16 (TMA and pointer plans)."""
    from mtp.ops import grouped_gemm, grouped_mlp

    E, K, N = 4, 40, 24
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for make in (lambda s: torch.randn(s).to(dtype), lambda s: _misaligned(s, dtype)):
            for sizes in ([5, 0, 17, 3], [0, 0, 0, 0])[: 2 if dtype == torch.bfloat16 else 1]:
                counts = torch.tensor(sizes, dtype=torch.int32 if sizes[0] else torch.int64)
                M = sum(sizes) + 3
                x = make((M, K)).requires_grad_()
                for trans_b in (False, True):
                    w = make((E, N, K) if trans_b else (E, K, N)).requires_grad_()
                    _grouped_backward(grouped_gemm(x, w, counts, trans_b=trans_b))
                w = make((E, K, 2 * N)).requires_grad_()
                b = make((E, 2 * N)).requires_grad_()
                p = torch.rand(M, dtype=dtype).requires_grad_()
                for act in ("swiglu", "gelu"):
                    _grouped_backward(grouped_gemm(x, w, counts, bias=b, activation=act, probs=p))
                b2 = make((E, K)).requires_grad_()
                for act, p_, f in (("swiglu", p, N), ("gelu_tanh", None, 2 * N),
                                   ("clamped_swiglu", p, N)):  # fmt: skip
                    w2 = make((E, f, K)).requires_grad_()
                    _grouped_backward(grouped_mlp(x, w, w2, counts, p_, b, b2, activation=act))
    # The zeros that F.grouped_mm leaves (backend="torch"): tail rows, empty experts.
    for counts in (torch.tensor([5, 0, 17, 3]), torch.tensor([5, 0, 17, 3], dtype=torch.int32)):
        x = torch.randn(28, K, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(E, K, N, dtype=torch.bfloat16, requires_grad=True)
        _grouped_backward(grouped_gemm(x, w, counts, backend="torch"))
    # bf16, TMA: the weight gradient split over rows (2048 rows, 4 output tiles), fc1 and fc2
    # on tiles of different heights (150 rows per expert: two tile maps for one routing).
    for M in (2048, 600):
        counts = torch.tensor([M // 4] * 3 + [M - 3 * (M // 4)])
        x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(E, K, 2 * N, dtype=torch.bfloat16, requires_grad=True)
        _grouped_backward(grouped_gemm(x, w, counts))
        w2 = torch.randn(E, N, K, dtype=torch.bfloat16, requires_grad=True)
        _grouped_backward(grouped_mlp(x, w, w2, counts))


# --- quantize and the FP8 grouped GEMM ---------------------------------------------------


_FP8_LAYOUTS = (("blockwise", "rowwise"), ("blockwise", "colwise"), ("blockwise", "block"),
                ("mxfp8", "rowwise"), ("mxfp8", "colwise"))  # fmt: skip


def _quantize():
    """Every layout and recipe, power-of-two scales, 2-D and 3-D, fp32 / bf16, misaligned
    inputs, the expert-padded column-wise layout on two routings."""
    from mtp.ops import quantize

    for dtype in (torch.float32, torch.bfloat16):
        for make in (lambda s: torch.randn(s).to(dtype), lambda s: _misaligned(s, dtype)):
            for shape in ((33, 200), (3, 40, 136)):
                x = make(shape)
                for recipe, layout in _FP8_LAYOUTS:
                    quantize(x, recipe, layout, pow2_scales=recipe == "blockwise")
            for sizes in ([20, 0, 17], [0, 0, 0]):
                counts = torch.tensor(sizes)
                for recipe in ("blockwise", "mxfp8"):
                    quantize(make((40, 72)), recipe, "colwise", tokens_per_expert=counts)


def _grouped_fp8():
    """Both recipes, ragged and empty routings, trans_b, misaligned BF16 inputs, the BF16
    weight-gradient option and pre-quantised operands (a misaligned FP8 x among them)."""
    from mtp.ops import Fp8Recipe, Fp8Tensor, grouped_gemm, quantize

    E, K, N = 4, 40, 24
    for recipe in ("blockwise", "mxfp8", Fp8Recipe("blockwise", wgrad="bf16")):
        for make in (lambda s: torch.randn(s).to(torch.bfloat16),
                     lambda s: _misaligned(s, torch.bfloat16)):  # fmt: skip
            for sizes in ([5, 0, 17, 3], [0, 0, 0, 0]):
                counts = torch.tensor(sizes)
                x = make((sum(sizes) + 3, K)).requires_grad_()
                for trans_b in (False, True):
                    w = make((E, N, K) if trans_b else (E, K, N)).requires_grad_()
                    _grouped_backward(grouped_gemm(x, w, counts, trans_b=trans_b,
                                                   fp8_recipe=recipe))  # fmt: skip
    counts = torch.tensor([5, 0, 17, 3])
    x = torch.randn(28, K, dtype=torch.bfloat16)
    for recipe, layout in (("blockwise", "block"), ("mxfp8", "rowwise")):
        xq = quantize(x, recipe)
        wq = quantize(torch.randn(E, N, K, dtype=torch.bfloat16), recipe, layout)
        grouped_gemm(xq, wq, counts, trans_b=True)
        shifted = torch.empty(28 * K + 1, dtype=torch.float8_e4m3fn)[1:].view(28, K)
        shifted.copy_(xq.data)
        grouped_gemm(Fp8Tensor(shifted, xq.scales, recipe, "rowwise"), wq, counts, trans_b=True)
# --- permute / unpermute ---------------------------------------------------------------------


def _shifted(t):
    """A copy of ``t`` one element past a 16-byte boundary (a misaligned address)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    return buf[1:].view(t.shape).copy_(t)


def _routings(tokens, experts, k):
    g = torch.Generator().manual_seed(tokens)
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
    rm = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    return rm, idx, torch.rand(tokens, experts, generator=g) * rm


def _permute():
    from mtp.ops import permute, unpermute

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, hidden in ((16, 64), (33, 24)):
            rm, idx, p = _routings(tokens, 6, 2)
            x = torch.randn(tokens, hidden).to(dtype)
            for make in (lambda t: t, _shifted):
                rms, idxs = make(rm), make(idx)
                for probs in (None, make(p)):
                    for kw in (dict(routing_map=rms, num_out_tokens=2 * tokens),
                               dict(indices=idxs, num_experts=6),
                               dict(routing_map=rms, drop_and_pad=True, capacity=5),
                               dict(routing_map=rms, num_out_tokens=2 * tokens, validate=False)):
                        xg = make(x).detach().requires_grad_()
                        pg = None if probs is None else probs.detach().requires_grad_()
                        out = permute(xg, probs=pg, return_token_map=True, **kw)
                        (out[0].sum() + (0 if out[1] is None else out[1].sum())).backward()
                        y = make(torch.randn(out[0].shape).to(dtype)).requires_grad_()
                        routing = {k: kw[k] for k in ("routing_map", "indices") if k in kw}
                        for tm in (out[3], None):
                            z = unpermute(y, make(out[2]), (tokens, hidden), pg,
                                          drop_and_pad=kw.get("drop_and_pad", False),
                                          token_map=tm, **routing)
                            z.backward(torch.ones_like(z))


def run() -> None:
    _bias_act()
    _cross_entropy()
    _linear_cross_entropy()
    _grouped()
    _quantize()
    _grouped_fp8()
    _permute()
