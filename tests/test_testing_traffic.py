"""The byte-traffic instrument (mtp.testing.traffic) on kernels whose traffic is known exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mtp.testing.traffic import count_traffic, unique_bytes


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _read_neighbour_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """Each program reads its own block and its right neighbour's (cyclically): 2 reads/byte."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    nxt = ((pid + 1) % tl.num_programs(0)) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(x_ptr + offs)
    b = tl.load(x_ptr + nxt)
    tl.store(y_ptr + offs, a + b)


@triton.jit
def _reload_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """Reads its block twice within one program: unique bytes count it once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(x_ptr + offs)
    b = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, a * b)


@pytest.mark.parametrize(
    "dtype,n", [(torch.float32, 1000), (torch.float16, 4096), (torch.int64, 1)]
)
def test_copy_kernel_is_exactly_at_floor(dtype, n):
    x = torch.arange(n).to(dtype)
    y = torch.empty_like(x)
    with count_traffic() as t:
        _copy_kernel[(triton.cdiv(n, 256),)](x, y, n, BLOCK=256)
    assert torch.equal(y, x)
    floor = 2 * n * x.element_size()
    assert t.ratio(floor) == 1.0
    assert t.ratio(floor, per="launch") == 1.0
    assert t.bytes_read == t.bytes_written == n * x.element_size()
    assert t.num_launches == 1 and t.num_aten_ops == 0 and t.num_host_syncs == 0
    launch = t.launches[0]
    assert launch.name == "_copy_kernel" and launch.programs == triton.cdiv(n, 256)


def test_read_by_two_programs_counts_twice():
    n, block = 1024, 128
    x = torch.randn(n, dtype=torch.float64)
    y = torch.empty_like(x)
    with count_traffic() as t:
        _read_neighbour_kernel[(n // block,)](x, y, n, BLOCK=block)
    torch.testing.assert_close(y, x + x.roll(-block), rtol=0, atol=0)
    launch = t.launches[0]
    assert launch.read_program == 2 * n * 8  # every byte read by two programs
    assert launch.read_launch == n * 8  # once per launch
    assert launch.write_program == launch.write_launch == n * 8
    assert t.ratio(2 * n * 8) == 1.5  # floor: read x + write y once
    reads_only = launch.read_program / (n * 8)
    assert reads_only == 2.0


def test_reread_in_one_program_counts_once_and_launches_add_up():
    n = 512
    x = torch.randn(n)
    y = torch.empty_like(x)
    with count_traffic() as t:
        _reload_kernel[(4,)](x, y, BLOCK=128)
        _reload_kernel[(4,)](x, y, BLOCK=128)  # a second launch re-reads: counts again
    assert t.num_launches == 2
    assert t.ratio(2 * n * 4) == 2.0
    assert t.ratio(2 * n * 4, per="launch") == 2.0


def test_aten_ops_bytes_and_syncs():
    x = torch.randn(100, 10)
    with count_traffic() as t:
        y = x * 2  # reads 4000 B, writes 4000 B
        z = y.view(-1)  # a view: no device work
        s = z.sum()  # reads 4000 B, writes 4 B
        s.item()  # one host sync
    assert [a.name for a in t.aten] == ["aten::mul", "aten::sum"]
    assert t.aten_bytes == 4000 + 4000 + 4000 + 4
    assert t.num_host_syncs == 1 and t.device_ops == 2
    summary = t.summary(floor=8000)
    assert summary["bytes_over_floor"] == pytest.approx(12004 / 8000, rel=1e-4)


def test_unique_bytes_mixed_sizes_and_overlap():
    a = np.array([0, 4, 8], dtype=np.uint64)
    b = np.array([2], dtype=np.uint64)  # overlaps bytes 2..5 with the 4-byte elements
    assert unique_bytes([(a, 4)])[0] == 12
    assert unique_bytes([(a, 4), (b, 4)])[0] == 12
    assert unique_bytes([(a, 4), (np.array([100], dtype=np.uint64), 2)])[0] == 14
    assert unique_bytes([])[0] == 0


def test_ratio_rejects_bad_arguments():
    with count_traffic() as t:
        pass
    with pytest.raises(ValueError, match="floor"):
        t.ratio(0)
    with pytest.raises(ValueError, match="per"):
        t.ratio(1, per="warp")
