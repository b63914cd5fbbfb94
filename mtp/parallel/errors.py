"""Errors raised by mtp's distributed code."""

__all__ = ["RankMismatchError"]


class RankMismatchError(RuntimeError):
    """The ranks of a process group disagree on something a collective needs (a size, a dtype,
    an argument); raised on every rank of the group, naming the values and the ranks."""
