"""The ``torch`` grouped GEMM backend stores zeros only where ``grouped_mm`` wrote nothing.

* the two fill kernels under the interpreter: the tail rows / empty groups become exact zeros,
  every other element keeps its (NaN-poisoned) value, so nothing else is stored;
* the backend's forward and weight gradient issue them instead of a ``masked_fill`` over the
  whole output (a full extra pass that biased the "vs F.grouped_mm" row);
* both kernels compile ahead of time for sm_90a / sm_100a.
"""

from __future__ import annotations

import pytest
import torch

from mtp.bench.counting import count_ops
from mtp.kernels.grouped_gemm_details import fill
from mtp.ops.grouped_gemm import grouped_gemm, torch_grouped_mm
from mtp.testing import compile_for_targets


@pytest.mark.parametrize("M, N, total", [(70, 300, 37), (64, 5, 64), (33, 17, 0), (1, 1, 0)])
def test_zero_tail_rows_stores_only_the_tail(M, N, total):
    y = torch.full((M, N), float("nan"))
    offs = torch.tensor([total // 3, total], dtype=torch.int32)
    fill.zero_tail_rows(y, offs)
    assert torch.equal(y[total:], torch.zeros(M - total, N))
    assert torch.isnan(y[:total]).all(), "a row before offs[-1] was written"


def test_zero_empty_groups_stores_only_empty_groups():
    counts = torch.tensor([0, 5, -1, 3, 0], dtype=torch.int64)
    c = torch.full((5, 7, 300), float("nan"), dtype=torch.bfloat16)
    fill.zero_empty_groups(c, counts)
    for e, n in enumerate(counts.tolist()):
        if n <= 0:
            assert torch.equal(c[e], torch.zeros_like(c[e])), f"group {e}"
        else:
            assert torch.isnan(c[e]).all(), f"non-empty group {e} was written"


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="unit column stride"):
        fill.zero_tail_rows(torch.zeros(4, 6).t(), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        fill.zero_empty_groups(torch.zeros(2, 3, 4).transpose(1, 2), torch.zeros(2))


@pytest.mark.skipif(torch_grouped_mm() is None, reason="this PyTorch has no grouped_mm")
def test_torch_backend_fills_no_full_pass():
    """Forward and weight gradient: the fill kernels, no masked_fill / where over the output."""
    counts = torch.tensor([0, 9, 4, 0], dtype=torch.int64)
    x = torch.randn(16, 24, requires_grad=True)
    w = torch.randn(4, 24, 8, requires_grad=True)
    with count_ops() as counted:
        y = grouped_gemm(x, w, counts, backend="torch")
        y.backward(torch.randn_like(y))
    full_passes = {op for op in counted.aten if "masked_fill" in op or "where" in op}
    assert not full_passes, f"full passes over the output: {full_passes}"
    assert counted.triton["zero_tail_rows_kernel"] == 2  # y, and dx (the data gradient's rows)
    assert counted.triton["zero_empty_groups_kernel"] == 1
    assert torch.equal(y[13:], torch.zeros(3, 8))
    assert torch.equal(w.grad[0], torch.zeros(24, 8)) and torch.equal(w.grad[3], w.grad[0])


def test_fill_kernels_compile_for_hopper_and_blackwell():
    builds = [
        compile_for_targets(
            fill.zero_tail_rows_kernel,
            {"y_ptr": "*bf16", "offs_ptr": "*i32", "M": "i32", "N": "i32", "E": "i32",
             "stride_m": "i32"},
            {"BLOCK_M": fill._BLOCK_M, "BLOCK_N": fill._BLOCK_N},
        ),
        compile_for_targets(
            fill.zero_empty_groups_kernel,
            {"c_ptr": "*bf16", "counts_ptr": "*i64", "PQ": "i32", "stride_e": "i32"},
            {"BLOCK": fill._BLOCK, "SPLITS": fill._SPLITS},
        ),
    ]  # fmt: skip
    for per_target in builds:
        for cc, build in per_target.items():
            assert build.arch == f"sm_{cc}a"
            assert "st.global" in build.ptx, f"sm_{cc}: no global store"
            info = build.ptxas()
            assert info is None or not info.spills, f"sm_{cc} spills:\n{info.output}"
