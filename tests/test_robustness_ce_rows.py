"""Cross-entropy ops whose ranks pass different row counts (0 included), under
MTP_CHECK_COLLECTIVES=1: both losses exchange a fixed-size row first (the fused loss on logits
its agreement row, the fused linear loss its metadata), so they raise RankMismatchError on every
rank naming the row counts instead of letting gloo abort on all-gathers of different sizes.
Equal rows pass the check. (The default mode: tests/test_robustness_tp_default.py.)"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.ops import linear_cross_entropy, vocab_parallel_cross_entropy
from mtp.parallel import agreement
from mtp.testing import run_distributed


def _outcome(fn):
    try:
        fn()
        return "ok"
    except RuntimeError as exc:  # RankMismatchError is one
        return f"{type(exc).__name__}: {exc}"


def _worker(rank, world):
    agreement.set_check_collectives(True)
    group = dist.group.WORLD
    rows = 4 if rank == 0 else 0
    logits = torch.randn(rows, 8)
    target = torch.randint(0, 16, (rows,))
    hidden, weight = torch.randn(rows, 6), torch.randn(8, 6)
    out = {
        "ce": _outcome(lambda: vocab_parallel_cross_entropy(logits, target, group=group)),
        "linear_ce": _outcome(lambda: linear_cross_entropy(hidden, weight, target, group=group)),
    }
    same = torch.randint(0, 16, (3,), generator=torch.Generator().manual_seed(0))
    out["equal_rows"] = _outcome(
        lambda: vocab_parallel_cross_entropy(torch.randn(3, 8), same, group=group)
    )
    return out


def test_row_count_mismatch_fails_on_every_rank_in_debug_mode():
    results = run_distributed(_worker, 2, timeout=60)
    for out in results:
        assert out["equal_rows"] == "ok", out
        assert out["ce"].startswith("RankMismatchError"), out
        assert "disagree on the row count: rank 0 has 4 rows, rank 1 has 0 rows" in out["ce"]
        # linear CE folds the row count into its fixed-size metadata exchange (any mode)
        assert "disagree on the row count" in out["linear_ce"], out
    assert results[0]["ce"] == results[1]["ce"]  # the same message on both ranks
