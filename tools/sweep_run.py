"""One candidate of the tuning sweep, run: operands of a family at a shape, the candidate's
launch, the reference it is checked against and the peers timed beside it.

The same code runs on a GPU (timing), under the Triton interpreter on CPU tensors (the dry
run's correctness check, float64 reference) and on ``meta`` tensors inside
:func:`tools.sweep_compile.compile_only` (kernels compiled, not launched: the parallel
pre-compile and the ahead-of-time report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from bench.core import check_limit, rel_err
from mtp.kernels._launch import Plans
from mtp.kernels.grouped_gemm_details import launch
from mtp.ops.grouped_gemm.backends import GROUPED_GEMM_BACKENDS, torch_grouped_mm
from sweep_space import PATCHES, Shape, to_config

INTERPRETER_PROGRAMS = 4  # persistent grids under the interpreter: a few programs
TINY_COUNTS = (40, 0, 33, 17)  # the tiny shape's routing: an empty expert and a 6-row tail


def counts_for(s: Shape, device) -> torch.Tensor:
    if s.model == "tiny":
        return torch.tensor(TINY_COUNTS, dtype=torch.int64, device=device)
    return torch.full((s.E,), s.M // s.E, dtype=torch.int64, device=device).add_(
        (torch.arange(s.E, device=device) < s.M % s.E).long())


def run_config(cand: dict, device):
    """The candidate's config for ``device`` (under the interpreter: a few persistent
    programs)."""
    cfg = to_config(cand)
    if str(device) == "cpu" and cfg.programs:
        cfg = dataclasses.replace(cfg, programs=INTERPRETER_PROGRAMS)
    return cfg


def _tensor(shape, device, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    if str(device) == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return (torch.randn(shape, device=device) * scale).to(dtype)


def _poison(*outs: torch.Tensor) -> None:
    for t in outs:
        if t.device.type != "meta" and t.dtype.is_floating_point:
            t.fill_(float("nan"))


@dataclasses.dataclass
class GemmRun:
    """Operands of one grouped GEMM family at shape ``s`` on ``device``; see
    :mod:`sweep_space` for the families."""

    family: str
    s: Shape
    device: torch.device | str

    def __post_init__(self) -> None:
        E, M, K, N, dev = self.s.E, self.s.M, self.s.K, self.s.N, self.device
        torch.manual_seed(0)
        self.counts = counts_for(self.s, dev)
        self.probs = None
        fam = self.family
        if fam == "gg_fwd":
            self.a, self.w = _tensor((M, K), dev), _tensor((E, K, N), dev, scale=K**-0.5)
            self.b, self.outs = self.w, (torch.empty((M, N), dtype=torch.bfloat16, device=dev),)
        elif fam == "gg_dgrad":  # dy [M, K] times the fc1 weight [E, N, K] read transposed
            self.a, self.w = _tensor((M, K), dev), _tensor((E, N, K), dev, scale=K**-0.5)
            self.b, self.outs = self.w.transpose(1, 2), (
                torch.empty((M, N), dtype=torch.bfloat16, device=dev),)
        elif fam == "gg_wgrad":
            self.a, self.b = _tensor((M, K), dev), _tensor((M, N), dev)
            self.outs = (torch.empty((E, K, N), dtype=torch.bfloat16, device=dev),)
        elif fam in ("gg_act", "gg_dact"):
            self.a = _tensor((M, K), dev)
            self.probs = torch.rand(M, device=dev) if str(dev) != "meta" else torch.empty(
                M, device=dev)
            if fam == "gg_act":
                self.w = _tensor((E, K, 2 * N), dev, scale=K**-0.5)
                self.b = self.w
                self.outs = (torch.empty((M, 2 * N), dtype=torch.bfloat16, device=dev),
                             torch.empty((M, N), dtype=torch.bfloat16, device=dev))
            else:  # g [M, H] times w2 [E, F, H] read transposed; h is fc1's pre-activation
                self.w = _tensor((E, N, K), dev, scale=K**-0.5)
                self.b = self.w.transpose(1, 2)
                self.h = _tensor((M, 2 * N), dev)
                self.outs = (torch.empty((M, 2 * N), dtype=torch.bfloat16, device=dev),)
        else:
            raise ValueError(f"not a grouped GEMM family: {fam!r}")

    @property
    def flops(self) -> int:
        gated = 2 if self.family == "gg_act" else 1
        return 2 * self.s.M * self.s.K * self.s.N * gated

    def config(self, cand: dict):
        return run_config(cand, self.device)

    def run(self, cand: dict) -> tuple[torch.Tensor, ...]:
        cfg, c = self.config(cand), self.counts
        if self.family in ("gg_fwd", "gg_dgrad"):
            launch.forward(self.a, self.b, c, self.outs[0], cfg)
        elif self.family == "gg_wgrad":
            launch.wgrad(self.a, self.b, c, self.outs[0], cfg)
        elif self.family == "gg_act":
            launch.forward_act(self.a, self.b, c, *self.outs, cfg, "swiglu", probs=self.probs)
        else:
            part = launch.dgrad_act(self.a, self.b, c, self.h, self.outs[0], cfg, "swiglu",
                                    probs=self.probs)  # fmt: skip
            return (self.outs[0], part.sum(0) if part is not None else None)
        return self.outs

    def checked(self, cand: dict) -> tuple[torch.Tensor, ...]:
        _poison(*self.outs)
        return self.run(cand)

    # -- the reference and the peers ----------------------------------------------------------

    def _mm(self, a, b, wgrad=False) -> torch.Tensor:
        """``a @ b[e]`` per expert (``wgrad``: ``a_e^T b_e``); F.grouped_mm on CUDA, else a
        float64 loop; zero rows past the routed ones."""
        offs = torch.cumsum(self.counts, 0, dtype=torch.int32)
        if a.is_cuda and torch_grouped_mm() is not None:
            out = torch_grouped_mm()(a.t() if wgrad else a, b, offs=offs)
            if not wgrad:
                out[int(offs[-1]):] = 0
            return out  # bf16 (fp32 accumulation): rel_err upcasts chunk by chunk
        a64, b64, row = a.double(), b.double(), 0
        out = torch.zeros((self.s.E, a.shape[1], b.shape[1]) if wgrad else (a.shape[0], b.shape[2]),
                          dtype=torch.float64, device=a.device)  # fmt: skip
        for e, m in enumerate(self.counts.tolist()):
            if wgrad:
                out[e] = a64[row:row + m].t() @ b64[row:row + m]
            else:
                out[row:row + m] = a64[row:row + m] @ b64[e]
            row += m
        return out

    def reference(self) -> tuple[torch.Tensor, ...]:
        fam = self.family
        if fam in ("gg_fwd", "gg_dgrad"):
            return (self._mm(self.a, self.b),)
        if fam == "gg_wgrad":
            return (self._mm(self.a, self.b, wgrad=True),)
        p = self.probs.to(torch.float64 if not self.a.is_cuda else torch.float32)[:, None]
        if fam == "gg_act":
            h = self._mm(self.a, self.b)
            gate, up = h.to(p.dtype).chunk(2, dim=1)
            return (h, F.silu(gate) * up * p)
        dy = self._mm(self.a, self.b).to(p.dtype)
        gate, up = self.h.to(dy.dtype).chunk(2, dim=1)
        sig = torch.sigmoid(gate)
        silu, dsilu = gate * sig, sig * (1 + gate * (1 - sig))
        routed = (torch.arange(self.s.M, device=dy.device) < int(self.counts.sum()))[:, None]
        dh = torch.cat([dy * p * up * dsilu, dy * p * silu], dim=1) * routed
        return (dh, (dy * silu * up * routed).sum(1))

    def check(self, outs) -> dict:
        if getattr(self, "_expected", None) is None:  # the same inputs for every candidate
            self._expected = self.reference()
        err = rel_err(outs, self._expected)
        limit = check_limit(torch.bfloat16)
        return {"rel_err": err, "limit": limit, "ok": err <= limit}

    def peers(self) -> dict[str, Callable[[], object]]:
        """GPU only: F.grouped_mm (unfused epilogue for the activation families) and the CUTLASS
        backend when its module loads, on the same operands."""
        mm = torch_grouped_mm()
        if not self.a.is_cuda or mm is None:
            return {}
        offs = torch.cumsum(self.counts, 0, dtype=torch.int32)
        a, b, fam = self.a, self.b, self.family
        out = {}
        if fam in ("gg_fwd", "gg_dgrad"):
            out["F.grouped_mm"] = lambda: mm(a, b, offs=offs)
        elif fam == "gg_wgrad":
            out["F.grouped_mm"] = lambda: mm(a.t(), b, offs=offs)
        elif fam == "gg_act":
            p = self.probs[:, None]

            def unfused():
                gate, up = mm(a, b, offs=offs).chunk(2, dim=1)
                return (F.silu(gate) * up * p).to(torch.bfloat16)

            out["F.grouped_mm+torch"] = unfused
        if fam in ("gg_fwd", "gg_dgrad", "gg_wgrad") and _cutlass_ready(a, self.w):
            impl = GROUPED_GEMM_BACKENDS["cutlass"]
            if fam == "gg_wgrad":
                out["cutlass"] = lambda: impl.wgrad(a, b, self.counts, self.outs[0])
            else:
                trans = fam == "gg_dgrad"
                out["cutlass"] = lambda: impl.forward(a, self.w, self.counts, trans, self.outs[0])
        return out


def _cutlass_ready(x, w) -> bool:
    try:
        GROUPED_GEMM_BACKENDS["cutlass"].check(x, w)
    except (TypeError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------------------------
# Memory-bound families: the bench's setup factories, the module's launch constants patched
# --------------------------------------------------------------------------------------------


_APPLIED: dict[str, tuple] = {}  # module name -> the constants its launch plans were built with


def _owner(modules: tuple[types.ModuleType, ...], name: str) -> types.ModuleType:
    for module in modules:
        if hasattr(module, name):
            return module
    raise AttributeError(f"none of {[m.__name__ for m in modules]} has a constant {name}")


def _forget_plans(module: types.ModuleType, values: tuple) -> None:
    """Drop the module's cached launch plans when they were built under other constants (a
    plan binds the constexprs of its first call: a patched constant must not reuse it)."""
    if _APPLIED.get(module.__name__) != values:
        for obj in vars(module).values():
            if isinstance(obj, Plans):
                obj.clear()
        _APPLIED[module.__name__] = values


@contextlib.contextmanager
def patched(modules: tuple[types.ModuleType, ...], values: dict) -> Iterator[None]:
    """Set the constants ``values`` (each in the first of ``modules`` that has it) for the
    block; a function default bound to the old value (``def f(n, elements=TILE_ELEMENTS)``) is
    set too, and the modules' launch plans are rebuilt when the constants changed. Restored on
    exit."""
    saved, defaults = {}, {}
    for name, value in values.items():
        if name == "baseline":
            continue
        module = _owner(modules, name)
        old = saved[module, name] = getattr(module, name)
        setattr(module, name, value)
        for fn in vars(module).values():
            if isinstance(fn, types.FunctionType) and fn.__defaults__ and any(
                    d is old for d in fn.__defaults__):
                defaults.setdefault(fn, fn.__defaults__)
                fn.__defaults__ = tuple(value if d is old else d for d in fn.__defaults__)
    applied = tuple(sorted((k, v) for k, v in values.items() if k != "baseline"))
    for module in modules:
        _forget_plans(module, applied)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        for fn, value in defaults.items():
            fn.__defaults__ = value


@dataclasses.dataclass
class MemoryRun:
    """One bench case (``fwd+bwd``) of a memory-bound family through the op, the family's
    kernel constants set by the candidate."""

    family: str
    case: object  # bench.core.Case
    device: torch.device

    def __post_init__(self) -> None:
        kernels, bench_module, _ = PATCHES[self.family]
        self.modules = tuple(importlib.import_module(name) for name in kernels)
        self.setup = importlib.import_module(bench_module).SETUP[self.case.op]
        self._expected = None

    @property
    def bytes(self) -> int:
        return self.case.bytes

    def fn(self, cand: dict) -> Callable:
        with patched(self.modules, cand):
            run = self.setup(self.case, "triton", self.device)

        def call():
            with patched(self.modules, cand):
                return run.fn()

        return call

    def checked(self, cand: dict):
        from bench.runner import poisoned

        with poisoned():
            return self.fn(cand)()

    def reference(self):
        from bench.core import FLOAT64
        from bench.runner import GPU_EXPECTED

        if self._expected is None:
            provider = GPU_EXPECTED if self.device.type == "cuda" else FLOAT64
            self._expected = [t.detach() if t is not None else None
                              for t in self.setup(self.case, provider, self.device).fn()]
        return self._expected

    def check(self, outs) -> dict:
        err = rel_err([t.detach() if t is not None else None for t in outs], self.reference())
        limit = check_limit(self.case.dtype)
        return {"rel_err": err, "limit": limit, "ok": err <= limit}


def memory_cases(family: str, size: str) -> list:
    """The bench's fwd+bwd cases of the family (``quick``: GPU, ``smoke``: the interpreter)."""
    _, bench_module, ops = PATCHES[family]
    module = importlib.import_module(bench_module)
    return [c for c in module.cases(size, torch.bfloat16)
            if c.pass_ == "fwd+bwd" and c.op in ops]  # fmt: skip
