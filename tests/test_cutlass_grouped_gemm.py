"""CUTLASS grouped GEMM on a GPU (sm_90 / sm_100): correctness against a float64 per-expert loop.

Forward (both weight layouts), dgrad, wgrad; skewed, empty and all-empty routings; bf16 and fp16;
int32 and int64 counts; more experts than one scan chunk; CUDA-graph capture replayed with new
routings. Skipped (with the reason) where mtp.ops.grouped_gemm.cutlass.is_available() is False.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mtp.ops.grouped_gemm import cutlass
from mtp.testing import assert_close, assert_graph_safe, count_host_syncs

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _needs_backend():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, reason = cutlass.is_available()
    if not ok:
        pytest.skip(reason)


def make_counts(kind: str, experts: int, rows: int, gen: torch.Generator) -> list[int]:
    """Token counts per expert adding up to at most ``rows``."""
    if kind == "all_empty":
        return [0] * experts
    if kind == "skewed":  # one hot expert, a few tiny ones, the rest empty
        counts = [0] * experts
        counts[experts // 2] = rows * 3 // 4
        for e in range(0, experts, 3):
            if e != experts // 2:
                counts[e] = int(torch.randint(1, 6, (1,), generator=gen))
        return counts
    weights = torch.rand(experts, generator=gen)
    if kind == "empty":  # about half the experts without tokens
        weights[torch.rand(experts, generator=gen) < 0.5] = 0
        weights[0] = 0
    weights = weights / weights.sum().clamp_min(1e-9)
    counts = (weights * (rows - 7)).floor().to(torch.int64).tolist()  # leave tail rows unowned
    return counts


def ref_forward(x, w, counts, trans_b, rows):
    """float64 per-expert loop; rows past the sum stay zero."""
    out = torch.zeros(rows, w.shape[1] if trans_b else w.shape[2], dtype=torch.float64,
                      device=x.device)  # fmt: skip
    start = 0
    for e, c in enumerate(counts):
        we = w[e].double()
        out[start : start + c] = x[start : start + c].double() @ (we.t() if trans_b else we)
        start += c
    return out


def ref_wgrad(x, dy, counts):
    out = torch.zeros(len(counts), x.shape[1], dy.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        out[e] = x[start : start + c].double().t() @ dy[start : start + c].double()
        start += c
    return out


def _tokens(counts, dtype=torch.int32):
    return torch.tensor(counts, dtype=dtype, device="cuda")


SHAPES = [  # (rows M, K, N, experts); under 256 rows per expert: the sm_90a small-group family
    (200, 64, 96, 8),
    (1536, 512, 384, 16),
    (4096, 128, 256, 4),  # ~1000 rows per expert: the default (cooperative, 2x1 cluster) kernels
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "all_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward(dtype, trans_b, kind, shape):
    m, k, n, e = shape
    gen = torch.Generator().manual_seed(zlib.crc32(f"fwd-{m}-{kind}-{trans_b}".encode()))
    counts = make_counts(kind, e, m, gen)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(e, n, k, generator=gen) if trans_b else torch.randn(e, k, n, generator=gen))
    w = (w / k**0.5).to("cuda", dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    cutlass.grouped_gemm(x, w, _tokens(counts), trans_b, out)
    assert_close(out, ref_forward(x, w, counts, trans_b, m), dtype, msg=f"{kind} {counts}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [False, True])
def test_dgrad(dtype, trans_b):
    """dx_e = dy_e @ w_e^T is the forward call with the other weight layout."""
    m, k, n, e = 700, 128, 256, 6
    gen = torch.Generator().manual_seed(3)
    counts = make_counts("empty", e, m, gen)
    w = (torch.randn(e, n, k, generator=gen) if trans_b else torch.randn(e, k, n, generator=gen))
    w = (w / n**0.5).to("cuda", dtype)
    dy = torch.randn(m, n, generator=gen).to("cuda", dtype)
    dx = torch.full((m, k), float("nan"), dtype=dtype, device="cuda")
    cutlass.grouped_gemm(dy, w, _tokens(counts), not trans_b, dx)
    # dx = dy @ w_e^T where w_e is [K, N] (trans_b False) or dy @ w_e with w_e [N, K].
    expected = ref_forward(dy, w, counts, not trans_b, m)
    assert_close(dx, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "all_empty"])
@pytest.mark.parametrize("shape", SHAPES)
def test_wgrad(dtype, kind, shape):
    m, k, n, e = shape
    gen = torch.Generator().manual_seed(zlib.crc32(f"wgrad-{m}-{kind}".encode()))
    counts = make_counts(kind, e, m, gen)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    dy = (torch.randn(m, n, generator=gen) / 8).to("cuda", dtype)
    out = torch.full((e, k, n), float("nan"), dtype=dtype, device="cuda")
    cutlass.grouped_gemm_wgrad(x, dy, _tokens(counts, torch.int64), out)
    expected = ref_wgrad(x, dy, counts)
    assert_close(out, expected, dtype, msg=f"{kind} {counts}")
    for expert, c in enumerate(counts):
        if c == 0:
            assert torch.equal(out[expert], torch.zeros_like(out[expert])), f"expert {expert}"


@pytest.mark.parametrize("tokens_dtype", [torch.int32, torch.int64])
def test_many_experts_and_count_dtypes(tokens_dtype):
    """More experts than one 256-wide scan chunk of the problem-description kernel."""
    m, k, n, e = 900, 32, 16, 300
    gen = torch.Generator().manual_seed(5)
    counts = make_counts("empty", e, m, gen)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(e, k, n, generator=gen).to("cuda", torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cutlass.grouped_gemm(x, w, _tokens(counts, tokens_dtype), False, out)
    assert_close(out, ref_forward(x, w, counts, False, m), torch.bfloat16)
    dy = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16)
    dw = torch.full((e, k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cutlass.grouped_gemm_wgrad(x, dy, _tokens(counts, tokens_dtype), dw)
    assert_close(dw, ref_wgrad(x, dy, counts), torch.bfloat16)


def test_counts_past_rows_are_clamped_without_validation():
    """validate=False and a sum above M: the kernels clamp to the M rows instead of faulting."""
    m, k, n = 64, 16, 16
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(3, k, n, device="cuda").bfloat16()
    counts = [40, 40, 40]
    with pytest.raises(ValueError, match="sums to 120"):
        cutlass.grouped_gemm(x, w, _tokens(counts), False, torch.empty(m, n, device="cuda").bfloat16())
    out = torch.full((m, n), float("nan"), device="cuda").bfloat16()
    cutlass.grouped_gemm(x, w, _tokens(counts), False, out, validate=False)
    assert_close(out, ref_forward(x, w, [40, 24, 0], False, m), torch.bfloat16)


def test_misaligned_pointer_is_rejected():
    flat = torch.randn(64 * 16 + 1, device="cuda").bfloat16()
    x = flat[1:].view(64, 16)
    w = torch.randn(2, 16, 16, device="cuda").bfloat16()
    out = torch.empty(64, 16, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="^x must start at a 16-byte aligned address"):
        cutlass.grouped_gemm(x, w, _tokens([10, 10]), False, out)


def test_no_host_sync_without_validation():
    m, k, n = 128, 32, 32
    x = torch.randn(m, k, device="cuda").half()
    w = torch.randn(4, k, n, device="cuda").half()
    tokens = _tokens([30, 0, 50, 20])
    out = torch.empty(m, n, device="cuda").half()
    cutlass.grouped_gemm(x, w, tokens, False, out, validate=False)  # warm caches
    with count_host_syncs() as syncs:
        cutlass.grouped_gemm(x, w, tokens, False, out, validate=False)
        cutlass.grouped_gemm_wgrad(x, out, tokens, torch.empty(4, k, n, device="cuda").half(),
                                   validate=False)  # fmt: skip
    assert syncs.count == 0, syncs


def test_kernels_are_configured_once_not_per_call():
    """The dynamic shared-memory attribute is set once per (instantiation, device): more calls,
    other shapes and expert counts add no configuration (the extension counts them)."""
    ext = cutlass.extension()
    m, k, n = 128, 32, 32
    x = torch.randn(m, k, device="cuda").half()
    w = torch.randn(4, k, n, device="cuda").half()
    out = torch.empty(m, n, device="cuda").half()
    cutlass.grouped_gemm(x, w, _tokens([30, 0, 50, 20]), False, out, validate=False)
    cutlass.grouped_gemm_wgrad(x, out, _tokens([30, 0, 50, 20]),
                               torch.empty(4, k, n, device="cuda").half(), validate=False)
    before = ext.kernel_setups()
    for experts in (4, 8):
        w = torch.randn(experts, k, n, device="cuda").half()
        tokens = _tokens([m // experts] * experts)
        cutlass.grouped_gemm(x, w, tokens, False, out, validate=False)
        cutlass.grouped_gemm_wgrad(x, out, tokens, torch.empty(experts, k, n, device="cuda").half(),
                                   validate=False)  # fmt: skip
    assert ext.kernel_setups() == before >= 2
    torch.testing.assert_close(out.double(), ref_forward(x, w, [m // 8] * 8, False, m),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_graph_safe_proxy():
    m, k, n, e = 256, 64, 64, 4
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(e, k, n, device="cuda").bfloat16()
    out = torch.empty(m, n, device="cuda").bfloat16()

    def fwd(x, w, tokens, out):
        cutlass.grouped_gemm(x, w, tokens, False, out)
        return out

    assert_graph_safe(fwd, x, w, _tokens([100, 0, 60, 90]), out,
                      second_args=(x, w, _tokens([0, 200, 10, 40]), out))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_replay_with_new_routings(dtype):
    """Capture fwd + dgrad + wgrad once; replay after copying new counts into the same buffer."""
    m, k, n, e = 512, 128, 192, 8
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(e, k, n, generator=gen) / k**0.5).to("cuda", dtype)
    dy = torch.randn(m, n, generator=gen).to("cuda", dtype)
    tokens = _tokens(make_counts("uniform", e, m, gen))
    y = torch.empty(m, n, dtype=dtype, device="cuda")
    dx = torch.empty(m, k, dtype=dtype, device="cuda")
    dw = torch.empty(e, k, n, dtype=dtype, device="cuda")

    def step():
        cutlass.grouped_gemm(x, w, tokens, False, y)
        cutlass.grouped_gemm(dy, w, tokens, True, dx)
        cutlass.grouped_gemm_wgrad(x, dy, tokens, dw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (workspace sizes, kernel attributes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pointers = (y.data_ptr(), dx.data_ptr(), dw.data_ptr())
    for round_, kind in enumerate(["skewed", "empty", "all_empty", "uniform"]):
        counts = make_counts(kind, e, m, gen)
        tokens.copy_(_tokens(counts))
        for t in (y, dx, dw):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        msg = f"replay {round_} ({kind}: {counts})"
        assert_close(y, ref_forward(x, w, counts, False, m), dtype, msg=msg)
        assert_close(dx, ref_forward(dy, w, counts, True, m), dtype, msg=msg)
        assert_close(dw, ref_wgrad(x, dy, counts), dtype, msg=msg)
    assert (y.data_ptr(), dx.data_ptr(), dw.data_ptr()) == pointers


def test_custom_op_matches_function():
    m, k, n, e = 96, 32, 48, 3
    x = torch.randn(m, k, device="cuda").half()
    w = torch.randn(e, n, k, device="cuda").half()
    tokens = _tokens([20, 0, 70])
    a = torch.full((m, n), float("nan"), device="cuda").half()
    b = torch.full((m, n), float("nan"), device="cuda").half()
    cutlass.grouped_gemm(x, w, tokens, True, a)
    torch.ops.mtp.cutlass_grouped_gemm(x, w, tokens, True, b)
    assert torch.equal(a, b)


@pytest.mark.parametrize("trans_b", [False, True])
def test_through_grouped_gemm_op_with_autograd(trans_b):
    """mtp.ops.grouped_gemm(..., backend="cutlass"): forward, dx and dw against float64."""
    from mtp.ops import grouped_gemm

    m, k, n, e = 520, 128, 192, 5
    gen = torch.Generator().manual_seed(11 + trans_b)
    counts = make_counts("empty", e, m, gen)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(e, n, k, generator=gen) if trans_b else torch.randn(e, k, n, generator=gen)
    w = (w / k**0.5).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16)
    y = grouped_gemm(x, w, _tokens(counts), trans_b=trans_b, backend="cutlass")
    assert_close(y, ref_forward(x, w, counts, trans_b, m), torch.bfloat16)
    y.backward(dy)
    rows = sum(counts)
    dx = torch.zeros(m, k, dtype=torch.float64, device="cuda")
    dw = torch.zeros_like(w, dtype=torch.float64)
    start = 0
    for i, c in enumerate(counts):
        we, dye, xe = w[i].double(), dy[start : start + c].double(), x[start : start + c].double()
        dx[start : start + c] = dye @ (we if trans_b else we.t())
        dw[i] = (dye.t() @ xe) if trans_b else (xe.t() @ dye)
        start += c
    assert start == rows
    assert_close(x.grad, dx, torch.bfloat16)
    assert_close(w.grad, dw, torch.bfloat16)
