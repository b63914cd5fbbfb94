"""Every ``MTP_*`` environment variable: read and parsed here, once, and nowhere else.

The table (:data:`VARIABLES`; ``docs/settings.md`` shows it with every meaning):

- ``MTP_BACKEND`` -> ``backend``: a backend name, or unset for ``auto`` (:data:`AUTO_BACKENDS`).
- ``MTP_VALIDATE`` -> ``validate``: ``device`` (default), ``sync`` or ``off``.
- ``MTP_POISON_OUTPUTS`` -> ``poison_outputs``: boolean, default off.
- ``MTP_CHECK_COLLECTIVES`` -> ``check_collectives``: boolean, default off.
- ``MTP_ABORT_ON_ERROR`` -> ``abort_on_error``: ``abort`` (default), ``exit`` or ``off``.
- ``MTP_TRITON_TMA`` -> ``triton_tma``: boolean, or unset for ``auto`` (None).
- ``MTP_REVISION`` -> ``revision``: text, default unset.

Booleans are ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case; empty is
off). The environment is read once, when this module is imported; a value outside a variable's
set raises ``ValueError`` naming the variable, at the first :func:`current` (and every one after,
until the value is fixed and :func:`reload` called).

Use:

- :func:`current` returns the frozen :class:`Settings` in force (the environment under whatever
  :func:`configure` and :func:`override` set). It reads one global, takes no lock and reads no
  environment variable, so that code ``torch.compile`` traces may call it.
- :func:`override` changes settings for the duration of a ``with`` block (process-wide, so the
  autograd engine's threads see it; blocks nest). Tests and benches use it instead of flipping
  ``os.environ``.
- :func:`configure` sets values until :func:`reset`; :func:`reload` reads the environment again
  (after a program changed it); :func:`reset` forgets :func:`configure` values and reloads
  (``tests/conftest.py`` calls it around every test).
- :func:`explicit` is what :func:`configure` and :func:`override` set now, so that
  ``mtp.testing.run_distributed`` hands it to the processes it spawns.

This module imports nothing but the standard library (``python -m mtp.parallel`` and the build
scripts stay torch-free). Build and tool variables (:data:`TOOL_VARIABLES`) are listed for
completeness; they are read by the scripts named there, which run where ``mtp`` cannot be
imported (the isolated build, the minimum-triton venv).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "Settings",
    "Variable",
    "VARIABLES",
    "TOOL_VARIABLES",
    "BACKEND_NAMES",
    "AUTO_BACKENDS",
    "current",
    "override",
    "configure",
    "reload",
    "reset",
    "explicit",
    "parse",
    "markdown_table",
]

#: Every backend name an op of mtp has (``MTP_BACKEND`` must be one of them; an op that does not
#: have the named backend ignores the variable, so one value can steer several ops).
BACKEND_NAMES = ("triton", "reference", "torch", "fused", "cutlass", "multistream", "sequential")

#: What ``backend="auto"`` means, per op (one rule each; ``mtp.ops._backend.auto_backend``).
AUTO_BACKENDS: dict[str, str] = {
    "bias_gelu, bias_swiglu, vocab_parallel_cross_entropy, permute, unpermute, grouped_mlp, moe_router":
        "``MTP_BACKEND`` if the op has it; else ``triton`` on CUDA, ``reference`` elsewhere",
    "grouped_gemm": "``MTP_BACKEND`` if it is one of the grouped GEMM backends; else ``triton`` "
        "on CUDA, ``reference`` elsewhere",
    "linear_cross_entropy": "``MTP_BACKEND`` if the op has it (``reference`` means its plain-"
        "PyTorch backend, ``torch``); else ``triton`` on CUDA, ``torch`` elsewhere; float64 "
        "inputs always take ``torch``",
    "GroupedMLP / MoELayer experts": "as ``grouped_gemm``, except on CPU, where PyTorch's "
        "grouped matmul (the ``torch`` backend: ``F.grouped_mm``) is used when PyTorch has it and "
        "``MTP_BACKEND`` does not name a grouped GEMM backend",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(
            f"{name} must be a boolean (1/true/yes/on or 0/false/no/off), got {value!r}"
        )

    return parse


def _flag_or_auto(name: str) -> Callable[[Any], bool | None]:
    flag = _flag(name)

    def parse(value: Any) -> bool | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
            return None
        try:
            return flag(value)
        except ValueError:
            raise ValueError(f"{name} must be 1, 0 or auto (unset), got {value!r}") from None

    return parse


def _choice(name: str, mapping: Mapping[Any, str], allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        key = value if isinstance(value, bool) else str(value).strip().lower()
        if key not in mapping:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        return mapping[key]

    return parse


def _backend(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    if text in ("", "auto"):
        return None
    if text not in BACKEND_NAMES:
        raise ValueError(f"MTP_BACKEND must be one of {', '.join(BACKEND_NAMES)} (or unset for "
                         f"auto), got {value!r}")
    return text


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


_VALIDATE = {
    "": "device", "device": "device", "sync": "sync", "off": "off", "0": "off", "false": "off",
}
_ABORT = {
    **{k: "off" for k in _FALSE}, False: "off",
    **{k: "abort" for k in (*_TRUE, "abort")}, True: "abort",
    "exit": "exit",
}


@dataclasses.dataclass(frozen=True)
class Variable:
    """One row of the table: the variable, the :class:`Settings` field it sets, the values it
    takes, its default and what it does. ``parse`` turns the variable's text (or a Python value
    given to :func:`override`) into the field's value and raises ``ValueError`` naming the
    variable for anything else."""

    name: str
    field: str
    values: str
    meaning: str
    parse: Callable[[Any], Any]

    @property
    def default(self) -> Any:
        """The field's value when the variable is unset (:class:`Settings`' default)."""
        return Settings.__dataclass_fields__[self.field].default


VARIABLES: tuple[Variable, ...] = (
    Variable("MTP_BACKEND", "backend", "a backend name (" + ", ".join(BACKEND_NAMES) + ")",
             "What `backend=\"auto\"` picks, for the ops that have that backend (see "
             "AUTO_BACKENDS); unset: the fused kernel on CUDA, the reference elsewhere.",
             _backend),
    Variable("MTP_VALIDATE", "validate", "device, sync, off (0, false)",
             "How `validate=True` runs data-dependent checks: on the device without a host sync "
             "(default), with a sync and a typed Python error (`sync`, for debugging), or not; "
             "also how the agreement row before each tensor-parallel collective is compared "
             "(`off`: not exchanged; set it on every rank).",
             _choice("MTP_VALIDATE", _VALIDATE, "sync, device, off")),
    Variable("MTP_POISON_OUTPUTS", "poison_outputs", "boolean",
             "Fill op outputs with NaN (integers: the largest value) when allocated, so that an "
             "element a kernel forgets to write fails a test (the test suite turns it on).",
             _flag("MTP_POISON_OUTPUTS")),
    Variable("MTP_CHECK_COLLECTIVES", "check_collectives", "boolean",
             "Compare the agreement row before each tensor-parallel collective on the host (a "
             "typed error naming the values on every device, one host read per collective) and "
             "check every MoE dispatch (debugging).",
             _flag("MTP_CHECK_COLLECTIVES")),
    Variable("MTP_ABORT_ON_ERROR", "abort_on_error", "abort (1, true), exit, off (0, false, "
             "empty)",
             "What an error inside a collective region does: abort the process group so that "
             "the other ranks fail fast, exit the process, or nothing (the group stays usable).",
             _choice("MTP_ABORT_ON_ERROR", _ABORT, "'abort', 'exit', '0' (off)")),
    Variable("MTP_TRITON_TMA", "triton_tma", "boolean, or auto (unset)",
             "Force the grouped GEMM's TMA kernels on (wherever the operands allow) or off; "
             "auto: on CUDA devices of compute capability 9.0 and later.",
             _flag_or_auto("MTP_TRITON_TMA")),
    Variable("MTP_REVISION", "revision", "text",
             "The revision the benchmarks record instead of asking git (tools/gpu_check.py "
             "sets it where the copy is not a git checkout).",
             _text),
)

#: Variables of the build and of the developer tools: read by the script named, which runs
#: where mtp is not importable. ``(name, read by, meaning)``.
TOOL_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("MTP_BUILD_CUDA", "setup.py, csrc/build_ext.py",
     "1: the CUTLASS extension must build; 0: skip it; unset: build it when nvcc is found"),
    ("MTP_CUDA_ARCH_LIST", "csrc/build_ext.py",
     "architectures of the CUTLASS extension (e.g. `9.0a;10.0a`), before TORCH_CUDA_ARCH_LIST"),
    ("MTP_NVCC_LAUNCHER", "csrc/build_ext.py", "a command put before nvcc (e.g. `ccache`)"),
    ("MTP_SKIP_CUDA_EXT", "Makefile", "1: `make test` does not build the CUTLASS extension"),
    ("MTP_REQUIRE_CUDA_EXT", "tests/test_cutlass_build.py",
     "1: a missing CUTLASS extension fails the tests instead of skipping them"),
    ("MTP_MIN_TRITON", "tools/triton_min_check.py", "the triton version of the minimum check"),
    ("MTP_MIN_TRITON_STRICT", "tools/triton_min_check.py",
     "1: a kernel that no AOT test compiles fails the check"),
    ("MTP_MIN_TRITON_REPORT", "tools/triton_min_check.py", "file the check writes its report to"),
    ("MTP_FAILURES_FILE", "tools/pytest_live_failures.py", "file failures are appended to live"),
)

_BY_FIELD = {v.field: v for v in VARIABLES}
_BY_NAME = {v.name: v for v in VARIABLES}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings in force (see the module table)."""

    backend: str | None = None
    validate: str = "device"
    poison_outputs: bool = False
    check_collectives: bool = False
    abort_on_error: str = "abort"
    triton_tma: bool | None = None
    revision: str | None = None


_lock = threading.Lock()  # taken by the writers only; current() reads one global
_environment: dict[str, Any] | None = None  # parsed variables that are set, by field
_configured: dict[str, Any] = {}
_overrides: list[dict[str, Any]] = []
_current: Settings | None = None


def parse(variable: str, value: Any) -> Any:
    """The value of ``variable`` (its name, ``"MTP_VALIDATE"``, or field, ``"validate"``) for
    ``value`` (the variable's text or a Python value). Raises ``ValueError`` naming the variable
    for a value outside its set, ``KeyError`` for an unknown variable."""
    entry = _BY_NAME.get(variable) or _BY_FIELD.get(variable)
    if entry is None:
        raise KeyError(f"no setting {variable!r}; known: {', '.join(_BY_NAME)}")
    return entry.parse(value)


def _read_environment() -> dict[str, Any]:
    values = {}
    for entry in VARIABLES:
        text = os.environ.get(entry.name)
        if text is not None:
            values[entry.field] = entry.parse(text)
    return values


def _checked(kwargs: Mapping[str, Any], caller: str) -> dict[str, Any]:
    out = {}
    for field, value in kwargs.items():
        entry = _BY_FIELD.get(field)
        if entry is None:
            raise TypeError(f"{caller}() got an unknown setting {field!r}; known: "
                            f"{', '.join(_BY_FIELD)}")
        out[field] = entry.parse(value)
    return out


def _rebuild() -> Settings:
    """Merge the layers into :data:`_current` (the caller holds :data:`_lock`). Reads the
    environment when it has not been read; a bad value raises and leaves :data:`_current`
    None, so that the next :func:`current` raises again."""
    global _current, _environment
    _current = None
    if _environment is None:
        _environment = _read_environment()
    merged = {**_environment, **_configured}
    for layer in _overrides:
        merged.update(layer)
    _current = Settings(**merged)
    return _current


def current() -> Settings:
    """The settings in force: the environment (read when :mod:`mtp.settings` is imported, or
    by :func:`reload`) under :func:`configure` and the innermost :func:`override` blocks.

    Lock-free (one global read): every writer rebuilds the settings before it returns, so code
    that ``torch.compile`` traces can call it (Dynamo cannot enter a lock, and nothing under a
    trace reads the environment). Only when the environment held a bad value does it read the
    environment again, and raise the ``ValueError`` naming the variable."""
    settings = _current
    if settings is not None:
        return settings
    with _lock:
        return _rebuild()


@contextlib.contextmanager
def override(**kwargs: Any) -> Iterator[Settings]:
    """Set the given fields (``override(validate="sync", poison_outputs=False)``) inside the
    block; yields the settings in force there. Values are checked like the variables' text."""
    layer = _checked(kwargs, "override")
    with _lock:
        _overrides.append(layer)
        _rebuild_quietly()
    try:
        yield current()
    finally:
        with _lock:
            del _overrides[next(i for i, x in enumerate(_overrides) if x is layer)]
            _rebuild_quietly()


def _rebuild_quietly() -> None:
    """:func:`_rebuild`, leaving a bad environment's error to the next :func:`current`."""
    try:
        _rebuild()
    except ValueError:
        pass


def configure(**kwargs: Any) -> Settings:
    """Set the given fields for this process until :func:`reset` (``override`` blocks still win
    inside them). Returns the settings in force."""
    layer = _checked(kwargs, "configure")
    with _lock:
        _configured.update(layer)
        _rebuild_quietly()
    return current()


def reload() -> Settings:
    """Read the environment again (keeping :func:`configure` and :func:`override` values)."""
    global _environment
    with _lock:
        _environment = None
        return _rebuild()


def reset() -> Settings:
    """Forget :func:`configure` values and read the environment again."""
    with _lock:
        _configured.clear()
    return reload()


def explicit() -> dict[str, Any]:
    """The fields :func:`configure` and the open :func:`override` blocks set now."""
    with _lock:
        merged = dict(_configured)
        for layer in _overrides:
            merged.update(layer)
    return merged


def markdown_table() -> str:
    """The table of :data:`VARIABLES` as Markdown (``docs/settings.md`` holds it verbatim)."""
    rows = ["| variable | field | values | default | meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        default = {None: "unset", False: "off", True: "on"}.get(v.default, v.default)
        rows.append(f"| `{v.name}` | `{v.field}` | {v.values} | {default} | {v.meaning} |")
    return "\n".join(rows)


# Read the environment now, at import, so that the first current() never has to (a bad value
# is raised by the first current() instead, naming the variable).
with _lock:
    _rebuild_quietly()
