"""Tensor-parallel ranks that pass different tensors, with the default settings: every rank
raises the same ``RankMismatchError`` naming the mistake in user words (rows, hidden size,
dtype), quickly, and the group stays usable. Without the agreement row each mtp collective
exchanges first (:mod:`mtp.parallel.collective_check`), gloo aborts a rank (``SIGABRT``) on
every one of these.

One spawn runs every scenario; each rank records the error type, message and time of each, and
the parent checks both ranks' records. The groups' timeout (``TIMEOUT``) is short, so a
scenario that ended at a timeout instead of the check would show up as too slow (``FAST``).
"""

from __future__ import annotations

import datetime
import time

import torch

import mtp.parallel as mp
import mtp.tensor_parallel as tp
from mtp import settings
from mtp.ops import vocab_parallel_cross_entropy
from mtp.testing import run_distributed

TIMEOUT = datetime.timedelta(seconds=20)
FAST = 10.0  # seconds: the check answers far sooner than TIMEOUT


def _record(fn):
    """``(exception type name or "ok", message, seconds)``."""
    start = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - every outcome is recorded for the parent
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def _randn(rank: int, *shape, dtype=torch.float32, grad=False) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(rank), dtype=dtype)
    return x.requires_grad_(grad)


def _loss(rows: int):
    target = torch.zeros(rows, dtype=torch.long)
    group = mp.get_tensor_model_parallel_group()
    return lambda: vocab_parallel_cross_entropy(_randn(0, rows, 8), target, group=group)


def _scenarios(rank: int) -> dict:
    """name -> zero-argument callable (the inputs differ between the ranks)."""
    torch.manual_seed(0)
    row = tp.RowParallelLinear(8, 4)
    column = tp.ColumnParallelLinear(8, 4)
    embedding = tp.VocabParallelEmbedding(16, 4)
    dtype = torch.float32 if rank == 0 else torch.float64
    torch.manual_seed(0)
    row_of_dtype = tp.RowParallelLinear(8, 4, dtype=dtype)

    def column_backward():  # the forward runs no collective; the backward all-reduces dX
        x = _randn(rank, 3 if rank == 0 else 5, 8, grad=True)
        column(x).sum().backward()

    return {
        "cross_entropy_rows": _loss(6 + rank),
        "cross_entropy_zero_rows": _loss(0 if rank else 4),
        "row_parallel_rows": lambda: row(_randn(rank, 3 if rank == 0 else 5, 4)),
        "column_parallel_backward": column_backward,
        "sequence_gather": lambda: mp.gather_from_sequence_parallel_region(
            _randn(rank, 4 + 2 * rank, 2, 8)
        ),
        "sequence_reduce_scatter": lambda: mp.reduce_scatter_to_sequence_parallel_region(
            _randn(rank, 8 + 4 * rank, 2, 8)
        ),
        "embedding_batch": lambda: embedding(torch.zeros(2, 3 + rank, dtype=torch.long)),
        "dtype": lambda: row_of_dtype(_randn(rank, 3, 4, dtype=dtype)),
    }


def _worker(rank: int, world: int):
    mp.initialize_model_parallel(tensor_model_parallel_size=world, timeout=TIMEOUT)
    out = {"warm_up": _record(_loss(5))}  # agreeing ranks pass (and the first call's imports)
    out.update({name: _record(fn) for name, fn in _scenarios(rank).items()})
    with settings.override(validate="sync"):  # the typed error on the host: the same words
        out["row_parallel_rows_sync"] = _record(_scenarios(rank)["row_parallel_rows"])
    x = torch.full((2, 3), float(rank + 1))
    out["after"] = _record(lambda: mp.reduce_from_tensor_model_parallel_region(x))
    mp.destroy_model_parallel()
    return out


#: scenario -> (what the message starts with, the field, rank 0's value, rank 1's value)
EXPECTED = {
    "cross_entropy_rows": ("vocab_parallel_cross_entropy", "row count", "6 rows", "7 rows"),
    "cross_entropy_zero_rows": ("vocab_parallel_cross_entropy", "row count", "4 rows", "0 rows"),
    "row_parallel_rows": ("RowParallelLinear.forward", "row count", "3 rows", "5 rows"),
    "row_parallel_rows_sync": ("RowParallelLinear.forward", "row count", "3 rows", "5 rows"),
    "column_parallel_backward": (
        "backward of ColumnParallelLinear", "row count", "3 rows", "5 rows"
    ),
    "sequence_gather": ("gather_from_sequence_parallel_region", "row count", "8 rows", "12 rows"),
    "sequence_reduce_scatter": (
        "reduce_scatter_to_sequence_parallel_region", "row count", "16 rows", "24 rows"
    ),
    "embedding_batch": ("VocabParallelEmbedding.forward", "row count", "6 rows", "8 rows"),
    "dtype": ("RowParallelLinear.forward", "dtype", "float32", "float64"),
}


def test_default_mismatches_raise_on_every_rank():
    per_rank = run_distributed(_worker, 2, timeout=240)
    for name, (start, field, first, second) in EXPECTED.items():
        messages = set()
        for rank, out in enumerate(per_rank):
            kind, message, seconds = out[name]
            assert kind == "RankMismatchError", (name, rank, kind, message)
            assert message.startswith(start), (name, message)
            assert f"disagree on the {field}: rank 0 has {first}, rank 1 has {second}" in message
            assert "global ranks [0, 1]" in message, message
            assert seconds < FAST, (name, rank, seconds)
            messages.add(message)
        assert len(messages) == 1, f"{name}: the ranks raised different messages {messages}"
    for out in per_rank:
        assert out["warm_up"][0] == "ok", out["warm_up"]
        assert out["after"][0] == "ok", out["after"]  # the group is intact


def test_the_message_names_the_first_difference_in_user_words():
    """One process: the rows two ranks would exchange, and the error each pair gives."""
    from mtp.parallel.collective_check import _mismatch, _row

    def message(a, b, dtypes=(torch.float32, torch.float32), ops=("all_reduce", "all_reduce")):
        rows = [_row(op, shape, dtype, -1) for op, shape, dtype in zip(ops, (a, b), dtypes)]
        return str(_mismatch("RowParallelLinear.forward", rows, None))

    assert "row count: rank 0 has 6 rows, rank 1 has 7 rows" in message((6, 8), (7, 8))
    assert "row count: rank 0 has 1 row, rank 1 has 0 rows" in message((1, 8), (0, 8))
    assert "hidden size: rank 0 has 8, rank 1 has 16" in message((6, 8), (6, 16))
    dtypes = (torch.bfloat16, torch.float16)
    assert "dtype: rank 0 has bfloat16, rank 1 has float16" in message((6, 8), (6, 8), dtypes)
    assert "shape: rank 0 has (2, 3, 8), rank 1 has (3, 2, 8)" in message((2, 3, 8), (3, 2, 8))
    deep = tuple(range(1, 11))  # more dims than the row holds: a checksum of the whole shape
    assert "shape: rank 0 has (1, 2, 3" in message(deep, (2, 1) + deep[2:])
    ops = message((6, 8), (6, 8), ops=("all_reduce", "all_gather"))
    assert ops.startswith("mtp collective agreement check: ")  # the same text on both ranks
    assert "operation: rank 0 has 'all_reduce', rank 1 has 'all_gather'" in ops
