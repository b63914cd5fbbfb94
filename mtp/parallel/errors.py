"""Errors raised when the ranks of a group disagree.

:class:`RankMismatchError` is raised (on every rank) when ranks that must agree on a shape, a
count or the data itself (e.g. the targets of a vocab-parallel loss) do not. It is a
``RuntimeError``: the arguments of each rank are valid on their own, the program as a whole is
not. Its message names the quantity, the values and the ranks that hold them.
"""

from __future__ import annotations

__all__ = ["RankMismatchError"]


class RankMismatchError(RuntimeError):
    """Ranks of a process group disagree on something they must share.

    Attributes:
        what: the quantity (``"target checksum"``, ``"vocab shard size"``...).
        values: ``{rank: value}`` as each rank reported it.
    """

    def __init__(self, message: str, *, what: str = "", values: dict | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.values = dict(values or {})
