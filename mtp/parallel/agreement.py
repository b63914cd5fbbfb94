"""Ranks that disagree fail fast and clearly: agreement checks and abort-on-error regions.

Three mechanisms keep a group of ranks from hanging or crashing when they disagree:

- :func:`mtp.parallel.agree.agree`: one all-gather of a few int64 values per rank (shapes,
  dtype codes, counts, arguments) and a :class:`~mtp.parallel.errors.RankMismatchError` on
  *every* rank when they differ, naming the quantity, both values and the ranks. Ops whose
  collective already carries data fold such values into it instead (no extra message in steady
  state; :class:`mtp.parallel.agree.Agreement`).
- :func:`mtp.parallel.collective_check.check_collective`: before each tensor-parallel
  collective, one all-gather of a fixed-size row (operation, row count, hidden size, dtype,
  shape) compared on the device by default, so that ranks passing different tensors raise a
  ``RankMismatchError`` instead of a gloo ``SIGABRT`` or an NCCL hang. Debug mode,
  ``MTP_CHECK_COLLECTIVES=1`` (default off; :func:`set_check_collectives` overrides it),
  compares the rows on the host (the typed error on every device) and makes the MoE
  dispatchers check every dispatch.
- :func:`collective_region` (a decorator for functions and methods that run collectives): what
  happens when the body raises on this rank is set by ``MTP_ABORT_ON_ERROR`` (read once;
  :func:`set_abort_on_error` overrides it):

  ``abort`` (default)
      after any error but a bad-argument ``ValueError``/``TypeError`` (mtp raises those before
      the region's first collective, on every rank alike, and a caller may catch them and go
      on; ``exit`` covers a bad argument on one rank only), the group is aborted
      (``_abort_process_group``: NCCL communicators are aborted, the group is unregistered)
      and marked unusable: later mtp calls on it raise
      :class:`~mtp.parallel.errors.CollectiveAbortedError` at once instead of issuing
      collectives that no longer match the peers'. Peers blocked in a collective on it fail at
      the group's timeout (``initialize_model_parallel(timeout=...)``, 10 minutes by default),
      with a ``CollectiveAbortedError`` naming the group. With gloo (torch 2.13) no abort call
      releases a blocked peer earlier: ``ProcessGroup.abort()``/``shutdown()`` leave the
      connections open and gloo has no ``suspend``; only closing the sockets does, which
      happens when the process exits (or the last reference to the group goes away).
  ``exit``
      log the error with its traceback and end the process (``os._exit(1)``): the OS closes
      its connections and every peer's pending collective fails at once (gloo: "Connection
      closed by peer", re-raised as ``CollectiveAbortedError``). For jobs under a launcher.
  ``0``
      nothing: the group stays usable (for code that expects an error on every rank together
      and goes on). Errors that every rank raises together (``RankMismatchError``) never abort.

  To use an aborted group again, re-create the groups on every rank
  (``destroy_model_parallel()`` then ``initialize_model_parallel()``), or restart.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mtp import settings

from . import parallel_state
from .aborted import abort_group, any_aborted, is_aborted
from .agree import Field as _Field
from .agree import agree, value_field
from .errors import CollectiveAbortedError, RankMismatchError
from .groups import group_description

__all__ = [
    "CHECK_COLLECTIVES_ENV",
    "ABORT_ON_ERROR_ENV",
    "check_collectives_enabled",
    "set_check_collectives",
    "abort_on_error_enabled",
    "abort_on_error_mode",
    "set_abort_on_error",
    "exchange_and_compare",
    "value_field",
    "collective_region",
    "abort_group",
    "is_aborted",
    "group_description",
]

logger = logging.getLogger("mtp")

CHECK_COLLECTIVES_ENV = "MTP_CHECK_COLLECTIVES"
ABORT_ON_ERROR_ENV = "MTP_ABORT_ON_ERROR"

_OFF = ("", "0", "false", "no", "off")
_check: bool | None = None
_abort: str | None = None
_ABORT_MODES = ("abort", "exit", "off")


_stale = False  # set_*(None): read the environment again at the next look


def _settings():
    """:func:`mtp.settings.current`, re-read from the environment after a ``set_*(None)``
    (a bad value then raises here, where the setting is used)."""
    global _stale
    if _stale:
        settings.reload()
        _stale = False
    return settings.current()


def check_collectives_enabled() -> bool:
    """True when ``MTP_CHECK_COLLECTIVES`` is set (read once, then cached)."""
    return _settings().check_collectives if _check is None else _check


def set_check_collectives(enabled: bool | None) -> None:
    """Turn the debug checks on or off for this process (None: read the variable again). The
    MoE dispatchers read :func:`check_collectives_enabled` too."""
    global _check, _stale
    if enabled is None:
        _stale = True
    _check = None if enabled is None else bool(enabled)


def abort_on_error_mode() -> str:
    """``"abort"`` (default), ``"exit"`` or ``"off"``, from ``MTP_ABORT_ON_ERROR`` (read once,
    then cached; ``1``/``true`` mean ``abort``, ``0``/``false`` mean ``off``)."""
    return _settings().abort_on_error if _abort is None else _abort


def abort_on_error_enabled() -> bool:
    """True unless ``MTP_ABORT_ON_ERROR`` is off."""
    return abort_on_error_mode() != "off"


def _parse_mode(value: object, what: str) -> str:
    text = str(value).strip().lower()
    if text in _OFF or value is False:
        return "off"
    if text in ("1", "true", "yes", "on", "abort") or value is True:
        return "abort"
    if text == "exit":
        return "exit"
    raise ValueError(f"{what} must be one of 'abort', 'exit', '0' (off), got {value!r}")


def set_abort_on_error(mode: bool | str | None) -> None:
    """Set what an error inside a collective region does in this process: ``"abort"`` (or
    True), ``"exit"``, ``"off"`` (or False); None reads ``MTP_ABORT_ON_ERROR`` again. Off, the
    group stays usable after an error (what a test that expects an error on every rank and goes
    on using the group wants)."""
    global _abort, _stale
    if mode is None:
        _stale = True
    _abort = None if mode is None else _parse_mode(mode, "set_abort_on_error(mode)")


# --------------------------------------------------------------------------------------------
# Agreement of fields in the tuple spelling
# --------------------------------------------------------------------------------------------

#: A field in the older tuple spelling: (name, this rank's ints, formatter of one rank's ints).
Field = tuple[str, Sequence[int], Callable[[list[int]], str]]


def exchange_and_compare(
    what: str, fields: Sequence[Field], group=None, *, like: torch.Tensor | None = None
) -> None:
    """:func:`~mtp.parallel.agree.agree` for ``(name, ints, format)`` tuples (the older
    spelling; each tuple travels as it is)."""
    agree(group, what, like=like, **{n: _Field(n, tuple(i), f) for n, i, f in fields})


# --------------------------------------------------------------------------------------------
# Abort on error
# --------------------------------------------------------------------------------------------

def _exit_process(what: str, description: str, exc: BaseException) -> None:
    """Log ``exc`` and end the process, so that the OS closes its connections to the peers."""
    import sys

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    logger.critical("%s raised on this rank; exiting (MTP_ABORT_ON_ERROR=exit) so that the "
                    "peers of the %s do not wait:\n%s", what, description, text)  # fmt: skip
    sys.stderr.write(f"mtp: {what} raised; exiting so that the peers of the {description} do "
                     f"not wait (MTP_ABORT_ON_ERROR=exit):\n{text}")  # fmt: skip
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(1)


def _raised_by_collective(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"torch{os.sep}distributed" in frames[-1].filename


def _aborted_error(what: str, group) -> CollectiveAbortedError:
    return CollectiveAbortedError(
        f"{what}: the {group_description(group)} was aborted after an earlier error on this "
        "rank; re-create the groups on every rank (mtp.parallel.destroy_model_parallel(), then "
        "initialize_model_parallel()) or restart"
    )


def _on_error(what: str, group, exc: BaseException) -> BaseException | None:
    """Abort ``group`` after ``exc``; a replacement exception to raise, or None (re-raise)."""
    if isinstance(exc, (RankMismatchError, CollectiveAbortedError)) or not dist.is_initialized():
        return None
    mode = abort_on_error_mode()
    if mode == "off":
        return None
    if mode == "abort" and isinstance(exc, (ValueError, TypeError)):
        # mtp's bad-argument errors: raised by checks that run before the region's first
        # collective, on every rank alike; the caller may catch them and go on using the group
        return None
    try:
        if dist.get_world_size(group) == 1:
            return None
        description = group_description(group)
    except Exception:  # noqa: BLE001 - the group is gone already
        return None
    from_peer = isinstance(exc, RuntimeError) and _raised_by_collective(exc)
    if mode == "exit" and not from_peer:  # a peer's failure is reported, not propagated
        _exit_process(what, description, exc)
    abort_group(group, f"{type(exc).__name__} in {what}: {exc}")
    if not from_peer:
        return None
    return CollectiveAbortedError(
        f"{what}: a collective on the {description} failed: {str(exc).splitlines()[0][:300]}. "
        "A peer rank probably raised, died or took another path instead of joining it (see the "
        "other ranks' errors); the group has been aborted on this rank too"
    )


def _group_finder(fn: Callable, group_arg: str | None) -> Callable[[tuple, dict], object]:
    """How to find the group of a call to ``fn``: ``self.group`` for methods, else the
    ``group`` argument (None: the tensor-parallel group)."""
    if group_arg is None:
        return lambda args, kwargs: getattr(args[0], "group", None)
    index = list(inspect.signature(fn).parameters).index(group_arg)

    def find(args, kwargs):
        group = args[index] if len(args) > index else kwargs.get(group_arg)
        if group is None:
            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_tensor_model_parallel_group()
        return group

    return find


def _name_region(exc: BaseException, what: str) -> None:
    """Put the region's name in front of a collective check's error (the outermost region's
    wins: a layer's name rather than the mapping it calls)."""
    detail = getattr(exc, "detail", None)
    if isinstance(exc, RankMismatchError) and detail is not None:
        exc.args = (f"{what}: {detail}",)


def collective_region(name: str | None = None, *, group_arg: str | None = None):
    """Decorate a function (``group_arg="group"``: its argument holding the group, None meaning
    the tensor-parallel group) or a method (default: ``self.group``) that runs collectives.

    Before the call: ``CollectiveAbortedError`` at once if the group was aborted. When the body
    raises on this rank, ``MTP_ABORT_ON_ERROR`` decides (see the module docstring: abort the
    group, exit the process, or nothing) and the error is re-raised; a collective that failed
    because a peer left or timed out is re-raised as ``CollectiveAbortedError``. Under
    ``torch.compile`` tracing the function runs unwrapped.
    """

    def decorate(fn: Callable) -> Callable:
        what = name or fn.__qualname__
        find = _group_finder(fn, group_arg)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            if any_aborted():
                group = find(args, kwargs)
                if group is not None and is_aborted(group):
                    raise _aborted_error(what, group)
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                _name_region(exc, what)
                try:
                    group = find(args, kwargs)
                except Exception:  # noqa: BLE001 - no group to act on: the original error
                    group = None
                if group is None:
                    raise
                replacement = _on_error(what, group, exc)
                if replacement is None:
                    raise
                raise replacement from exc

        return wrapper

    return decorate
