"""The agreement row each mtp tensor-parallel collective exchanges before its data.

A collective whose ranks pass tensors of different sizes does not fail cleanly: gloo aborts the
process (``SIGABRT``: "Received data size doesn't match expected size"), NCCL hangs or reads
past the buffer, and tensors of the same byte size but different dtypes are summed silently
wrong. No data collective can carry the check (its size is the very thing that differs), so
:func:`check_collective` first all-gathers one fixed-size row of :data:`ROW_WIDTH` int64 per
rank, the same size on every rank and in every operation: the collective's kind, the row count
(the product of the leading dims), the hidden size (the last dim), the dtype, the gathered or
scattered dimension and the whole shape. Ranks that differ raise
:class:`~mtp.parallel.errors.RankMismatchError` on every rank, naming the first field that
differs in user words ("disagree on the row count: rank 0 has 6 rows, rank 1 has 7 rows"),
before the data collective runs.

When it runs (the same answer on every rank of a well-formed program, never a per-rank cache:
a check that one rank skips and another runs would itself deadlock):

- every call, in eager mode, unless the ``validate`` setting is ``off`` (``MTP_VALIDATE=off``,
  which must then be set on every rank) and ``MTP_CHECK_COLLECTIVES`` is off;
- not while ``torch.compile`` traces, a CUDA graph is captured or the tensor is fake;
- a backward collective whose forward already checked the same tensor's shape and dtype (the
  autograd functions of :mod:`mtp.parallel.mappings` and the column-parallel GEMM) passes
  ``check=False``: one exchange per layer call, forward and backward together.

How the gathered rows are compared: on the device by default (``(rows == rows[0]).all()`` and
``torch._assert_async``: no host sync; on CPU the assert raises at once and the typed error is
built from the rows, a free host read there); on the host with the typed error when the
``validate`` setting is ``sync`` or ``MTP_CHECK_COLLECTIVES=1`` (one host read per collective).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mtp import settings
from mtp.utils import is_capturing

from . import agreement
from .agree import Agreement, Field, code_text, dtype_code, dtype_name, group_ranks, shape_field
from .agree import text_code
from .errors import RankMismatchError
from .groups import group_description

__all__ = ["COLLECTIVE_OPS", "ROW_SPEC", "ROW_WIDTH", "check_collective", "exchange_rows"]

#: The kinds of collective that exchange a row first (coded on every rank at import, so each
#: rank can print the operation another rank was in).
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "vocab_parallel_cross_entropy")
_OP_CODES = {op: text_code(op) for op in COLLECTIVE_OPS}


def _rows(v: list[int]) -> str:
    return f"{v[0]} row" if v[0] == 1 else f"{v[0]} rows"


#: The fields of the row, in the order a mismatch is reported.
ROW_SPEC = Agreement("", (
    Field("operation", (0,), lambda v: code_text(v[0])),
    Field("row count", (0,), _rows),
    Field("hidden size", (0,), lambda v: str(v[0])),
    Field("dtype", (0,), lambda v: dtype_name(v[0])),
    Field("dimension", (0,), lambda v: str(v[0])),
    shape_field("shape", ()),
))  # fmt: skip
ROW_WIDTH = ROW_SPEC.width
_MAX_DIMS = ROW_WIDTH - 6

_DIFFERENT_OPS = "mtp collective agreement check"
_DEVICE_MESSAGES = {
    op: f"{op}: the ranks of the tensor-parallel group disagree on the operation, row count, "
    "hidden size, dtype or shape of this collective; validate='sync' (or MTP_VALIDATE=sync) "
    "names the values"
    for op in COLLECTIVE_OPS
}


def _row(op: str, shape: Sequence[int], dtype: torch.dtype, dim: int) -> list[int]:
    """This rank's row (plain ints; see :data:`ROW_SPEC`)."""
    ndim = len(shape)
    dims = list(shape)
    if ndim > _MAX_DIMS:  # the leading dims and a checksum of all of them
        dims = dims[: _MAX_DIMS - 1] + [text_code(str(tuple(shape)))]
    hidden = shape[-1] if ndim else 1
    head = [_OP_CODES[op], math.prod(shape[:-1]), hidden, dtype_code(dtype), dim, ndim]
    return head + dims + [-1] * (_MAX_DIMS - len(dims))


def exchange_rows(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """The exchange itself: every rank's ``mine`` into ``out`` (one all-gather).
    :func:`mtp.testing.count_collectives` logs it as ``"agreement"``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


def _device_row(row: list[int], device: torch.device) -> torch.Tensor:
    mine = torch.tensor(row, dtype=torch.int64)
    if device.type == "cpu":
        return mine
    # from page-locked memory: an asynchronous copy, no wait for the device
    return mine.pin_memory().to(device, non_blocking=True)


def _mismatch(what: str, rows: list[list[int]], group) -> RankMismatchError:
    """The typed error for gathered ``rows`` that differ. Ranks in the same collective name it
    (:func:`~mtp.parallel.agreement.collective_region` then names the layer or mapping, from
    ``detail``); ranks in different ones get one message, the same on every rank."""
    same_op = all(row[0] == rows[0][0] for row in rows)
    spec = Agreement(what if same_op else _DIFFERENT_OPS, ROW_SPEC.fields)
    try:
        spec.check_rows(rows, group_ranks(group, len(rows)), where=group_description(group))
    except RankMismatchError as exc:
        if same_op:
            exc.detail = str(exc)
        return exc
    raise AssertionError("rows that differ raised nothing")  # pragma: no cover


def _compare(gathered: torch.Tensor, what: str, op: str, group, sync: bool) -> None:
    if sync:
        rows = gathered.tolist()
        if any(row != rows[0] for row in rows[1:]):
            raise _mismatch(what, rows, group)
        return
    same = (gathered == gathered[:1]).all()
    try:
        torch._assert_async(same, _DEVICE_MESSAGES[op])
    except RuntimeError:  # on CPU the assert raises at once: name the values (a free read)
        raise _mismatch(what, gathered.tolist(), group) from None


def _real(x: torch.Tensor) -> bool:
    """Not a fake, meta or traced (wrapper subclass) tensor: one whose values can be sent."""
    kind = type(x)
    return (kind is torch.Tensor or kind is torch.nn.Parameter) and not x.is_meta


def check_collective(
    op: str, x: torch.Tensor, group, dim: int = -1, *, what: str | None = None,
    shape: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """Exchange and compare the agreement row of the collective ``op`` (one of
    :data:`COLLECTIVE_OPS`) that this rank is about to run on ``x`` over ``group`` (see the
    module docstring for when it runs and how it compares).

    Args:
        op: the collective's kind.
        x: the tensor this rank passes (its dtype and device; its shape unless ``shape``).
        group: the process group (None: the default group).
        dim: the dimension a gather or scatter works along (-1 for an all-reduce).
        what: names the operation in the message (default ``op``).
        shape: the shape to compare instead of ``x.shape`` (the cross-entropy's rows).

    Raises:
        RankMismatchError: on every rank of ``group`` (CPU, or with a sync), naming the field,
            the values and the ranks; on CUDA by default a device-side assert instead.
    """
    if torch.compiler.is_compiling():
        return
    debug = agreement.check_collectives_enabled()
    mode = settings.current().validate
    if (mode == "off" and not debug) or not _real(x) or is_capturing():
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    row = _row(op, x.shape if shape is None else shape, x.dtype, dim)
    mine = _device_row(row, x.device)
    gathered = torch.empty((world, ROW_WIDTH), dtype=torch.int64, device=x.device)
    exchange_rows(gathered.view(-1), mine, group)
    _compare(gathered, what or op, op, group, debug or mode == "sync")
