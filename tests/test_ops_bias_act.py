"""mtp.ops.bias_gelu / bias_swiglu: Triton kernels (interpreter on CPU) against float64 PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp import settings
import mtp.ops
from mtp.kernels import bias_act as kernels
from mtp.testing import assert_close, assert_graph_safe, compile_for_targets

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTS = ["none", "tanh", "swiglu"]


def _op(act, x, bias, backend="triton"):
    if act == "swiglu":
        return mtp.ops.bias_swiglu(x, bias, backend=backend)
    return mtp.ops.bias_gelu(x, bias, act, backend=backend)


def _reference64(act, x, bias):
    """The float64 reference on the same (rounded) inputs, with float64 autograd leaves."""
    x64 = x.detach().double().requires_grad_(True)
    b64 = None if bias is None else bias.detach().double().requires_grad_(True)
    u = x64 if b64 is None else x64 + b64
    if act == "swiglu":
        a, g = torch.chunk(u, 2, dim=-1)
        y = F.silu(a) * g
    else:
        y = F.gelu(u, approximate=act)
    return y, x64, b64


def _check(act, x, bias, backend="triton", dy=None):
    """Forward and backward of the op against float64, with the tolerance of x's dtype."""
    x = x.detach().requires_grad_(True)
    if bias is not None:
        bias = bias.detach().requires_grad_(True)
    y = _op(act, x, bias, backend)
    ref, x64, b64 = _reference64(act, x, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert_close(y, ref, x.dtype, msg=f"{act} forward")
    dy = torch.randn(y.shape, dtype=x.dtype, device=x.device) if dy is None else dy
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad, x.dtype, msg=f"{act} dx")
    if bias is not None:
        assert bias.grad.dtype == bias.dtype
        assert_close(bias.grad, b64.grad, bias.dtype, msg=f"{act} dbias")
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_forward_backward_matches_float64(act, dtype, device):
    torch.manual_seed(0)
    # 1030 columns: two column blocks, the second ragged; 3-D leading dims.
    for shape in [(2, 3, 70), (9, 1030)]:
        x = torch.randn(shape, dtype=dtype, device=device) * 2
        bias = torch.randn(shape[-1], dtype=dtype, device=device)
        _check(act, x, bias)


@pytest.mark.parametrize("act", ACTS)
def test_without_bias_and_mixed_bias_dtype(act, device):
    torch.manual_seed(1)
    x = torch.randn(5, 6, 48, dtype=torch.bfloat16, device=device)
    _check(act, x, None)
    # bias in fp32 on a bf16 activation: math in fp32, dbias in the bias dtype
    _check(act, x, torch.randn(48, dtype=torch.float32, device=device))


def test_dbias_over_many_row_programs_is_deterministic(device):
    torch.manual_seed(2)
    n = kernels.MAX_BLOCK_N + 40  # two column blocks, the second ragged
    rows = 3 * kernels.MIN_ROWS_PER_PROGRAM + 3  # 4 row programs, the last one ragged
    assert kernels.row_programs(rows, n, 2 * kernels.CPU_PROGRAMS) == 4
    x = torch.randn(rows, n, device=device)
    bias = torch.randn(n, device=device)
    dy = torch.randn(rows, n, device=device)
    _check("tanh", x, bias, dy=dy)
    grads = []
    for _ in range(2):
        b = bias.clone().requires_grad_(True)
        mtp.ops.bias_gelu(x, b, "tanh", backend="triton").backward(dy)
        grads.append(b.grad)
    assert torch.equal(grads[0], grads[1])


def test_row_programs_fill_the_device_and_cover_the_rows():
    for rows in [1, 7, 1000, 123457]:
        for n in [1, 100, 1024, 4096, 12288, 28672]:
            for programs in [8, 132 * 2, 148 * 4]:
                r = kernels.row_programs(rows, n, programs)
                block_m, block_n = kernels.tile_shape(n)
                cols = -(-n // block_n)
                most = min(-(-rows // block_m), -(-rows // kernels.MIN_ROWS_PER_PROGRAM))
                assert 1 <= r <= most
                # about `programs` programs in all, unless there is too little work
                assert cols * r <= max(programs, cols)
                assert r == most or cols * r > programs - cols


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("act", ACTS)
def test_extreme_values(act, device):
    values = [-1e4, -100.0, -30.0, -8.0, -1.0, -1e-4, 0.0, 1e-4, 1.0, 8.0, 30.0, 100.0, 1e4, 0.5]
    x = torch.tensor([values, values[::-1]], device=device)
    _check(act, x, torch.zeros(x.shape[-1], device=device))
    # Values at the edge of fp32: no NaN where PyTorch (in fp32) is finite.
    huge = torch.tensor([[3e38, -3e38, 1e30, -1e30]], device=device)
    y = _op(act, huge, None)
    if act == "swiglu":
        a, g = huge.chunk(2, -1)
        expected = F.silu(a) * g
    else:
        expected = F.gelu(huge, approximate=act)
    finite = torch.isfinite(expected)
    assert_close(y[finite], expected[finite])


@pytest.mark.parametrize("act", ACTS)
def test_strided_and_non_contiguous_inputs(act, device):
    torch.manual_seed(3)
    big = torch.randn(6, 4, 2 * 40, dtype=torch.float16, device=device)
    bias = torch.randn(40, dtype=torch.float16, device=device)
    _check(act, big[:, 1:3, :40], bias)  # rows with a stride, last dim contiguous
    _check(act, big[:, :, ::2], bias)  # last dim strided: copied
    _check(act, big[..., :40].transpose(0, 1), bias)  # leading dims transposed
    # dy broadcast from a scalar (stride 0)
    x = big[0, :, :40].detach().requires_grad_(True)
    _op(act, x, None).sum().backward()
    ref, x64, _ = _reference64(act, x, None)
    ref.sum().backward()
    assert_close(x.grad, x64.grad, torch.float16)


@pytest.mark.parametrize("act", ACTS)
def test_empty(act, device):
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    bias = torch.randn(16, device=device, requires_grad=True)
    y = _op(act, x, bias)
    assert y.shape == (0, 3, 8 if act == "swiglu" else 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(bias.grad, torch.zeros(16, device=device))


@pytest.mark.parametrize("act", ACTS)
def test_reference_and_auto_backends(act, device, monkeypatch):
    settings.configure(backend=None)
    torch.manual_seed(4)
    x = torch.randn(7, 36, dtype=torch.bfloat16, device=device)
    bias = torch.randn(36, dtype=torch.bfloat16, device=device)
    _check(act, x, bias, backend="reference")
    _check(act, x, bias, backend="auto")
    ref_fn = mtp.ops.bias_act.bias_swiglu_reference if act == "swiglu" else None
    expected = ref_fn(x, bias) if ref_fn else mtp.ops.bias_act.bias_gelu_reference(x, bias, act)
    assert torch.equal(_op(act, x, bias, "reference"), expected)


def test_opcheck_and_compile(device):
    torch.manual_seed(5)
    x = torch.randn(3, 20, device=device, requires_grad=True)
    bias = torch.randn(20, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.mtp.bias_gelu.default, (x, bias, "tanh", "triton"))
    torch.library.opcheck(torch.ops.mtp.bias_swiglu.default, (x, None, "triton"))

    def fn(x, bias):
        return mtp.ops.bias_swiglu(x, bias, backend="triton").sum() + mtp.ops.bias_gelu(
            x, bias, backend="triton"
        ).sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    gx, gb = torch.autograd.grad(compiled(x, bias), (x, bias))
    ex, eb = torch.autograd.grad(fn(x, bias), (x, bias))
    assert_close(gx, ex)
    assert_close(gb, eb)


def test_graph_safe(device):
    x = torch.randn(4, 32, device=device)
    bias = torch.randn(32, device=device)
    out = torch.empty(4, 16, device=device)

    def step(x, bias):
        out.copy_(mtp.ops.bias_swiglu(x, bias, backend="triton"))
        return out

    assert_graph_safe(step, x, bias)


def test_bad_inputs(device):
    x = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="approximate must be one of"):
        mtp.ops.bias_gelu(x, None, "erf")
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        mtp.ops.bias_gelu(x, torch.randn(5, device=device))
    with pytest.raises(ValueError, match="bias must be 1-D"):
        mtp.ops.bias_gelu(x, torch.randn(1, 6, device=device))
    with pytest.raises(ValueError, match="bias must be on"):
        mtp.ops.bias_gelu(x, torch.randn(6, device="meta"))
    with pytest.raises(TypeError, match="x must have dtype"):
        mtp.ops.bias_gelu(x.long(), None)
    with pytest.raises(TypeError, match="bias must have dtype"):
        mtp.ops.bias_gelu(x, torch.ones(6, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="must be even"):
        mtp.ops.bias_swiglu(torch.randn(4, 7, device=device), None)
    with pytest.raises(ValueError, match="at least one dimension"):
        mtp.ops.bias_gelu(torch.tensor(1.0, device=device), None)
    with pytest.raises(ValueError, match="unknown backend"):
        mtp.ops.bias_gelu(x, None, backend="cuda")


def aot_cases(dtype: str = "bf16"):
    """``(name, kernel, signature, constexprs, num_warps)`` of every kernel at its default tile."""
    block_m, block_n = kernels.tile_shape(1 << 16)
    bwd_m, bwd_n = kernels.tile_shape(1 << 16, kernels.BWD_TILE_ELEMENTS)
    io = dict(M="i32", N="i32")
    cases = []
    for act, code in kernels.ACTIVATIONS.items():
        cases.append((
            f"bias_act_fwd[{act}]",
            kernels._bias_act_fwd_kernel,
            dict(x_ptr=f"*{dtype}", b_ptr=f"*{dtype}", y_ptr=f"*{dtype}", stride_xm="i64",
                 stride_ym="i64", **io),
            dict(HAS_BIAS=True, ACT=code, BLOCK_M=block_m, BLOCK_N=block_n),
            kernels.NUM_WARPS,
        ))
        cases.append((
            f"bias_act_bwd[{act}]",
            kernels._bias_act_bwd_kernel,
            dict(dy_ptr=f"*{dtype}", x_ptr=f"*{dtype}", b_ptr=f"*{dtype}", dx_ptr=f"*{dtype}",
                 part_ptr="*fp32", stride_dym="i64", stride_xm="i64", stride_dxm="i64",
                 **io),
            dict(HAS_BIAS=True, COMPUTE_DBIAS=True, ACT=code, BLOCK_M=bwd_m, BLOCK_N=bwd_n),
            kernels.NUM_WARPS,
        ))
    cases.append((
        "column_sum",
        kernels._column_sum_kernel,
        dict(part_ptr="*fp32", out_ptr=f"*{dtype}", G="i32", W="i32"),
        dict(BLOCK=kernels.COLSUM_BLOCK),
        kernels.NUM_WARPS,
    ))
    return cases


def ptxas_table(cases):
    """``[(name, sm, registers, spill stores, spill loads)]``; asserts each build is sane."""
    rows = []
    for name, kernel, signature, constexprs, num_warps, *options in cases:
        builds = compile_for_targets(kernel, signature, constexprs, num_warps=num_warps,
                                     **(options[0] if options else {}))  # fmt: skip
        for cc, build in builds.items():
            assert build.arch == f"sm_{cc}a" and build.fits_shared_memory, (name, cc)
            info = build.ptxas()
            if info is None:
                pytest.skip("no ptxas available")
            rows.append((name, build.arch, info.registers, info.spill_stores, info.spill_loads))
    return rows


def test_compiles_for_sm90_and_sm100_without_spills():
    """bf16 in/out, for sm_90a and sm_100a."""
    for name, arch, registers, stores, loads in ptxas_table(aot_cases()):
        assert stores == loads == 0, f"{name} spills on {arch}: {stores} B stored, {loads} B loaded"


# --- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_gpu_large_shapes(act):
    torch.manual_seed(6)
    x = torch.randn(4, 1024, 4224, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(4224, device="cuda", dtype=torch.bfloat16)
    _check(act, x, bias)


def capture_graph(step):
    """Run ``step`` once on a side stream (compiles the kernels), then capture it in a CUDA
    graph; returns ``(graph, outputs of the captured call)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    torch.manual_seed(7)
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        y = mtp.ops.bias_swiglu(x, bias)
        return (y, *torch.autograd.grad(y, (x, bias), dy))

    graph, outs = capture_graph(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
    graph.replay()
    for got, expected in zip(outs, step()):
        assert torch.equal(got, expected)
