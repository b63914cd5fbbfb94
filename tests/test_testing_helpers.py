"""The shared test helpers, including proof that each one can fail."""

import os

import pytest
import torch
import triton
import triton.language as tl

import mtp.utils as mu
from mtp.testing import (
    GraphSafetyError,
    KernelCompileError,
    RankFailedError,
    assert_close,
    assert_graph_safe,
    compile_for_targets,
    count_collectives,
    count_host_syncs,
    ptxas_info,
    run_distributed,
    tolerance,
)

# --- assert_close ----------------------------------------------------------------------------


def test_assert_close_passes_within_tolerance():
    e = torch.randn(64, 32, dtype=torch.float64)
    assert_close(e.to(torch.bfloat16), e)
    assert_close(e.to(torch.float16), e)
    assert_close(e.float(), e)


def test_assert_close_reports_error_and_location():
    e = torch.randn(4, 5, dtype=torch.float64)
    a = e.float().clone()
    a[1, 2] += 0.5
    with pytest.raises(AssertionError) as info:
        assert_close(a, e, msg="dx")
    text = str(info.value)
    assert text.startswith("dx: ")
    assert "1 / 20" in text
    assert "max abs error: 0.5" in text
    assert "at (1, 2)" in text
    assert "RMS rel error" in text
    assert "max rel error" in text


def test_assert_close_catches_nan_and_inf_and_shape():
    e = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(AssertionError, match="1 NaN"):
        assert_close(torch.tensor([0.0, float("nan"), 0.0]), e)
    with pytest.raises(AssertionError, match="1 inf"):
        assert_close(torch.tensor([0.0, float("inf"), 0.0]), e)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(torch.zeros(2), e)
    both = torch.tensor([float("nan"), float("-inf")])
    assert_close(both.float(), both.double())


def test_assert_close_dtype_table_is_ordered():
    assert tolerance(torch.float32)[0] < tolerance(torch.float16)[0] < tolerance(torch.bfloat16)[0]
    assert tolerance(torch.int64) == (0.0, 0.0)
    e = torch.ones(4, dtype=torch.float64)
    with pytest.raises(AssertionError):  # a bf16-sized error fails the fp32 tolerance
        assert_close((e * 1.004).float(), e)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]))


# --- run_distributed (functions at module level: they are pickled to the children) ----------


def _all_reduce_rank(rank, world_size, scale):
    import torch.distributed as dist

    t = torch.tensor([float(rank) * scale])
    with count_collectives() as log:
        dist.all_reduce(t)
        gathered = torch.empty(world_size * 3)
        name = "all_gather_into_tensor"
        getattr(dist, name)(gathered, torch.full((3,), float(rank)))
    counts = (log.count("all_reduce"), log.count(name), log.count())
    return t.item(), counts, log.nbytes(), os.environ["WORLD_SIZE"], gathered.tolist()


def _rank_one_raises(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("bad shard on rank one")
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def _rank_zero_hangs(rank, world_size):
    import time

    if rank == 0:
        time.sleep(600)


def test_run_distributed_returns_per_rank_values():
    out = run_distributed(_all_reduce_rank, 2, 10.0)
    # all_gather_into_tensor counts once even where torch implements it with all_gather_single
    expected = (10.0, (1, 1, 2), 4 + 12, "2", [0.0] * 3 + [1.0] * 3)
    assert out == [expected, expected]


def _rank_and_size(rank, world_size):
    return rank, world_size


def test_run_distributed_retries_a_taken_rendezvous_port(monkeypatch):
    """The port free_port() chose is taken before rank 0 binds it (a parallel test): the launch
    is retried on a new port instead of failing with EADDRINUSE."""
    import socket

    import mtp.testing.distributed as testing

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port])
        real, chosen = testing.free_port, []
        monkeypatch.setattr(testing, "free_port",
                            lambda: chosen.append(next(ports, None) or real()) or chosen[-1])
        assert run_distributed(_rank_and_size, 2, timeout=60) == [(0, 2), (1, 2)]
    assert len(chosen) == 2 and chosen[0] == port != chosen[1], chosen


def test_run_distributed_reraises_child_failure():
    with pytest.raises(RankFailedError) as info:
        run_distributed(_rank_one_raises, 2, timeout=120)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "bad shard on rank one" in str(err)
    assert "_rank_one_raises" in err.child_traceback  # the child's own traceback
    assert isinstance(err.__cause__, ValueError)


def test_run_distributed_times_out():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 15s"):
        run_distributed(_rank_zero_hangs, 2, timeout=15)


def test_run_distributed_rejects_unpicklable():
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda rank, ws: None, 2)


# --- compile_for_targets ---------------------------------------------------------------------


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * alpha, mask=mask)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tl.dot(a, b))


@triton.jit
def _broken_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, 3)  # not a power of two: does not compile
    tl.store(x_ptr + offs, offs)


def test_compile_for_targets_builds_both_archs():
    builds = compile_for_targets(
        _scale_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "alpha": "fp32"},
        {"BLOCK": 1024},
    )
    assert sorted(builds) == [90, 100]
    assert builds[90].arch == "sm_90a" and builds[100].arch == "sm_100a"
    for b in builds.values():
        assert ".entry _scale_kernel" in b.ptx
        assert b.cubin_size > 0 and b.fits_shared_memory
    info = ptxas_info(builds[90])
    if info is not None:
        assert 0 < info.registers <= 255 and not info.spills


def test_compile_for_targets_gemm_uses_tensor_cores():
    builds = compile_for_targets(
        _dot_kernel, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32"},
        {"BM": 128, "BN": 128, "BK": 64}, num_warps=4,
    )
    assert "wgmma" in builds[90].ptx
    assert "tcgen05" in builds[100].ptx
    assert builds[90].shared > 0


def test_compile_for_targets_reports_failure():
    with pytest.raises(KernelCompileError, match="_broken_kernel does not compile for sm_90"):
        compile_for_targets(_broken_kernel, {"x_ptr": "*i32"}, {"BLOCK": 4}, targets=(90,))


def test_compile_for_targets_checks_signature():
    with pytest.raises((ValueError, KernelCompileError), match="neither in signature"):
        compile_for_targets(_scale_kernel, {"x_ptr": "*fp32"}, {"BLOCK": 4}, targets=(90,))


# --- assert_graph_safe -----------------------------------------------------------------------


class _StaticScale(torch.nn.Module):
    """Writes into a buffer allocated once: graph-safe."""

    def __init__(self):
        super().__init__()
        self.register_buffer("out", torch.empty(8))

    def forward(self, x, counts):
        torch.mul(x, counts.float().sum(), out=self.out)
        return self.out


def test_graph_safe_accepts_static_routine():
    out = assert_graph_safe(_StaticScale(), torch.randn(8), torch.tensor([1, 2, 3]))
    assert out.shape == (8,)


def test_graph_safe_rejects_item():
    def fn(x):
        return x * x.sum().item()

    with pytest.raises(GraphSafetyError, match="DataDependentOutput"):
        assert_graph_safe(fn, torch.randn(8))


def test_graph_safe_rejects_tolist_and_nonzero():
    def tolist(x, counts):
        return x.split(counts.tolist())

    with pytest.raises(GraphSafetyError):
        assert_graph_safe(tolist, torch.randn(6), torch.tensor([2, 4]))

    def nonzero(x):
        return torch.nonzero(x > 0)

    with pytest.raises(GraphSafetyError, match="DynamicOutputShape"):
        assert_graph_safe(nonzero, torch.randn(8))


def test_graph_safe_rejects_moving_outputs():
    def fresh(x):
        return x * 2

    with pytest.raises(GraphSafetyError, match="changed address"):
        assert_graph_safe(fresh, torch.randn(8))


def test_graph_safe_skips_data_checks_like_a_capture():
    seen = []

    def fn(x, out):
        seen.append(mu.data_checks_enabled(True, x))
        return out.copy_(x)

    assert_graph_safe(fn, torch.randn(4), torch.empty(4))
    assert seen == [False, False, False]  # fake run + two real runs
    assert mu.data_checks_enabled(True, torch.randn(2))
    assert not mu.data_checks_enabled(False, torch.randn(2))


# --- counters and mtp.utils ------------------------------------------------------------------


def test_count_host_syncs():
    x = torch.arange(6)
    with count_host_syncs() as log:
        x.sum().item()
        x.tolist()
        torch.nonzero(x)
        y = x * 2  # no sync
    assert log.count == 3, log
    assert y.sum() == 30


def test_empty_is_poisoned_in_tests():
    assert mu.poison_enabled()
    assert torch.isnan(mu.empty((3,), dtype=torch.float32, device="cpu")).all()
    assert (mu.empty((2,), dtype=torch.int32, device="cpu") == torch.iinfo(torch.int32).max).all()


def test_check_tensor_messages():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        mu.check_tensor("x", [1])
    with pytest.raises(ValueError, match=r"x must be 2-D, got a 1-D tensor of shape \(3,\)"):
        mu.check_tensor("x", torch.zeros(3), ndim=2)
    with pytest.raises(TypeError, match=r"dtype in \(float16, bfloat16\), got float32"):
        mu.check_tensor("x", torch.zeros(3), dtypes=(torch.float16, torch.bfloat16))
