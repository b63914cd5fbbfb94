"""Rank agreement: the values every rank of a group must share, exchanged and compared one way.

:func:`agree` is the one entry: ``agree(group, "initialize_model_parallel", order=order,
tensor_model_parallel_size=tp)`` all-gathers the fields once and raises the same
:class:`~mtp.parallel.errors.RankMismatchError` on every rank when any differs, naming the
field, the values and the ranks. Each value is encoded as int64s by its type
(:func:`encode_field`): ints travel as themselves, dtypes as their code in :data:`DTYPE_CODES`
(the one dtype table), ``torch.Size`` as a shape, anything else as a checksum plus the start of
its ``repr`` (so every rank can print every rank's value).

Hot paths fold the same fields into a collective that already moves data instead of adding one
(the project's rule): :func:`agreement` builds the :class:`Agreement` (its ``row`` is what one
rank contributes, :meth:`Agreement.tensor` puts it on the device), the caller sends it with its
data, and the gathered rows are compared by :meth:`Agreement.check_rows` (host values, after a
sync the op makes anyway) or :meth:`Agreement.check_device` (a device-side assert by default,
no host sync; ``validate="sync"`` for the typed error). Every check raises the message
:func:`mismatch_error` writes, so the wording is the same everywhere.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from mtp.utils import check_values, validation_mode

from .errors import RankMismatchError
from .groups import group_description

__all__ = [
    "DTYPE_CODES",
    "SLOTS",
    "Agreement",
    "Field",
    "agree",
    "agreement",
    "argument_field",
    "dtype_code",
    "dtype_name",
    "encode_field",
    "group_ranks",
    "mismatch_error",
    "shape_field",
    "value_field",
]

# --------------------------------------------------------------------------------------------
# Codes: dtypes and texts as int64 values every rank computes the same way
# --------------------------------------------------------------------------------------------

from mtp.dtypes import WIRE_DTYPE_NAMES as _DTYPE_NAMES  # noqa: E402  (the one table)
#: The one dtype table of rank agreement: ``dtype -> code`` (1-based; 0 is never a dtype).
DTYPE_CODES: dict[torch.dtype, int] = {
    getattr(torch, n): i + 1 for i, n in enumerate(_DTYPE_NAMES) if hasattr(torch, n)
}
_CODE_TEXT: dict[int, str] = {}


def text_code(text: str) -> int:
    """A stable int for ``text`` (crc32; the same in every process), remembered for messages."""
    value = zlib.crc32(text.encode())
    _CODE_TEXT[value] = text
    return value


def dtype_code(dtype: torch.dtype) -> int:
    """The code of ``dtype`` in :data:`DTYPE_CODES` (a checksum of its name for others)."""
    return DTYPE_CODES.get(dtype) or text_code(str(dtype))


def dtype_name(code: int) -> str:
    """The dtype a :func:`dtype_code` stands for (for messages)."""
    if 0 < code <= len(_DTYPE_NAMES):
        return _DTYPE_NAMES[code - 1]
    return _CODE_TEXT.get(code, f"dtype #{code}")


def code_text(code: int) -> str:
    """The text a :func:`text_code` stands for, quoted (for messages)."""
    return repr(_CODE_TEXT.get(code, f"#{code}"))


# --------------------------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Field:
    """One quantity the ranks must share: its name, this rank's int64s, and how to print one
    rank's int64s. Every rank encodes the same field to the same number of ints."""

    name: str
    ints: tuple[int, ...]
    fmt: Callable[[list[int]], str] = dataclasses.field(compare=False)


_TEXT_BYTES = 7  # bytes of text per int64 slot (stays positive)


def _pack_text(text: str, slots: int) -> list[int]:
    data = text.encode()[: slots * _TEXT_BYTES].ljust(slots * _TEXT_BYTES, b"\0")
    return [int.from_bytes(data[i : i + _TEXT_BYTES], "little") for i in range(0, len(data), 7)]


def _unpack_text(ints: list[int]) -> str:
    data = b"".join(int(v).to_bytes(_TEXT_BYTES, "little") for v in ints)
    return data.rstrip(b"\0").decode(errors="replace")


def value_field(name: str, value: object, slots: int = 4) -> tuple[str, list[int], Callable]:
    """Any Python value as ``(name, ints, fmt)``: ints in ``[0, 2**62)`` travel as themselves,
    anything else as a checksum of its ``repr`` plus the first ``7 * slots`` bytes of it (so
    every rank can print every rank's value)."""
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


_MAX_DIMS = 8


def shape_field(name: str, shape: Sequence[int]) -> Field:
    """A shape as ``ndim`` + 8 dims (longer shapes: 7 dims and a checksum of the whole)."""
    dims = list(shape)
    if len(dims) > _MAX_DIMS:  # compare the leading dims and a checksum of all of them
        dims = dims[: _MAX_DIMS - 1] + [text_code(str(tuple(shape)))]
    ints = [len(shape)] + dims + [-1] * (_MAX_DIMS - len(dims))

    def fmt(v: list[int]) -> str:
        ndim, rest = v[0], v[1:]
        if ndim > _MAX_DIMS:
            return _CODE_TEXT.get(rest[-1], f"a {ndim}-D shape")
        return str(tuple(rest[:ndim]))

    return Field(name, tuple(ints), fmt)


def argument_field(name: str, value: object) -> Field:
    """A function argument as a fixed-width :class:`Field` whatever its type (see
    :func:`value_field`), so ranks that pass different types (``2`` and ``"2"``) still compare
    field by field."""
    name, ints, fmt = value_field(name, value)
    return Field(name, tuple(ints), fmt)


def encode_field(name: str, value: object) -> Field:
    """``value`` as a :class:`Field`: a :class:`Field` as it is, a ``torch.dtype`` as its
    code, a ``torch.Size`` as a shape, a plain int (0 <= v < 2**62, not bool) as one int64,
    anything else as :func:`value_field` (checksum and text)."""
    if isinstance(value, Field):
        return value
    if isinstance(value, torch.dtype):
        return Field(name, (dtype_code(value),), lambda v: dtype_name(v[0]))
    if isinstance(value, torch.Size):
        return shape_field(name, value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < (1 << 62):
        return Field(name, (value,), lambda v: str(v[0]))
    name, ints, fmt = value_field(name, value)
    return Field(name, tuple(ints), fmt)


# --------------------------------------------------------------------------------------------
# The error
# --------------------------------------------------------------------------------------------


def mismatch_error(
    what: str, name: str, values: dict[int, str], where: str, hint: str = ""
) -> RankMismatchError:
    """The error every agreement check raises: ``values`` maps each rank (global rank, or the
    index in the group when ``where`` says so) to its printed value, in rank order; ``where``
    names the group (``"group of global ranks [0, 1]"``)."""
    ranks = list(values)
    first = ranks[0]
    odd = next(r for r in ranks if values[r] != values[first])
    every = ", ".join(f"rank {r}: {values[r]}" for r in ranks)
    exc = RankMismatchError(
        f"{what}: the ranks of the {where} disagree on the {name}: rank {first} has "
        f"{values[first]}, rank {odd} has {values[odd]} (every rank: {every}); every rank of "
        f"the group must pass the same {name}" + (f" ({hint})" if hint else ""),
        what=name,
        values=values,
    )
    exc.field = name
    return exc


def group_ranks(group, size: int) -> list[int]:
    """The global ranks of ``group`` (None: the world); ``range(size)`` when it cannot tell."""
    try:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - only for the message
        return list(range(size))


# --------------------------------------------------------------------------------------------
# Agreement: the fields of one check
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The fields one operation's ranks must share (see the module docstring).

    ``row`` is this rank's int64 values (the fields' ints, in order); a gathered ``[world,
    width]`` block of rows is compared by :meth:`check_rows` or :meth:`check_device`.
    """

    what: str
    fields: tuple[Field, ...]

    @property
    def row(self) -> list[int]:
        return [v for f in self.fields for v in f.ints]

    @property
    def width(self) -> int:
        return sum(len(f.ints) for f in self.fields)

    def _spans(self):
        start = 0
        for f in self.fields:
            yield f, start, start + len(f.ints)
            start += len(f.ints)

    def tensor(
        self, device: torch.device, *, fill: bool = False, values: dict[str, torch.Tensor] = {}
    ) -> torch.Tensor:
        """This rank's row as an int64 ``[width]`` tensor on ``device``: one host-to-device
        copy, or with ``fill`` one fill per value (no host-to-device copy). ``values``: fields
        whose value is already a 0-d device tensor (a checksum), copied in on the device (their
        ints in the row are placeholders)."""
        if fill:
            out = torch.empty(self.width, dtype=torch.int64, device=device)
            for i, v in enumerate(self.row):
                out[i] = v
        else:
            out = torch.tensor(self.row, dtype=torch.int64).to(device, non_blocking=True)
        for f, lo, _ in self._spans():
            if f.name in values:
                out[lo] = values[f.name]
        return out

    def check_rows(
        self, rows: Sequence[Sequence[int]], ranks: Sequence[int], *, where: str | None = None,
        skip: Sequence[str] = (), hint: str = "",
    ) -> None:  # fmt: skip
        """Raise :func:`mismatch_error` for the first field (not in ``skip``) whose values in
        ``rows`` (one per rank, host ints) differ; ``ranks`` name the rows."""
        where = where or f"group of global ranks {list(ranks)}"
        for f, lo, hi in self._spans():
            if f.name in skip:
                continue
            first = list(rows[0][lo:hi])
            if all(list(row[lo:hi]) == first for row in rows):
                continue
            values = {r: f.fmt(list(row[lo:hi])) for r, row in zip(ranks, rows)}
            raise mismatch_error(self.what, f.name, values, where, hint)

    def check_device(
        self, rows: torch.Tensor, group, *, validate: bool | str = True,
        skip: Sequence[str] = (), hint: str = "", tensors: Sequence[torch.Tensor] = (),
    ) -> None:  # fmt: skip
        """Compare a gathered ``[world, width]`` int64 block on the device: a device-side assert
        by default (no host sync; on CPU, where the assert raises at once, the typed error
        below instead: reading CPU values costs no sync), the typed
        :class:`RankMismatchError` naming the values with ``validate="sync"`` (one host read),
        nothing with ``validate=False``."""
        mode = validation_mode(validate)
        if mode == "off":
            return
        keep = [(f, lo, hi) for f, lo, hi in self._spans() if f.name not in skip]
        if mode == "sync":
            if rows.numel() and not _is_traced(rows):
                self._check_kept(rows, keep, group, hint)
            return
        names = [f.name for f, _, _ in keep]
        listed = ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]
        cols = torch.cat([rows[:, lo:hi] for _, lo, hi in keep], dim=1)
        try:
            check_values(
                (cols == cols[:1]).all(),
                f"{self.what}: the ranks of the {group_description(group)} disagree on the "
                f"{listed}" + (f" ({hint})" if hint else "")
                + "; validate='sync' (or MTP_VALIDATE=sync) names the values",
                validate=mode,
                tensors=(rows, *tensors),
            )
        except RuntimeError:  # on CPU the assert raises at once: name the values (a free read)
            if rows.device.type != "cpu":
                raise
            self._check_kept(rows, keep, group, hint)
            raise

    def _check_kept(self, rows: torch.Tensor, keep, group, hint: str) -> None:
        """:meth:`check_rows` of the ``keep`` spans of the gathered ``rows`` (a host read)."""
        cols = torch.cat([rows[:, lo:hi] for _, lo, hi in keep], dim=1).tolist()
        sub = Agreement(self.what, tuple(f for f, _, _ in keep))
        ranks = group_ranks(group, rows.shape[0])
        sub.check_rows(cols, ranks, where=group_description(group), hint=hint)


def _is_traced(t: torch.Tensor) -> bool:
    from mtp.utils import is_fake

    return torch.compiler.is_compiling() or is_fake(t)


def agreement(
    what: str, named: Mapping[str, object] | None = None, /, **values: object
) -> Agreement:
    """The :class:`Agreement` of ``values`` (each encoded by :func:`encode_field`, in the
    given order) for the operation ``what``; ``named``: fields whose names are not Python
    identifiers (``{"token count": n}``), first."""
    items = [*(named or {}).items(), *values.items()]
    return Agreement(what, tuple(encode_field(name, v) for name, v in items))


#: int64 values every rank sends in one :func:`agree` exchange (fixed, whatever the operation).
SLOTS = 64
_PAD = -(1 << 62)


def _comm_device(group, like: torch.Tensor | None) -> torch.device:
    if like is not None and like.device.type not in ("meta",):
        return like.device
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, what: str, /, *, like: torch.Tensor | None = None, **values: object) -> None:
    """All-gather ``values`` once over ``group`` (None: the default group) and raise the same
    :class:`RankMismatchError` on every rank if any differs.

    Every rank sends :data:`SLOTS` int64 values whatever the operation (a code of ``what``
    first, then the fields, padded), so ranks that are in different operations still exchange
    messages of the same size and get an "operation" mismatch rather than a crash. One host
    read (for arguments and debug checks; hot paths fold an :class:`Agreement` into their own
    collective instead). ``like``: a tensor whose device the exchange uses.

    Raises:
        RankMismatchError: on every rank, naming the first field that differs, the value of the
            group's first rank and the first rank that differs from it, and the group; its
            ``field`` attribute is the name and ``values`` maps global ranks to their values.
        ValueError: more than ``SLOTS - 1`` values in all.
    """
    if dist.get_world_size(group) == 1:
        return
    spec = agreement(what, **values)
    operation = Field("operation", (text_code(what),), lambda v: code_text(v[0]))
    flat = [operation.ints[0], *spec.row]
    if len(flat) > SLOTS:
        raise ValueError(f"{what}: {len(flat) - 1} values to agree on; at most {SLOTS - 1}")
    flat += [_PAD] * (SLOTS - len(flat))
    world = dist.get_world_size(group)
    device = _comm_device(group, like)
    mine = torch.tensor(flat, dtype=torch.int64, device=device)
    out = torch.empty(world * SLOTS, dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)
    rows = [row[: 1 + spec.width] for row in out.view(world, SLOTS).tolist()]
    ranks = group_ranks(group, world)
    where = group_description(group)
    try:
        Agreement("mtp collective agreement check", (operation,)).check_rows(
            rows, ranks, where=where
        )
    except RankMismatchError as exc:  # the ranks are in different operations
        raise exc from None
    spec.check_rows([row[1:] for row in rows], ranks, where=where)
