"""The groups this process aborted after an error in a collective region.

:func:`abort_group` aborts a group so that its peers do not wait and remembers it;
:func:`is_aborted` answers for later calls (which then raise
:class:`~mtp.parallel.errors.CollectiveAbortedError` instead of issuing collectives that no
longer match the peers'); :func:`forget_aborted` drops a group when it is destroyed
(:func:`mtp.parallel.destroy_model_parallel`). The policy (when to abort) is
:func:`mtp.parallel.agreement.collective_region`'s.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .groups import group_description

__all__ = ["abort_group", "any_aborted", "forget_aborted", "is_aborted"]

logger = logging.getLogger("mtp")

_ABORTED: set[str] = set()


def _key(group) -> str:
    group = group if group is not None else dist.group.WORLD
    return getattr(group, "group_name", None) or str(id(group))


def any_aborted() -> bool:
    """True when this process aborted any group (one set test: the steady-state answer)."""
    return bool(_ABORTED)


def is_aborted(group) -> bool:
    """True when :func:`abort_group` aborted ``group`` in this process."""
    return bool(_ABORTED) and _key(group) in _ABORTED


def forget_aborted(group) -> None:
    """Forget that ``group`` was aborted (it is being destroyed)."""
    _ABORTED.discard(_key(group))


def abort_group(group, reason: str) -> bool:
    """Abort ``group`` so that peers blocked in a collective on it fail at once.

    Uses ``torch.distributed.distributed_c10d._abort_process_group`` (aborts the NCCL
    communicators and unregisters the group; with gloo the connections close only when the
    last reference to the group goes), falling back to ``ProcessGroup.abort()``. Idempotent.
    Returns True when this call aborted the group.
    ``group=None`` (or the world group) aborts every group of the process.
    """
    key = _key(group)
    if key in _ABORTED:
        return False
    _ABORTED.add(key)
    logger.error("aborting the %s so that its peers do not wait: %s", group_description(group),
                 reason)  # fmt: skip
    c10d = dist.distributed_c10d
    try:
        c10d._abort_process_group(group)
    except Exception as exc:  # noqa: BLE001 - old torch or already gone: try the plain abort
        logger.debug("_abort_process_group failed (%s); calling ProcessGroup.abort()", exc)
        try:
            (group if group is not None else dist.group.WORLD).abort()
        except Exception as exc2:  # noqa: BLE001
            logger.error("could not abort the group (%s); peers wait for its timeout", exc2)
    return True
