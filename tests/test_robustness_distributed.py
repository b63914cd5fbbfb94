"""Two ranks that disagree: every rank ends quickly with a clear error (or the right result),
none hangs or dies by a signal.

Each spawn runs many scenarios; each rank records what every scenario gave it (the error type
and message, or the result) and how long it took, and the parent checks both ranks' records.
The groups get short timeouts (``TIMEOUT``), so a scenario that fell back on a timeout instead
of the agreement check or the abort would show up as too slow (``FAST``).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

import mtp.parallel as mp
import mtp.tensor_parallel as tp
import mtp.tensor_parallel.layers as layers_module
from mtp import settings
from mtp.parallel import agreement
from mtp.testing import free_port, run_distributed

TIMEOUT = datetime.timedelta(seconds=20)  # collective timeout of the groups made here
FAST = 10.0  # seconds: an agreement check or an abort answers far sooner than TIMEOUT
WORLD = 2


def _record(fn):
    """``("ok", value, seconds)`` or ``(exception type name, message, seconds)``."""
    start = time.monotonic()
    try:
        value = fn()
        if isinstance(value, torch.Tensor):  # plain lists cross the process boundary safely
            value = value.detach().tolist()
        return ("ok", value, time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - every outcome is recorded for the parent
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def _local(rank: int, shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# Debug mode (MTP_CHECK_COLLECTIVES): mismatched collectives, all in one spawn
# --------------------------------------------------------------------------------------------


def _mismatch_scenarios(rank: int):
    """name -> zero-argument callable run on this rank (inputs differ between ranks)."""
    seq = 4 + 2 * rank  # sequence chunk differs: 4 vs 6

    def batch_all_reduce():
        return mp.reduce_from_tensor_model_parallel_region(_local(rank, (2 + rank, 8)))

    def dtype_all_reduce():  # same byte size: a silent wrong sum without the check
        dtype = torch.float16 if rank == 0 else torch.bfloat16
        return mp.reduce_from_tensor_model_parallel_region(_local(rank, (3, 8), dtype))

    def seq_gather():
        return mp.gather_from_sequence_parallel_region(_local(rank, (seq, 2, 8)))

    def seq_reduce_scatter():
        return mp.reduce_scatter_to_sequence_parallel_region(_local(rank, (2 * seq, 2, 8)))

    def feature_gather_dtype():
        dtype = torch.float32 if rank == 0 else torch.float64
        return mp.gather_from_tensor_model_parallel_region(_local(rank, (3, 4), dtype))

    def different_ops():
        x = _local(rank, (4, 2, 8))
        if rank == 0:
            return mp.gather_from_sequence_parallel_region(x)
        return mp.reduce_from_tensor_model_parallel_region(x)

    def column_sequence_parallel():
        torch.manual_seed(0)
        layer = tp.ColumnParallelLinear(8, 8, sequence_parallel=True, dtype=torch.float64)
        return layer(_local(rank, (seq, 2, 8), torch.float64))

    def backward_seq_chunk():  # the forward split needs no collective; the backward gathers
        x = _local(rank, (seq, 2, 8), torch.float64).requires_grad_()
        y = mp.scatter_to_sequence_parallel_region(x)
        y.backward(torch.ones_like(y))
        return x.grad

    def agreeing_all_reduce():  # the group still works, with the right answer
        out = mp.reduce_from_tensor_model_parallel_region(_local(rank, (3, 5), torch.float64))
        return out

    return {
        "batch_all_reduce": batch_all_reduce,
        "dtype_all_reduce": dtype_all_reduce,
        "seq_gather": seq_gather,
        "seq_reduce_scatter": seq_reduce_scatter,
        "feature_gather_dtype": feature_gather_dtype,
        "different_ops": different_ops,
        "column_sequence_parallel": column_sequence_parallel,
        "backward_seq_chunk": backward_seq_chunk,
        "agreeing_all_reduce": agreeing_all_reduce,
    }


def _per_head_mask_error(rank: int, world: int) -> float:
    """A ``[b, num_heads, s, s]`` mask at tp=2 (each rank keeps its heads' part) against the
    same attention on one rank (same seed, so the same full weights)."""
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    x = _local(0, (5, 2, 8), torch.float64)  # the same input on every rank
    mask = torch.rand(2, 4, 5, 5, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[..., 0] = True
    outs = []
    for group in (None, singles[rank]):
        torch.manual_seed(0)
        attn = tp.ParallelSelfAttention(8, 4, group=group, dtype=torch.float64)
        outs.append(attn(x, mask))
    return float((outs[0] - outs[1]).abs().max())


def _debug_mode_worker(rank: int, world: int):
    agreement.set_check_collectives(True)
    mp.initialize_model_parallel(tensor_model_parallel_size=world, timeout=TIMEOUT)
    out = {name: _record(fn) for name, fn in _mismatch_scenarios(rank).items()}
    out["per_head_mask"] = _record(lambda: _per_head_mask_error(rank, world))
    mp.destroy_model_parallel()
    agreement.set_check_collectives(None)
    return out


#: scenario -> (field named in the message, the two values as printed)
DEBUG_EXPECTED = {
    "batch_all_reduce": ("row count", "2 rows", "3 rows"),
    "dtype_all_reduce": ("dtype", "float16", "bfloat16"),
    "seq_gather": ("row count", "8 rows", "12 rows"),
    "seq_reduce_scatter": ("row count", "16 rows", "24 rows"),
    "feature_gather_dtype": ("dtype", "float32", "float64"),
    "different_ops": ("operation", "'all_gather'", "'all_reduce'"),
    "column_sequence_parallel": ("row count", "8 rows", "12 rows"),
    "backward_seq_chunk": ("row count", "4 rows", "6 rows"),
}


def test_debug_mode_mismatches_fail_on_every_rank():
    per_rank = run_distributed(_debug_mode_worker, WORLD, timeout=150)
    for name, (field, first, second) in DEBUG_EXPECTED.items():
        messages = set()
        for rank, results in enumerate(per_rank):
            kind, message, seconds = results[name]
            assert kind == "RankMismatchError", (name, rank, kind, message)
            assert f"disagree on the {field}" in message, (name, message)
            assert f"rank 0 has {first}, rank 1 has {second}" in message, (name, message)
            assert "global ranks [0, 1]" in message, message
            assert seconds < FAST, (name, rank, seconds)
            messages.add(message)
        assert len(messages) == 1, f"{name}: the ranks raised different messages {messages}"
    for results in per_rank:
        kind, error, _ = results["per_head_mask"]
        assert kind == "ok" and error < 1e-12, (kind, error)
    # after all those errors the group is intact and computes the right sum
    expected = sum(_local(r, (3, 5), torch.float64) for r in range(WORLD))
    for results in per_rank:
        kind, value, _ = results["agreeing_all_reduce"]
        assert kind == "ok", value
        got = torch.tensor(value, dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def _four_rank_worker(rank: int, world: int):
    """tp=2 over 4 ranks; only rank 3 has another batch: its tp group ([2, 3]) fails, the other
    ([0, 1]) sums correctly."""
    agreement.set_check_collectives(True)
    mp.initialize_model_parallel(tensor_model_parallel_size=2, timeout=TIMEOUT)
    x = _local(rank, (4 if rank == 3 else 3, 4), torch.float64)
    out = _record(lambda: mp.reduce_from_tensor_model_parallel_region(x))
    mp.destroy_model_parallel()
    agreement.set_check_collectives(None)
    return out


def test_debug_mode_four_ranks_names_the_group():
    per_rank = run_distributed(_four_rank_worker, 4, timeout=150)
    expected = _local(0, (3, 4), torch.float64) + _local(1, (3, 4), torch.float64)
    for rank in (0, 1):
        kind, value, _ = per_rank[rank]
        assert kind == "ok", value
        got = torch.tensor(value, dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for rank in (2, 3):
        kind, message, seconds = per_rank[rank]
        assert kind == "RankMismatchError" and seconds < FAST, message
        assert "global ranks [2, 3]" in message, message
        assert "rank 2 has 3 rows, rank 3 has 4 rows" in message, message


# --------------------------------------------------------------------------------------------
# initialize_model_parallel arguments, one rank raising inside a region, recovery
# --------------------------------------------------------------------------------------------


SHORT = datetime.timedelta(seconds=4)  # group timeout where a peer is expected to time out


class _FailingFunctional:
    """``torch.nn.functional`` whose ``linear`` fails like a kernel error would."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def linear(self, *args, **kwargs):
        raise RuntimeError("simulated kernel failure")


def _init_and_abort_worker(rank: int, world: int):
    out = {}
    out["init_tp"] = _record(
        lambda: mp.initialize_model_parallel(
            tensor_model_parallel_size=2 if rank == 0 else 1, timeout=TIMEOUT
        )
    )
    out["init_order"] = _record(
        lambda: mp.initialize_model_parallel(
            tensor_model_parallel_size=2, order="tp-dp-pp" if rank else "tp-cp-ep-dp-pp",
            timeout=TIMEOUT,
        )  # fmt: skip
    )
    out["init_type"] = _record(
        lambda: mp.initialize_model_parallel(
            tensor_model_parallel_size="2" if rank else 2, timeout=TIMEOUT
        )
    )
    out["init_timeout"] = _record(
        lambda: mp.initialize_model_parallel(timeout=SHORT if rank else TIMEOUT)
    )
    out["initialized_after_mismatch"] = mp.model_parallel_is_initialized()
    mp.initialize_model_parallel(tensor_model_parallel_size=world, timeout=SHORT)
    torch.manual_seed(0)
    row = tp.RowParallelLinear(8, 4, dtype=torch.float64)
    # A bad argument on every rank: a ValueError everywhere, no abort, the group goes on.
    out["all_ranks_bad_input"] = _record(lambda: row(torch.ones(3, 5, dtype=torch.float64)))
    out["after_bad_input"] = _record(lambda: row(torch.ones(3, 4, dtype=torch.float64)).tolist())
    # One rank fails inside RowParallelLinear (a simulated kernel error) while its peer is in the
    # all-reduce: the failing rank aborts its group (unusable from then on, a clear error), the
    # peer ends at the group timeout with a clear error (gloo: see mtp.parallel.agreement).
    real_f = layers_module.F
    if rank == 0:
        layers_module.F = _FailingFunctional(real_f)
    try:
        out["one_rank_raises"] = _record(lambda: row(torch.ones(3, 4, dtype=torch.float64)))
    finally:
        layers_module.F = real_f
    out["after_abort"] = _record(lambda: row(torch.ones(3, 4, dtype=torch.float64)))
    out["getter_after_abort"] = _record(mp.get_tensor_model_parallel_group)
    # recovery: re-create the groups, and they compute the right sum
    mp.destroy_model_parallel()
    mp.initialize_model_parallel(tensor_model_parallel_size=world, timeout=TIMEOUT)
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64)
    out["recovered"] = _record(lambda: mp.reduce_from_tensor_model_parallel_region(x))
    mp.destroy_model_parallel()
    return out


def test_initialize_disagreement_and_abort_on_error():
    per_rank = run_distributed(_init_and_abort_worker, WORLD, timeout=200)
    for rank, out in enumerate(per_rank):
        for name, field, values in (
            ("init_tp", "tensor_model_parallel_size", "rank 0 has 2, rank 1 has 1"),
            ("init_order", "order", "rank 0 has 'tp-cp-ep-dp-pp', rank 1 has 'tp-dp-pp'"),
            ("init_type", "tensor_model_parallel_size", "rank 0 has 2, rank 1 has '2'"),
            ("init_timeout", "timeout", "rank 0 has 20.0, rank 1 has 4.0"),
        ):
            kind, message, seconds = out[name]
            assert kind == "RankMismatchError", (rank, name, message)
            assert f"disagree on the {field}" in message and values in message, message
            assert "initialize_model_parallel" in message and seconds < FAST
        assert out["initialized_after_mismatch"] is False
        kind, message, _ = out["all_ranks_bad_input"]
        assert kind == "ValueError" and "must have 4 features" in message, message
        assert out["after_bad_input"][0] == "ok", out["after_bad_input"]
        kind, message, seconds = out["one_rank_raises"]
        if rank == 0:  # the failing rank: its own error, at once
            assert kind == "RuntimeError" and "simulated kernel failure" in message, message
            assert seconds < 1.0
        else:  # the peer: a clear error at the group timeout (4 s), never a hang
            assert kind == "CollectiveAbortedError", message
            assert "reduce_from_tensor_model_parallel_region" in message, message
            assert "[0, 1]" in message and "peer rank" in message, message
            assert seconds < SHORT.total_seconds() + FAST, seconds
        for name in ("after_abort", "getter_after_abort"):
            kind, message, seconds = out[name]
            assert kind == "CollectiveAbortedError" and "was aborted" in message, message
            assert "destroy_model_parallel" in message and seconds < 1.0
        kind, value, _ = out["recovered"]
        assert kind == "ok", value
        assert value == [[3.0] * 3] * 2


def _exit_mode_child(rank: int, port: int, result_path: str) -> None:
    """One rank of the MTP_ABORT_ON_ERROR=exit check (spawned by the test, not by
    run_distributed: rank 0 is meant to exit)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MTP_ABORT_ON_ERROR="exit")
    settings.reload()  # mtp read the environment when this module imported it
    torch.set_num_threads(1)
    long = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=long)
    mp.initialize_model_parallel(tensor_model_parallel_size=WORLD, timeout=long)
    torch.manual_seed(0)
    row = tp.RowParallelLinear(8, 4, dtype=torch.float64)
    width = 5 if rank == 0 else 4  # rank 0 raises inside the region, and exits there
    outcome = _record(lambda: row(torch.ones(3, width, dtype=torch.float64)))
    with open(result_path, "w") as f:
        json.dump([rank, *outcome], f)
    os._exit(0)  # the peer is gone: no barrier, no destroy


def test_exit_mode_releases_the_peer_at_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    paths = [str(tmp_path / f"rank{r}.json") for r in range(WORLD)]
    procs = [ctx.Process(target=_exit_mode_child, args=(r, port, paths[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [1, 0]  # rank 0 exited in the region; no signal
    assert not os.path.exists(paths[0])
    with open(paths[1]) as f:
        rank, kind, message, seconds = json.load(f)
    assert kind == "CollectiveAbortedError", message
    assert "peer rank" in message and "[0, 1]" in message, message
    assert seconds < FAST, seconds  # released by the exit, not by the 60 s timeout


# --------------------------------------------------------------------------------------------
# Checks off: no extra collective
# --------------------------------------------------------------------------------------------


def test_agreement_check_off_costs_nothing(monkeypatch):
    """MTP_VALIDATE=off (and no MTP_CHECK_COLLECTIVES): the check returns before it touches the
    group; the debug flag is read once, then cached."""
    from mtp.parallel.collective_check import check_collective

    monkeypatch.delenv(agreement.CHECK_COLLECTIVES_ENV, raising=False)
    agreement.set_check_collectives(None)
    assert agreement.check_collectives_enabled() is False
    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: calls.append(a) or 2)
    with settings.override(validate="off"):
        check_collective("all_reduce", torch.ones(2), None)
    assert calls == []
    monkeypatch.setenv(agreement.CHECK_COLLECTIVES_ENV, "1")
    assert agreement.check_collectives_enabled() is False  # read once, cached
    agreement.set_check_collectives(None)
    assert agreement.check_collectives_enabled() is True
    agreement.set_check_collectives(None)


@pytest.mark.parametrize("bad, error", [("10", TypeError), (-1, ValueError)])
def test_initialize_timeout_argument(bad, error):
    from mtp.parallel.parallel_state import _check_timeout

    with pytest.raises(error, match="timeout"):
        _check_timeout(bad)
    assert _check_timeout(None) == mp.DEFAULT_TIMEOUT == datetime.timedelta(minutes=10)
    assert _check_timeout(5) == datetime.timedelta(seconds=5)
