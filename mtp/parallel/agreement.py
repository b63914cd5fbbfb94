"""Ranks that disagree fail fast and clearly: agreement checks and abort-on-error regions.

Three mechanisms keep a group of ranks from hanging or crashing when they disagree:

- :func:`exchange_and_compare`: one all-gather of a few int64 values per rank (shapes, dtype
  codes, counts, arguments) and a :class:`~mtp.parallel.errors.RankMismatchError` on *every*
  rank when they differ, naming the quantity, both values and the ranks. Ops whose collective
  already carries data fold such values into it instead (no extra message in steady state).
- Debug mode, ``MTP_CHECK_COLLECTIVES=1`` (default off; the variable is read once and cached,
  :func:`set_check_collectives` overrides it): :func:`check_collective` runs one small
  all-gather of ``(op name, dtype, shape)`` before each mtp collective. Off, it returns after one
  cached flag test. Skipped while ``torch.compile`` traces.
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
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mtp import settings
from mtp.utils import is_capturing

from .errors import CollectiveAbortedError, RankMismatchError

__all__ = [
    "CHECK_COLLECTIVES_ENV",
    "ABORT_ON_ERROR_ENV",
    "check_collectives_enabled",
    "set_check_collectives",
    "abort_on_error_enabled",
    "abort_on_error_mode",
    "set_abort_on_error",
    "check_collective",
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


def check_collectives_enabled() -> bool:
    """True when ``MTP_CHECK_COLLECTIVES`` is set (read once, then cached)."""
    global _check
    if _check is None:
        _check = settings.reload().check_collectives
    return _check


def set_check_collectives(enabled: bool | None) -> None:
    """Turn the debug checks on or off for this process (None: read the variable again)."""
    global _check
    _check = None if enabled is None else bool(enabled)


def abort_on_error_mode() -> str:
    """``"abort"`` (default), ``"exit"`` or ``"off"``, from ``MTP_ABORT_ON_ERROR`` (read once,
    then cached; ``1``/``true`` mean ``abort``, ``0``/``false`` mean ``off``)."""
    global _abort
    if _abort is None:
        _abort = settings.reload().abort_on_error
    return _abort


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
    global _abort
    _abort = None if mode is None else _parse_mode(mode, "set_abort_on_error(mode)")


# --------------------------------------------------------------------------------------------
# Codes: dtypes and op names as int64 values every rank computes the same way
# --------------------------------------------------------------------------------------------

from mtp.dtypes import WIRE_DTYPE_NAMES as _DTYPE_NAMES  # noqa: E402
_DTYPE_CODE = {getattr(torch, n): i + 1 for i, n in enumerate(_DTYPE_NAMES) if hasattr(torch, n)}
_CODE_NAME: dict[int, str] = {}


def _code(text: str) -> int:
    """A stable int for ``text`` (crc32; the same in every process), remembered for messages."""
    value = zlib.crc32(text.encode())
    _CODE_NAME[value] = text
    return value


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODE.get(dtype) or _code(str(dtype))


def _dtype_text(code: int) -> str:
    if 0 < code <= len(_DTYPE_NAMES):
        return _DTYPE_NAMES[code - 1]
    return _CODE_NAME.get(code, f"dtype #{code}")


def _name_text(code: int) -> str:
    return repr(_CODE_NAME.get(code, f"#{code}"))


# --------------------------------------------------------------------------------------------
# Exchange and compare
# --------------------------------------------------------------------------------------------


def group_description(group) -> str:
    """``"group of global ranks [0, 1]"`` (or the world) for messages."""
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - destroyed or foreign group: say what we can
        return "process group"
    return f"group of global ranks {ranks}"


def _comm_device(group, like: torch.Tensor | None) -> torch.device:
    if like is not None and like.device.type not in ("meta",):
        return like.device
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(world * len(values), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)
    return out.view(world, len(values)).tolist()


#: int64 values every rank sends in one agreement exchange (fixed, whatever the operation).
SLOTS = 64
_PAD = -(1 << 62)

#: A field of an agreement check: (name, this rank's ints, formatter of one rank's ints).
Field = tuple[str, Sequence[int], Callable[[list[int]], str]]


def exchange_and_compare(
    what: str, fields: Sequence[Field], group=None, *, like: torch.Tensor | None = None
) -> None:
    """All-gather ``fields`` once over ``group`` and raise the same error on every rank if any
    field differs between ranks.

    Every rank sends :data:`SLOTS` int64 values whatever the operation (a code of ``what``
    first, then the fields, padded), so ranks that are in different operations still exchange
    messages of the same size and get an "operation" mismatch rather than a crash.

    Args:
        what: the operation, for the message (``"gather_from_sequence_parallel_region"``).
        fields: ``(name, ints, format)``: each rank's ints for the quantity ``name`` (the same
            length on every rank for the same ``what``; at most ``SLOTS - 1`` in all) and how
            to print one rank's ints.
        group: the process group (None: the default group).
        like: a tensor whose device the exchange uses (default: the group's device).

    Raises:
        RankMismatchError: on every rank, naming the first field that differs, the value of the
            group's first rank and the first rank that differs from it, and the group. Its
            ``field`` attribute is the name and ``values`` maps global ranks to their values.
    """
    if dist.get_world_size(group) == 1:
        return
    flat = [_code(what)]
    spans: list[tuple[str, int, int, Callable[[list[int]], str]]] = [
        ("operation", 0, 1, lambda v: _name_text(v[0]))
    ]
    for name, ints, fmt in fields:
        spans.append((name, len(flat), len(flat) + len(ints), fmt))
        flat.extend(int(v) for v in ints)
    if len(flat) > SLOTS:
        raise ValueError(f"{what}: {len(flat) - 1} values to agree on; at most {SLOTS - 1}")
    flat += [_PAD] * (SLOTS - len(flat))
    rows = _all_gather_ints(flat, group, _comm_device(group, like))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    for name, lo, hi, fmt in spans:
        first = rows[0][lo:hi]
        odd = next((i for i, row in enumerate(rows) if row[lo:hi] != first), None)
        if odd is None:
            continue
        values = {ranks[i]: fmt(row[lo:hi]) for i, row in enumerate(rows)}
        prefix = "mtp collective agreement check" if name == "operation" else what
        exc = RankMismatchError(
            f"{prefix}: the ranks of the {group_description(group)} disagree on the {name}: "
            f"rank {ranks[0]} has {values[ranks[0]]}, rank {ranks[odd]} has "
            f"{values[ranks[odd]]}; every rank of the group must pass the same {name}"
        )
        exc.field, exc.values = name, values
        raise exc


_TEXT_BYTES = 7  # bytes of text per int64 slot (stays positive)


def _pack_text(text: str, slots: int) -> list[int]:
    data = text.encode()[: slots * _TEXT_BYTES].ljust(slots * _TEXT_BYTES, b"\0")
    return [int.from_bytes(data[i : i + _TEXT_BYTES], "little") for i in range(0, len(data), 7)]


def _unpack_text(ints: list[int]) -> str:
    data = b"".join(int(v).to_bytes(_TEXT_BYTES, "little") for v in ints)
    return data.rstrip(b"\0").decode(errors="replace")


def value_field(name: str, value: object, slots: int = 4) -> Field:
    """A field for :func:`exchange_and_compare` holding any Python value: ints in
    ``[0, 2**62)`` travel as themselves, anything else as a checksum of its ``repr`` plus the
    first ``7 * slots`` bytes of it (so every rank can print every rank's value)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < (1 << 62):
        ints = [0, value] + [0] * slots
    else:
        text = repr(value)
        ints = [1, zlib.crc32(text.encode())] + _pack_text(text, slots)

    def fmt(v: list[int]) -> str:
        if v[0] == 0:
            return str(v[1])
        text = _unpack_text(v[2:])
        return text if len(text) < slots * _TEXT_BYTES else text + "..."

    return name, ints, fmt


# --------------------------------------------------------------------------------------------
# Debug mode: (op, dtype, shape) before each collective
# --------------------------------------------------------------------------------------------

_MAX_DIMS = 8


def _shape_ints(shape: Sequence[int]) -> list[int]:
    dims = list(shape)
    if len(dims) > _MAX_DIMS:  # compare the leading dims and a checksum of all of them
        dims = dims[: _MAX_DIMS - 1] + [_code(str(tuple(shape)))]
    return [len(shape)] + dims + [-1] * (_MAX_DIMS - len(dims))


def _shape_text(ints: list[int]) -> str:
    ndim, dims = ints[0], ints[1:]
    if ndim > _MAX_DIMS:
        return _CODE_NAME.get(dims[-1], f"a {ndim}-D shape")
    return str(tuple(dims[:ndim]))


def check_collective(op: str, x: torch.Tensor, group, dim: int = -1) -> None:
    """Debug mode only: check that every rank of ``group`` enters the same collective ``op``
    with the same ``x.dtype`` and ``x.shape`` (and the same ``dim`` for gathers and scatters).

    A no-op (one cached flag test) unless ``MTP_CHECK_COLLECTIVES=1``; also skipped while
    ``torch.compile`` traces, while a CUDA graph is captured (the check reads the gathered
    values on the host) and for single-rank groups. Raises :class:`RankMismatchError` on
    every rank when they disagree, before the real collective could crash or hang.
    """
    # tracing first: reading the flag caches it in a global, a side effect Dynamo refuses
    # inside an autograd.Function's backward (torch.compile of the column layer)
    if torch.compiler.is_compiling():
        return
    if _check is False or not check_collectives_enabled():  # the steady state: one test
        return
    if is_capturing():
        return
    if dist.get_world_size(group) == 1:
        return
    fields: list[Field] = [
        ("dtype", [_dtype_code(x.dtype)], lambda v: _dtype_text(v[0])),
        ("shape", _shape_ints(x.shape), _shape_text),
        ("dimension", [dim], lambda v: str(v[0])),
    ]
    exchange_and_compare(op, fields, group, like=x)


# --------------------------------------------------------------------------------------------
# Abort on error
# --------------------------------------------------------------------------------------------

_ABORTED: set[str] = set()


def _key(group) -> str:
    group = group if group is not None else dist.group.WORLD
    return getattr(group, "group_name", None) or str(id(group))


def is_aborted(group) -> bool:
    """True when :func:`abort_group` aborted ``group`` in this process."""
    return bool(_ABORTED) and _key(group) in _ABORTED


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
            from . import parallel_state

            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_tensor_model_parallel_group()
        return group

    return find


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
            if _ABORTED:
                group = find(args, kwargs)
                if group is not None and is_aborted(group):
                    raise _aborted_error(what, group)
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
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
