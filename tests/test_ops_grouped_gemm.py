"""mtp.ops.grouped_gemm: every backend against a float64 per-expert loop, forward and gradients.

On CPU the ``triton`` backend runs under the Triton interpreter (small tiles, so the tiny shapes
here still span several tiles per expert and leave partial tiles in K, N and every expert).
Outputs start poisoned (``MTP_POISON_OUTPUTS=1``): an element a backend forgets to write fails.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from mtp import ops, settings
from mtp.kernels.grouped_gemm_details import launch, pointer
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS
from mtp.ops.grouped_gemm.config import make_config, override
from mtp.testing import (
    GraphSafetyError,
    assert_close,
    assert_graph_safe,
    compile_for_targets,
    count_host_syncs,
    own_error_atol,
    tolerance,
)


def forward_config(dtype, M, N, K, E):
    """The pointer kernel's sm_90 tiles (what make_config picks for non-TMA operands)."""
    return make_config(9, dtype, M, N, K, E)


def wgrad_config(dtype, K, N):
    """The pointer weight gradient's sm_90 tiles for a ``[K, N]`` output per expert."""
    return make_config(9, dtype, 0, N, K, 1, gemm="wgrad")

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_BACKENDS = ["triton", "reference", "sequential", "multistream", "torch"]


# --------------------------------------------------------------------------------------------
# Float64 ground truth (independent of the code under test)
# --------------------------------------------------------------------------------------------


def _weights(w: torch.Tensor, trans_b: bool, dtype=torch.float64) -> torch.Tensor:
    """``[E, K, N]`` view of the weights in ``dtype``."""
    w = w.detach().to(dtype)
    return w.transpose(1, 2) if trans_b else w


def expected_forward(x, w, sizes, trans_b, dtype=torch.float64):
    """Per-expert matmuls in ``dtype`` (float64: the ground truth; float32: PyTorch's own)."""
    wk = _weights(w, trans_b, dtype)
    y = torch.zeros(x.shape[0], wk.shape[2], dtype=dtype, device=x.device)
    row = 0
    for e, m in enumerate(sizes):
        y[row : row + m] = x[row : row + m].detach().to(dtype) @ wk[e]
        row += m
    return y


def expected_grads(x, w, sizes, trans_b, dy, dtype=torch.float64):
    wk = _weights(w, trans_b, dtype)
    dy = dy.to(dtype)
    dx = torch.zeros(x.shape, dtype=dtype, device=x.device)
    dw = torch.zeros(wk.shape, dtype=dtype, device=x.device)
    row = 0
    for e, m in enumerate(sizes):
        rows = slice(row, row + m)
        dx[rows] = dy[rows] @ wk[e].T
        dw[e] = x[rows].detach().to(dtype).T @ dy[rows]
        row += m
    return dx, (dw.transpose(1, 2) if trans_b else dw)


#: fp32 on a GPU: a fixed atol is below fp32's own rounding once a reduction runs over a
#: thousand rows (cuBLAS: 3.2e-5 on a 1290-row weight gradient, H200), so the bound is a
#: multiple of PyTorch's own fp32 error on the same inputs (Triton's FMA order measured 6.5x
#: cuBLAS's largest element error there; an unwritten or misplaced tile is 1e4x off).
FP32_OWN_ERROR_FACTOR = 16


def _fp32_atols(x, w, sizes, trans_b, dy, want) -> dict[str, float]:
    """``atol`` per output: the table's, or FP32_OWN_ERROR_FACTOR x PyTorch's own fp32 error."""
    own = (expected_forward(x, w, sizes, trans_b, torch.float32),
           *expected_grads(x, w, sizes, trans_b, dy, torch.float32))
    table = tolerance(torch.float32)[1]
    return {name: max(table, own_error_atol(o, e, FP32_OWN_ERROR_FACTOR))
            for name, o, e in zip(("y", "dx", "dw"), own, want)}


def make_inputs(sizes, M, K, N, dtype, trans_b, device, count_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(sizes)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w_shape = (E, N, K) if trans_b else (E, K, N)
    w = (torch.randn(w_shape, generator=g) / K**0.5).to(device=device, dtype=dtype)
    counts = torch.tensor(sizes, dtype=count_dtype, device=device)
    dy = torch.randn(M, N, generator=g).to(device=device, dtype=dtype)
    return x.requires_grad_(), w.requires_grad_(), counts, dy


def check_against_float64(backend, sizes, M, K, N, dtype, trans_b, device, **kw):
    x, w, counts, dy = make_inputs(sizes, M, K, N, dtype, trans_b, device, **kw)
    y = ops.grouped_gemm(x, w, counts, trans_b=trans_b, backend=backend)
    assert y.dtype == dtype and y.shape == (M, N)
    want_y = expected_forward(x, w, sizes, trans_b)
    dx, dw = expected_grads(x, w, sizes, trans_b, dy)
    atol = {}
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        atol = _fp32_atols(x, w, sizes, trans_b, dy, (want_y, dx, dw))
    assert_close(y, want_y, atol=atol.get("y"), msg=f"{backend} y")
    routed = sum(sizes)
    assert torch.equal(y[routed:], torch.zeros_like(y[routed:])), "rows past the routed ones"
    y.backward(dy)
    assert_close(x.grad, dx, atol=atol.get("dx"), msg=f"{backend} dx")
    assert_close(w.grad, dw, atol=atol.get("dw"), msg=f"{backend} dw")
    for e, m in enumerate(sizes):
        if m == 0:
            assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e])), f"dw[{e}] (empty expert)"


# --------------------------------------------------------------------------------------------
# Correctness of every backend
# --------------------------------------------------------------------------------------------

# Skewed groups with empty experts; 45-row buffer, 37 routed rows (zero tail); K and N not
# multiples of the 16-wide interpreter tiles; one expert spans two row tiles plus a partial one.
SIZES = [0, 23, 1, 0, 13]


@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_matches_float64(backend, dtype, trans_b, device):
    if backend == "multistream" and device.type == "cuda":
        pytest.skip("covered by the gpu tests")
    count_dtype = torch.int32 if trans_b else torch.int64
    check_against_float64(
        backend, SIZES, 45, 37, 29, dtype, trans_b, device, count_dtype=count_dtype
    )


@pytest.mark.parametrize(
    "sizes, M",
    [
        ([40], 40),  # one expert, every row routed
        ([0, 0, 0], 9),  # nothing routed: all zeros, all dw zero
        ([5, 0, 0, 0, 0, 0, 0, 11, 0, 2], 18),  # many experts, mostly empty
    ],
    ids=["one_expert", "nothing_routed", "mostly_empty"],
)
@pytest.mark.parametrize("backend", ["triton", "torch", "sequential"])
def test_edge_routings(backend, sizes, M, device):
    check_against_float64(backend, sizes, M, 20, 18, torch.float32, False, device)


def test_no_rows_and_no_experts(device):
    for backend in ("triton", "reference", "torch", "sequential"):
        x = torch.randn(0, 8, device=device)
        w = torch.randn(3, 8, 5, device=device)
        counts = torch.zeros(3, dtype=torch.int64, device=device)
        y = ops.grouped_gemm(x, w, counts, backend=backend)
        assert y.shape == (0, 5)
        x = torch.randn(6, 8, device=device)
        w = torch.randn(0, 8, 5, device=device)
        counts = torch.zeros(0, dtype=torch.int64, device=device)
        y = ops.grouped_gemm(x, w, counts, backend=backend)
        assert torch.equal(y, torch.zeros(6, 5, device=device)), backend


@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_out_buffer_is_written_completely(backend, trans_b, device):
    """``out=`` starting as NaN: every element written (zeros past the routed rows), gradients
    flow through the returned buffer."""
    sizes, M, K, N = [4, 0, 9], 21, 19, 17
    x, w, counts, dy = make_inputs(sizes, M, K, N, torch.float32, trans_b, device, seed=3)
    out = torch.full((M, N), float("nan"), device=device)
    y = ops.grouped_gemm(x, w, counts, trans_b=trans_b, backend=backend, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close(out, expected_forward(x, w, sizes, trans_b))
    y.backward(dy)
    dx, dw = expected_grads(x, w, sizes, trans_b, dy)
    assert_close(x.grad, dx)
    assert_close(w.grad, dw)
    with torch.no_grad():  # no autograd: the plain out-variant op
        out.fill_(float("nan"))
        ops.grouped_gemm(x, w, counts, trans_b=trans_b, backend=backend, out=out)
    assert_close(out, expected_forward(x, w, sizes, trans_b))


def test_non_contiguous_inputs(device):
    """Strided x (a column slice) and a transposed weight view work on every backend."""
    sizes, M, K, N = [6, 0, 11], 20, 24, 16
    base = torch.randn(M, 2 * K, device=device)
    x = base[:, ::2]
    w = torch.randn(3, N, K, device=device).transpose(1, 2)  # [E, K, N], not contiguous
    for backend in CPU_BACKENDS:
        y = ops.grouped_gemm(x, w, torch.tensor(sizes, device=device), backend=backend)
        assert_close(y, expected_forward(x, w, sizes, False), msg=backend)


def test_auto_and_env_choose_the_backend(monkeypatch, device):
    """``auto``: the Triton kernel on CUDA, the reference on CPU; ``MTP_BACKEND`` steers it."""
    x, w, counts, _ = make_inputs([3, 4], 9, 8, 8, torch.float32, False, device)
    settings.configure(backend=None)
    launches = _count_runs(monkeypatch, pointer.grouped_gemm_kernel)
    y = ops.grouped_gemm(x, w, counts)
    assert len(launches) == (1 if device.type == "cuda" else 0)
    assert_close(y, expected_forward(x, w, [3, 4], False))
    settings.configure(backend="sequential")
    assert _count_mm(lambda: ops.grouped_gemm(x, w, counts)) == 2
    assert len(launches) == (1 if device.type == "cuda" else 0)


@pytest.mark.parametrize("act", ["swiglu", "gelu", "clamped_swiglu"])
@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
def test_activation_epilogue_matches_float64(backend, act, device):
    """``grouped_gemm(..., bias=, activation=, probs=)``: ``act(x @ w[e] + b[e]) * p`` and the
    gradients of x, w, b and p against float64 (trans_b, an empty expert, a zero tail)."""
    sizes, M, K, N = [0, 23, 1, 0, 13], 45, 37, 30
    x, w, counts, _ = make_inputs(sizes, M, K, N, torch.float32, True, device, seed=11)
    g = torch.Generator().manual_seed(12)
    b = torch.randn(len(sizes), N, generator=g).to(device).requires_grad_()
    p = torch.rand(M, generator=g).to(device).requires_grad_()
    y = ops.grouped_gemm(x, w, counts, trans_b=True, backend=backend, bias=b, activation=act,
                         probs=p, activation_limit=1.5)  # fmt: skip
    dy = torch.randn(y.shape, generator=g).to(device)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b, p)]
    rows = torch.cat([torch.full((m,), e, device=device) for e, m in enumerate(sizes)])
    h = torch.einsum("mk,mnk->mn", leaves[0][:37], leaves[1][rows]) + leaves[2][rows]
    h = torch.cat([h, h.new_zeros(M - 37, N)])
    if act == "swiglu":
        a, up = h.chunk(2, -1)
        ref = torch.nn.functional.silu(a) * up
    elif act == "gelu":
        ref = torch.nn.functional.gelu(h)
    else:
        gate, up = h[:, 0::2].clamp(max=1.5), h[:, 1::2].clamp(-1.5, 1.5)
        ref = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    ref = ref * leaves[3][:, None]
    ref.backward(dy.double())
    assert_close(y, ref, msg=f"{backend} y")
    assert torch.equal(y[37:], torch.zeros_like(y[37:])), "rows past the routed ones"
    for name, got, want in zip("xwbp", (x, w, b, p), leaves):
        assert_close(got.grad, want.grad, msg=f"{backend} d{name}")


# --------------------------------------------------------------------------------------------
# The kernels with the GPU tile configs, and the persistent variant
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_with_gpu_configs_and_persistent(dtype, device):
    """The default sm_90/sm_100 tiles (and the persistent schedule) compute the same thing."""
    sizes, M, K, N = [70, 0, 3, 130], 220, 72, 136
    x, w, counts, dy = make_inputs(sizes, M, K, N, dtype, False, device, seed=5)
    x, w = x.detach(), w.detach()
    cfg = forward_config(dtype, M, N, K, len(sizes))
    for persistent in (False, True):
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        launch.forward(x, w, counts, out, dataclasses.replace(cfg, persistent=persistent))
        assert_close(out, expected_forward(x, w, sizes, False), msg=f"persistent={persistent}")
    big = forward_config(dtype, 1 << 20, N, K, 4)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    launch.forward(x, w, counts, out, dataclasses.replace(big, persistent=True))
    assert_close(out, expected_forward(x, w, sizes, False), msg=str(big))
    dw = torch.full((len(sizes), K, N), float("nan"), dtype=dtype, device=device)
    launch.wgrad(x, dy, counts, dw, wgrad_config(dtype, K, N))
    assert_close(dw, expected_grads(x, w, sizes, False, dy)[1])


def test_worst_case_tile_bound():
    """sum_e cdiv(m_e, BM) + the tail's tiles never exceed the grid the launcher sizes."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        E = int(torch.randint(1, 40, (1,), generator=g))
        M = int(torch.randint(0, 600, (1,), generator=g))
        bm = int(torch.tensor([16, 64, 128])[torch.randint(0, 3, (1,), generator=g)])
        cuts = torch.sort(torch.randint(0, M + 1, (E,), generator=g)).values
        sizes = torch.diff(cuts, prepend=torch.tensor([0])).tolist()
        routed = sum(sizes)
        used = sum(-(-m // bm) for m in sizes) + -(-(M - routed) // bm)
        assert used <= launch.num_row_tiles_bound(M, E, bm)


# --------------------------------------------------------------------------------------------
# Launch counts
# --------------------------------------------------------------------------------------------


def _count_runs(monkeypatch, kernel) -> list:
    """Record every launch of a Triton kernel (JIT or interpreted: both launch through run)."""
    calls: list = []
    original = kernel.run

    def run(*args, **kwargs):
        calls.append(kwargs.get("grid"))
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    return calls


def _count_mm(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::mm")


@pytest.mark.parametrize("E", [1, 4, 12])
def test_triton_is_one_launch_whatever_E(E, monkeypatch, device):
    sizes = [3 + (e % 3) for e in range(E)]
    x, w, counts, dy = make_inputs(sizes, sum(sizes) + 2, 16, 16, torch.float32, False, device)
    fwd = _count_runs(monkeypatch, pointer.grouped_gemm_kernel)
    wgrad = _count_runs(monkeypatch, pointer.grouped_wgrad_kernel)
    y = None

    def forward():
        nonlocal y
        y = ops.grouped_gemm(x, w, counts, backend="triton", validate=False)

    assert _count_mm(forward) == 0
    assert (len(fwd), len(wgrad)) == (1, 0)
    y.backward(dy)
    assert (len(fwd), len(wgrad)) == (2, 1)  # backward: one dgrad launch, one wgrad launch


@pytest.mark.parametrize("backend", ["sequential", "multistream", "reference"])
def test_loop_backends_issue_one_gemm_per_expert(backend, device):
    if backend == "multistream" and device.type == "cuda":
        pytest.skip("CPU counting; the gpu test covers CUDA")
    for E in (1, 5):
        sizes = [2 + e for e in range(E)]
        x, w, counts, _ = make_inputs(sizes, sum(sizes), 8, 8, torch.float32, False, device)
        assert _count_mm(lambda x=x, w=w, c=counts: ops.grouped_gemm(x, w, c, backend=backend)) == E


# --------------------------------------------------------------------------------------------
# Graph safety, fake tensors, opcheck
# --------------------------------------------------------------------------------------------


def test_triton_and_torch_paths_are_graph_safe(device):
    # On CUDA, torch's grouped_mm is sync-free only on its bf16 fast path (sm_90/sm_100).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes, M = [5, 0, 9, 2], 20
    x, w, counts, _ = make_inputs(sizes, M, 16, 12, dtype, False, device)
    x, w = x.detach(), w.detach()
    out = torch.empty(M, 12, dtype=dtype, device=device)
    for backend in ("triton", "torch"):

        def step(x, w, counts, out, backend=backend):
            return ops.grouped_gemm(x, w, counts, backend=backend, out=out)

        new_counts = torch.tensor([0, 11, 3, 2], device=device)
        second = assert_graph_safe(step, x, w, counts, out, second_args=(x, w, new_counts, out))
        assert_close(second, expected_forward(x, w, [0, 11, 3, 2], False), msg=backend)


def test_loop_backends_are_not_graph_safe(device):
    x, w, counts, _ = make_inputs([3, 4], 9, 8, 8, torch.float32, False, device)
    with pytest.raises(GraphSafetyError):
        assert_graph_safe(
            lambda x, w, c: ops.grouped_gemm(x, w, c, backend="sequential"),
            x.detach(), w.detach(), counts,
        )


def test_opcheck_custom_ops():
    x, w, counts, dy = make_inputs([3, 0, 5], 10, 8, 6, torch.float32, False, "cpu")
    x, w = x.detach(), w.detach()
    out = torch.empty(10, 6)
    torch.library.opcheck(torch.ops.mtp.grouped_gemm_out.default,
                          (x, w, counts, out, False, "reference", None, None, None, "none",
                           7.0, 1.702, None, None, None))  # fmt: skip
    torch.library.opcheck(  # the activation epilogue: h and the activation's output
        torch.ops.mtp.grouped_gemm_out.default,
        (x, w, counts, torch.empty(10, 3), False, "reference", None, torch.empty(10, 6),
         torch.rand(10), "swiglu", 7.0, 1.702, None, None, None),
    )  # fmt: skip
    gather = torch.tensor([4, 0, 2, -1, 1, 3, 0, 2, 4, -1])  # rows of a [5, 8] source x
    torch.library.opcheck(  # fc1 reading its rows through a row index (MoE dispatch fused)
        torch.ops.mtp.grouped_gemm_out.default,
        (x[:5].clone(), w, counts, torch.empty(10, 3), False, "triton", None,
         torch.empty(10, 6), torch.rand(5, 3), "swiglu", 7.0, 1.702, gather, torch.empty(10),
         None),
    )  # fmt: skip
    torch.library.opcheck(  # fc2 storing its rows through a row index (a permutation)
        torch.ops.mtp.grouped_gemm_out.default,
        (x, w, counts, torch.empty(10, 6), False, "triton", None, None, None, "none", 7.0,
         1.702, None, None, torch.randperm(10)),
    )  # fmt: skip
    for accumulate in (False, True):
        torch.library.opcheck(
            torch.ops.mtp.grouped_gemm_wgrad.default,
            (x, dy, counts, torch.zeros(3, 8, 6), "reference", accumulate),
        )


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    """The custom ops trace (fake implementations, autograd) without graph breaks."""
    sizes = [5, 0, 9]
    x, w, counts, dy = make_inputs(sizes, 16, 16, 8, torch.float32, True, device)

    def step(x, w, counts):
        return ops.grouped_gemm(x, w, counts, trans_b=True, backend="triton")

    y = torch.compile(step, backend="aot_eager", fullgraph=True)(x, w, counts)
    assert_close(y, expected_forward(x, w, sizes, True))
    y.backward(dy)
    dx, dw = expected_grads(x, w, sizes, True, dy)
    assert_close(x.grad, dx)
    assert_close(w.grad, dw)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_bad_input_errors():
    x = torch.randn(10, 8)
    w = torch.randn(3, 8, 6)
    c = torch.tensor([3, 3, 4])
    gemm = ops.grouped_gemm
    with pytest.raises(ValueError, match=r"w has 3 experts .* tokens_per_expert has 2"):
        gemm(x, w, c[:2])
    with pytest.raises(TypeError, match="w must have dtype in \\(float32\\), got float16"):
        gemm(x, w.half(), c)
    with pytest.raises(TypeError, match="x must have dtype in"):
        gemm(x.double(), w.double(), c)
    with pytest.raises(TypeError, match="tokens_per_expert must have dtype in \\(int32, int64\\)"):
        gemm(x, w, c.float())
    with pytest.raises(ValueError, match="tokens_per_expert must be 1-D"):
        gemm(x, w, c[None])
    with pytest.raises(ValueError, match="x must be 2-D"):
        gemm(x[None], w, c)
    with pytest.raises(ValueError, match=r"has K=8, but x .* has K=7"):
        gemm(x[:, :7], w, c)
    with pytest.raises(ValueError, match=r"\[E, N, K\] \(trans_b=True\) has K=6"):
        gemm(x, w, c, trans_b=True)
    with pytest.raises(ValueError, match=r"out must have shape \(10, 6\)"):
        gemm(x, w, c, out=torch.empty(10, 5))
    with pytest.raises(TypeError, match="out must have dtype"):
        gemm(x, w, c, out=torch.empty(10, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="unknown backend 'cublas'"):
        gemm(x, w, c, backend="cublas")
    with pytest.raises(TypeError, match="trans_b must be a bool"):
        gemm(x, w, c, trans_b=1)


@pytest.mark.parametrize("backend", ["triton", "reference", "sequential", "torch"])
def test_data_dependent_count_checks(backend, device):
    x = torch.randn(10, 8, device=device)
    w = torch.randn(3, 8, 6, device=device)
    with pytest.raises(ValueError, match="tokens_per_expert sums to 11 rows but x has only 10"):
        ops.grouped_gemm(x, w, torch.tensor([3, 4, 4], device=device), backend=backend,
                         validate="sync")  # fmt: skip
    with pytest.raises(ValueError, match="must be non-negative, got a count of -1"):
        ops.grouped_gemm(x, w, torch.tensor([3, -1, 4], device=device), backend=backend,
                         validate="sync")  # fmt: skip
    if device.type == "cpu":  # default: on the device (a device-side assert on CUDA; at once here)
        for bad in ([3, 4, 4], [3, -1, 4]):
            with pytest.raises(RuntimeError, match="tokens_per_expert must be non-negative and "
                                                   "sum to at most x.shape.0. = 10 rows"):
                ops.grouped_gemm(x, w, torch.tensor(bad), backend=backend)
    if backend == "triton":
        # validate=False: no host read; the kernel still never touches rows past M.
        y = ops.grouped_gemm(x, w, torch.tensor([3, 4, 9], device=device), backend=backend,
                             validate=False)
        assert_close(y[:7], expected_forward(x, w, [3, 4], False)[:7])
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_default_arguments_never_sync(backend, device):
    """The project's rule: 0 host syncs with default arguments (the counts' check runs on the
    device), forward and backward, with and without the epilogues; the MLP entry too."""
    x, w, counts, dy = make_inputs(SIZES, 45, 36, 30, torch.float32, False, device)
    bias = torch.randn(len(SIZES), 30, device=device, requires_grad=True)
    probs = torch.rand(45, device=device, requires_grad=True)
    for kw in ({}, {"bias": bias}, {"bias": bias, "activation": "swiglu", "probs": probs}):
        with count_host_syncs() as fwd:
            y = ops.grouped_gemm(x, w, counts, backend=backend, **kw)
        with count_host_syncs() as bwd:
            y.backward(torch.ones_like(y))
        assert fwd.count == 0 and bwd.count == 0, (kw.keys(), fwd, bwd)
    if backend == "triton":
        w2 = torch.randn(len(SIZES), 15, 36, device=device, requires_grad=True)
        with count_host_syncs() as fwd:
            y = ops.grouped_mlp(x, w, w2, counts, probs, bias, backend="triton")
        with count_host_syncs() as bwd:
            y.backward(torch.ones_like(y))
        assert fwd.count == 0 and bwd.count == 0, (fwd, bwd)


# --------------------------------------------------------------------------------------------
# The CUTLASS hook
# --------------------------------------------------------------------------------------------


def _fake_cutlass(available=(True, ""), log=None):
    """A stand-in for ``mtp.ops.grouped_gemm.cutlass`` with the agreed interface, in float64."""
    module = types.ModuleType("mtp.ops.grouped_gemm.cutlass")
    log = [] if log is None else log

    def grouped_gemm(x, w, tokens_per_expert, trans_b, out, *, validate=True):
        assert validate is False  # the op has validated the counts already
        log.append(("fwd", trans_b, tuple(out.shape), tokens_per_expert.device))
        sizes = tokens_per_expert.tolist()
        out.copy_(expected_forward(x, w, sizes, trans_b))

    def grouped_gemm_wgrad(x, dy, tokens_per_expert, out, *, validate=True):
        assert validate is False
        log.append(("wgrad", tuple(out.shape)))
        row = 0
        for e, m in enumerate(tokens_per_expert.tolist()):
            out[e] = x[row : row + m].double().T @ dy[row : row + m].double()
            row += m

    module.is_available = lambda: available
    module.grouped_gemm = grouped_gemm
    module.grouped_gemm_wgrad = grouped_gemm_wgrad
    return module, log


@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
def test_cutlass_hook_routes_forward_and_backward(trans_b, monkeypatch):
    module, log = _fake_cutlass()
    monkeypatch.setitem(sys.modules, "mtp.ops.grouped_gemm.cutlass", module)
    sizes, M, K, N = [4, 0, 6], 12, 8, 16
    x, w, counts, dy = make_inputs(sizes, M, K, N, torch.bfloat16, trans_b, "cpu")
    y = ops.grouped_gemm(x, w, counts, trans_b=trans_b, backend="cutlass")
    assert_close(y, expected_forward(x, w, sizes, trans_b))
    y.backward(dy)
    dx, dw = expected_grads(x, w, sizes, trans_b, dy)
    assert_close(x.grad, dx)
    assert_close(w.grad, dw)
    wgrad_shape = (3, N, K) if trans_b else (3, K, N)
    assert log == [
        ("fwd", trans_b, (M, N), torch.device("cpu")),
        ("fwd", not trans_b, (M, K), torch.device("cpu")),
        ("wgrad", wgrad_shape),
    ]


def test_cutlass_errors(monkeypatch):
    x = torch.randn(10, 8, dtype=torch.bfloat16)
    w = torch.randn(3, 8, 6, dtype=torch.bfloat16)
    c = torch.tensor([3, 3, 4])
    monkeypatch.setitem(sys.modules, "mtp.ops.grouped_gemm.cutlass", None)  # its import raises
    with pytest.raises(ValueError, match="CUTLASS extension, which is not built.*MTP_BUILD_CUDA=1"):
        ops.grouped_gemm(x, w, c, backend="cutlass")
    module, _ = _fake_cutlass(available=(False, "no sm_90/sm_100 GPU (found sm_80)"))
    monkeypatch.setitem(sys.modules, "mtp.ops.grouped_gemm.cutlass", module)
    with pytest.raises(ValueError, match=r"not available here: no sm_90/sm_100 GPU \(found sm_80"):
        ops.grouped_gemm(x, w, c, backend="cutlass")
    module, _ = _fake_cutlass()
    monkeypatch.setitem(sys.modules, "mtp.ops.grouped_gemm.cutlass", module)
    with pytest.raises(TypeError, match="float16 and bfloat16 inputs, got float32"):
        ops.grouped_gemm(x.float(), w.float(), c, backend="cutlass")
    assert "cutlass" in GROUPED_GEMM_BACKENDS


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation for sm_90 / sm_100
# --------------------------------------------------------------------------------------------


def _forward_build(dtype_name: str, cfg, trans_b=False, persistent=False,
                   bias=False):
    signature = {
        "a_ptr": f"*{dtype_name}", "b_ptr": f"*{dtype_name}", "c_ptr": f"*{dtype_name}",
        "bias_ptr": f"*{dtype_name}", "s_ptr": "*i32", "counts_ptr": "*i32", "M": "i32", "N": "i32",
        "K": "i32", "E": "i32",
        "stride_am": "i32", "stride_be": "i32", "stride_cm": "i32",
        ("stride_bn" if trans_b else "stride_bk"): "i32",
    }
    constexprs = {
        "stride_ak": 1, "stride_cn": 1, ("stride_bk" if trans_b else "stride_bn"): 1,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
        "BLOCK_E": 64, "GROUP_M": cfg.group_m, "PERSISTENT": persistent,
        "UPCAST_DOT": False, "DOT_PRECISION": "ieee", "HAS_BIAS": bias, "SCATTER": False,
    }
    strides = [k for k in signature if k.startswith("stride")]
    return compile_for_targets(
        pointer.grouped_gemm_kernel, signature, constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        divisible_by_16=strides + ["N", "K"],  # as a launch on 4096-wide aligned operands
    )


def _wgrad_build(dtype_name: str, cfg, gather: bool = False):
    """The pointer weight gradient (``gather``: ``a``'s rows read through a row index, as
    fc1's weight gradient in an MoE layer whose dispatch gathers inside the GEMM)."""
    signature = {
        "a_ptr": f"*{dtype_name}", "b_ptr": f"*{dtype_name}", "c_ptr": f"*{dtype_name}",
        "counts_ptr": "*i32", "g_ptr": "*i64", "M": "i32", "P": "i32", "Q": "i32", "E": "i32",
        "stride_am": "i32", "stride_bm": "i32", "stride_ce": "i32", "stride_cp": "i32",
    }
    constexprs = {
        "stride_ap": 1, "stride_bq": 1, "stride_cq": 1,
        "BLOCK_P": cfg.block_m, "BLOCK_Q": cfg.block_n, "BLOCK_R": cfg.block_k,
        "BLOCK_E": 64, "GROUP_P": cfg.group_m, "UPCAST_DOT": False, "DOT_PRECISION": "ieee",
        "ACCUMULATE": False, "GATHER_A": gather,
    }
    strides = [k for k in signature if k.startswith("stride")]
    return compile_for_targets(
        pointer.grouped_wgrad_kernel, signature, constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        divisible_by_16=strides + ["P", "Q"],
    )


def _check_tensor_core_builds(builds) -> None:
    assert "wgmma" in builds[90].ptx, "no wgmma in the sm_90a PTX"
    assert "tcgen05" in builds[100].ptx, "no tcgen05 in the sm_100a PTX"
    for cc, build in builds.items():
        assert build.arch == f"sm_{cc}a"
        assert build.fits_shared_memory, f"sm_{cc}: {build.shared} bytes of shared memory"
        info = build.ptxas()
        assert info is None or not info.spills, f"sm_{cc} spills:\n{info.output}"


@pytest.mark.parametrize(
    "which",
    ["forward_bf16_small_groups", "forward_bf16_large_groups_bias", "wgrad_bf16",
     "wgrad_bf16_gathered"],
)
def test_aot_compiles_with_tensor_cores(which):
    if which.startswith("forward"):
        M = 100 if "small" in which else 1 << 20
        cfg = forward_config(torch.bfloat16, M, 4096, 4096, 8)
        builds = _forward_build("bf16", cfg, bias=which.endswith("bias"))
    else:
        cfg = wgrad_config(torch.bfloat16, 4096, 4096)
        builds = _wgrad_build("bf16", cfg, gather=which.endswith("gathered"))
    _check_tensor_core_builds(builds)


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_aot_compiles_every_variant(dtype_name, dtype):
    for M in (100, 1 << 20):
        cfg = forward_config(dtype, M, 4096, 4096, 8)
        for trans_b in (False, True):
            for persistent in (False, True):
                _check_tensor_core_builds(_forward_build(dtype_name, cfg, trans_b, persistent))
    _check_tensor_core_builds(_wgrad_build(dtype_name, wgrad_config(dtype, 4096, 4096)))
    for builds in (
        _forward_build("fp32", forward_config(torch.float32, 100, 4096, 4096, 8)),
        _wgrad_build("fp32", wgrad_config(torch.float32, 4096, 4096)),
    ):
        assert all(b.fits_shared_memory for b in builds.values())


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------

GPU_BACKENDS = ["triton", "torch", "multistream", "sequential", "reference"]


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_match_float64(backend, dtype, trans_b):
    sizes = [0, 700, 3, 0, 1290, 64, 1, 0]  # skewed, empty experts, partial tiles
    check_against_float64(backend, sizes, 2100, 264, 200, dtype, trans_b, torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_host_counts_and_persistent():
    sizes = [100, 0, 333, 17]
    x, w, counts, _ = make_inputs(sizes, 500, 128, 256, torch.bfloat16, False, "cuda")
    for backend in ("triton", "torch", "multistream"):
        y = ops.grouped_gemm(x, w, counts.cpu(), backend=backend)
        assert_close(y, expected_forward(x, w, sizes, False), msg=backend)
    out = torch.full((500, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    with override(persistent=True):
        ops.grouped_gemm(x.detach(), w.detach(), counts, backend="triton", out=out)
    assert_close(out, expected_forward(x, w, sizes, False))


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True], ids=["w_KN", "w_NK"])
def test_gpu_many_small_experts(trans_b):
    """Decode-like routing: 64 experts, a few rows each (the automatic persistent schedule)."""
    g = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 9, (64,), generator=g).tolist()
    check_against_float64(
        "triton", sizes, sum(sizes) + 3, 256, 512, torch.bfloat16, trans_b, torch.device("cuda")
    )


@pytest.mark.gpu
def test_gpu_kernel_counts():
    """One GEMM kernel for the triton forward (plus the tile map on sm_90+); one GEMM kernel per
    expert for the loops."""
    E = 8
    sizes = [64] * E
    x, w, counts, _ = make_inputs(sizes, 64 * E, 128, 128, torch.bfloat16, False, "cuda")

    def kernels_launched(fn) -> list[str]:
        fn()  # warm up (compilation, cuBLAS handles)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    out = torch.empty(64 * E, 128, dtype=torch.bfloat16, device="cuda")  # no poison fill
    with torch.no_grad():
        names = kernels_launched(
            lambda: ops.grouped_gemm(x, w, counts, backend="triton", out=out, validate=False)
        )
        # the pointer kernel, or (sm_90+) the tile map and the TMA kernel
        assert [n.split("_kernel")[0] for n in names] in (
            ["grouped_gemm"], ["tile_map", "grouped_gemm_tma"]), names
        for backend in ("sequential", "multistream"):
            names = kernels_launched(
                lambda b=backend: ops.grouped_gemm(x, w, counts, backend=b, out=out)
            )
            skip = ("memcpy", "memset", "fill")
            gemms = [n for n in names if not any(s in n.lower() for s in skip)]
            assert len(gemms) == E, (backend, names)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing():
    sizes = [10, 0, 30, 5]
    x, w, counts, _ = make_inputs(sizes, 64, 64, 64, torch.bfloat16, False, "cuda")
    x, w = x.detach(), w.detach()
    out = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
    ops.grouped_gemm(x, w, counts, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.grouped_gemm(x, w, counts, backend="triton", out=out)
    for new in ([0, 40, 2, 7], [64, 0, 0, 0], [0, 0, 0, 0]):
        counts.copy_(torch.tensor(new))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected_forward(x, w, new, False), msg=str(new))


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_int64_offsets():
    """x with more than 2^31 elements: row offsets must not overflow."""
    M, K, N = (1 << 31) // 4096 + 4096, 4096, 64
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2, K, N, dtype=torch.bfloat16, device="cuda") / K**0.5
    counts = torch.tensor([128, M - 128 - 5], device="cuda")
    y = ops.grouped_gemm(x, w, counts, backend="triton")
    tail = slice(M - 300, M - 5)
    assert_close(y[tail], x[tail].double() @ w[1].double())
    assert torch.equal(y[M - 5 :], torch.zeros_like(y[M - 5 :]))
