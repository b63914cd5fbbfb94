"""What every ``bench_<op>.py`` shares: cases, providers, runs, and the correctness check.

A bench module describes its op family with

- ``FAMILY`` (``"bias_act"``) and ``OPS`` (the op names it benches: ``("bias_gelu", ...)``);
- ``cases(size, dtype)`` -> :class:`Case` list, ``size`` one of ``"smoke"`` (tiny, CPU),
  ``"quick"`` or ``"full"`` (GPU shapes);
- ``providers(op)`` -> :class:`Provider` list: each mtp backend (``kind="mtp"``), the plain
  PyTorch reference and ``torch.compile`` of it (``"baseline"``), and peers (``"peer"``);
- one ``setup_<op>(case, provider, device) -> Run`` factory per op, shared by the CPU smoke
  pass, the GPU speed and memory runs and the pytest-benchmark cases; the provider name
  ``"float64"`` builds the float64 reference the others are checked against;
- the byte and FLOP formulas of its ops (unit-tested against hand counts);
- optionally ``structure(size) -> dict``: extra structural figures (collectives, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mtp.testing.numerics import relative_error_limit

__all__ = [
    "DTYPES",
    "Case",
    "Provider",
    "Run",
    "Skip",
    "FLOAT64",
    "dtype_name",
    "seeded",
    "randn",
    "rel_err",
    "check_limit",
    "import_peer",
    "compiled",
]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FLOAT64 = "float64"  # provider name of the float64 reference (checks only, never timed)
PASSES = ("fwd", "fwd+bwd")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (``"fp64"``, ``"int64"``... for the others)."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    return {torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


@dataclasses.dataclass
class Case:
    """One shape of one op in one pass.

    Attributes:
        op: op name (``"grouped_gemm"``).
        label: short shape description for tables (``"E=8 top2 M=8192 K=4096 N=14336"``).
        params: the sizes (and routing skew, ...) the setup factory reads.
        dtype: activation dtype.
        pass_: ``"fwd"`` or ``"fwd+bwd"``.
        bytes: fewest bytes one call must move through device memory (formula), or None.
        flops: floating-point operations of one call (formula; None for memory-bound ops).
        group: series name for plots (``"Mixtral-like balanced"``); defaults to ``op``.
        check: compare the providers with the float64 / reference result (off for
            structure-only cases).
        execute: run Triton kernels while counting on CPU (False: record launches only, for
            structural counts at sizes the interpreter is too slow for).
    """

    op: str
    label: str
    params: dict[str, Any]
    dtype: torch.dtype
    pass_: str
    bytes: int | None
    flops: int | None = None
    group: str = ""
    check: bool = True
    execute: bool = True

    def __post_init__(self) -> None:
        if self.pass_ not in PASSES:
            raise ValueError(f"pass_ must be one of {PASSES}, got {self.pass_!r}")
        self.group = self.group or self.op

    @property
    def bound(self) -> str:
        """``"compute"`` when FLOPs are given, else ``"memory"`` (how the floor is computed)."""
        return "compute" if self.flops else "memory"

    def key(self) -> str:
        return f"{self.op}|{self.label}|{dtype_name(self.dtype)}|{self.pass_}"


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation that a case is run with.

    Attributes:
        name: ``"triton"``, ``"reference"``, ``"torch.compile"``, ``"liger"``, ...
        kind: ``"mtp"`` (an mtp backend), ``"baseline"`` (plain PyTorch reference or
            torch.compile of it) or ``"peer"`` (another project).
        cpu: runs in the CPU smoke pass (the Triton backends do, under the interpreter).
        needs: why it may be unavailable: a callable returning None when it can run on
            ``device``, else the reason (shown as the skip note).
        note: what differs in the work this provider is timed on (copied into its records).
        tolerance: the largest relative error of its output against the reference, when not
            the case dtype's (FP8 providers: their recipe's error; 0: bitwise).
        rate: ``"bf16"`` or ``"fp8"``: the datasheet tensor-core rate its floor is taken at
            (an FP8 GEMM against the FP8 peak).
    """

    name: str
    kind: str
    cpu: bool = True
    needs: Callable[[torch.device], str | None] | None = None
    note: str = ""
    tolerance: float | None = None
    rate: str = "bf16"

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda" and not self.cpu:
            return "GPU only (not run in the CPU smoke pass)"
        if self.needs is None:
            return None
        try:
            return self.needs(device)
        except Exception as exc:  # a broken optional install must not stop the run
            return f"unavailable: {type(exc).__name__}: {exc}"


@dataclasses.dataclass
class Run:
    """A ready-to-call benchmark body.

    Attributes:
        fn: one call of the op (forward, or forward and backward with ``torch.autograd.grad``,
            so nothing accumulates between calls); returns the tensors that are checked.
        grad_to_none: tensors whose ``.grad`` the timer resets between calls (if any).
        inputs: the tensors the call reads (kept alive; their size is reported).
        graph_fn: for layers that support it, a zero-arg callable returning a captured CUDA
            graph's replay function (the eager-vs-graph comparison).
        for_check: maps ``fn``'s outputs to the layout of the reference's outputs, applied
            only to the checked call (never timed): a peer whose API returns the same result
            in pieces (Liger's SwiGLU: da and dg rather than dx and dbias).
    """

    fn: Callable[[], Sequence[torch.Tensor]]
    grad_to_none: list[torch.Tensor] = dataclasses.field(default_factory=list)
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    graph_fn: Callable[[], Callable[[], Any]] | None = None
    for_check: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] | None = None


class Skip(Exception):  # noqa: N818 - a skip, not an error
    """Raised by a setup factory when its provider cannot run this case (the record is
    "skipped" with the message, not "failed"): e.g. a CUDA graph of a forward+backward."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def seeded(case: Case, device: torch.device, salt: str = "") -> torch.Generator:
    """A generator on ``device`` seeded from the case (same inputs for every provider)."""
    digest = hashlib.sha256(f"{case.op}|{case.label}|{salt}".encode()).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest[:7], "little"))
    return gen


def randn(shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale=1.0):
    """Normal random values (never zeros: METHOD.md) in ``dtype``; drawn in fp32 on the device."""
    t = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype)


def upcast(t: torch.Tensor | None, provider: str) -> torch.Tensor | None:
    """``t`` in float64 for the float64 reference provider; unchanged otherwise."""
    if t is None or provider != FLOAT64 or not t.dtype.is_floating_point:
        return t
    return t.detach().double().requires_grad_(t.requires_grad)


# --------------------------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------------------------

#: Largest accepted ``||out - ref|| / ||ref||`` per dtype (METHOD.md: fp32 far under 1e-3, tf32
#: near 3e-4, bf16 operands between 1e-3 and 1e-2; a bit of margin on top).
def check_limit(dtype: torch.dtype) -> float:
    """The largest relative error a provider's output may have (``mtp.testing.numerics``)."""
    return relative_error_limit(dtype)


#: Elements per float64 chunk in :func:`rel_err` (32 MiB of float64 per operand): the check of
#: a 30 GB weight gradient must not need a float64 copy of it.
REL_ERR_CHUNK = 1 << 22


def _diff_and_norm(a: torch.Tensor, e: torch.Tensor, chunk: int) -> tuple[float, float]:
    """``(||a - e||^2, ||e||^2)`` accumulated in float64 over flat chunks of ``chunk``
    elements (NaN when ``a`` holds NaN); no full float64 copy of either operand."""
    a, e = a.detach().reshape(-1), e.detach().to(a.device).reshape(-1)
    diff2 = torch.zeros((), dtype=torch.float64, device=a.device)
    ref2 = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), chunk):
        a64 = a[start:start + chunk].double()
        e64 = e[start:start + chunk].double()
        diff2 += (a64 - e64).square().sum()
        ref2 += e64.square().sum()
    return diff2.item(), ref2.item()


def rel_err(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
            chunk: int = REL_ERR_CHUNK) -> float:
    """Largest ``||a - e|| / ||e||`` over the tensor pairs (inf on NaN or shape mismatch),
    computed in float64 chunk by chunk (``chunk`` elements at a time)."""
    if len(actual) != len(expected):
        return float("inf")
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        if a is None or e is None:
            if (a is None) != (e is None):
                return float("inf")
            continue
        if tuple(a.shape) != tuple(e.shape):
            return float("inf")
        if a.numel() == 0:
            continue
        if not a.dtype.is_floating_point:
            worst = max(worst, 0.0 if torch.equal(a, e.to(a.device, a.dtype)) else float("inf"))
            continue
        diff2, ref2 = _diff_and_norm(a, e, chunk)
        if diff2 != diff2:  # NaN: an unwritten (poisoned) or broken output
            return float("inf")
        diff, ref = diff2**0.5, ref2**0.5
        worst = max(worst, diff / ref if ref > 0 else diff)
    return worst


# --------------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------------


def import_peer(module: str, attr: str | None = None) -> str | None:
    """None when ``module`` (and ``attr`` in it) imports, else a short reason."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a peer whose import fails for other reasons
        return f"{module} not importable ({type(exc).__name__}: {str(exc)[:80]})"
    if attr is not None:
        obj = mod
        for part in attr.split("."):
            if not hasattr(obj, part):
                return f"{module} has no {attr}"
            obj = getattr(obj, part)
    return None


def peer_attr(module: str, attr: str) -> Any:
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


_COMPILED: dict[Any, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, cached per function (compiled once per run, not per case)."""
    if fn not in _COMPILED:
        # dynamic=False: one graph per shape, as a user's static-shape training step compiles
        # (by default the second shape would turn the graph dynamic, slower than either).
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def needs_compile(device: torch.device) -> str | None:
    """torch.compile is timed on GPUs only (on CPU it needs a C++ toolchain and minutes)."""
    if device.type != "cuda":
        return "torch.compile is compared on GPU only"
    return None


def needs_cuda(device: torch.device) -> str | None:
    return None if device.type == "cuda" else "needs a CUDA GPU"
