"""Errors raised when the ranks of a process group disagree or a collective cannot finish.

Both are ``RuntimeError`` subclasses (what torch.distributed raises for failed collectives), so
code that already catches ``RuntimeError`` around communication keeps working.
"""

from __future__ import annotations

__all__ = ["CollectiveAbortedError", "RankMismatchError"]


class RankMismatchError(RuntimeError):
    """Ranks of one group disagree on something they must share (a shape, a dtype, a count, an
    argument, the targets of a vocab-parallel loss). Raised on every rank of the group, with the
    same message, which names the quantity, the values and the ranks that hold them.

    Attributes:
        what: the quantity (``"target checksum"``, ``"vocab shard size"``...), when given.
        values: ``{rank: value}`` as each rank reported it, when given.
        detail: the message without the layer or mapping it was raised in, for the agreement
            check of a collective (:mod:`mtp.parallel.collective_check`) that the region around
            it names; else None.
    """

    detail: str | None = None

    def __init__(self, message: str = "", *, what: str = "", values: dict | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.values = dict(values or {})


class CollectiveAbortedError(RuntimeError):
    """A collective could not finish because a peer left it (raised, timed out or died), or the
    group was aborted after an earlier error on this rank. The group is unusable afterwards:
    call ``mtp.parallel.destroy_model_parallel()`` and ``initialize_model_parallel()`` again on
    every rank, or restart the job."""
