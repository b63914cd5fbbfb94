"""Grouped GEMM for MoE experts: ``y[rows of e] = x[rows of e] @ w[e]`` with ragged groups.

Public API
- :func:`grouped_gemm` (``torch.ops.mtp.grouped_gemm`` underneath): forward and backward
  (``dx`` by the transposed grouped GEMM, ``dw[e] = x_e^T dy_e`` by a grouped weight-gradient
  GEMM with a ragged reduction dimension), fp32/fp16/bf16 with fp32 accumulation.
- :func:`grouped_gemm_reference`: the plain-PyTorch per-expert loop (same signature, fp32 math,
  differentiable by autograd).
- :data:`GROUPED_GEMM_BACKENDS`: the backend table (one entry per backend).

Backends (``backend=``, or ``MTP_BACKEND`` when ``"auto"``):

=============== ========================================================== ==================
name            what runs                                                  host syncs
=============== ========================================================== ==================
``triton``      one GEMM launch (+ tile map on sm_90+), counts on device   none
``cutlass``     the CUTLASS extension (``mtp.ops._cutlass``, sm_90/sm_100) none
``torch``       ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` none for bf16 [1]_
``multistream`` one ``torch.mm`` per expert over 4 CUDA streams (TE style) one (sizes)
``sequential``  one ``torch.mm`` per expert on the current stream          one (sizes)
``reference``   per-expert loop in fp32 math (plain PyTorch)               one (sizes)
=============== ========================================================== ==================

.. [1] PyTorch's grouped_mm runs its CUTLASS kernel for bf16 on sm_90/sm_100; for other dtypes
   and GPUs it falls back to a loop that reads the offsets on the host. Rows it leaves
   unwritten (past ``sum(tokens_per_expert)``) are zeroed here, and rows or weights whose
   strides are not 16-byte aligned are copied to aligned buffers first.

``auto`` is ``triton`` on CUDA and ``reference`` on CPU. The loop backends read
``tokens_per_expert`` on the host once per call (the backward reuses the host copy).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from mtp.kernels import grouped_gemm as _kernels
from mtp.kernels import grouped_mm_fill as _fill
from mtp.kernels._common import interpreting
from mtp.ops._backend import resolve_backend
from mtp.ops.grouped_gemm_bias import add_expert_bias_, expert_bias_grad
from mtp.utils import check_tensor, data_checks_enabled, empty, is_fake

__all__ = [
    "GROUPED_GEMM_BACKENDS",
    "GroupedGemmBackend",
    "grouped_gemm",
    "grouped_gemm_reference",
]

logger = logging.getLogger("mtp")

from mtp.dtypes import KERNEL_FLOATS as _FLOAT_DTYPES  # noqa: E402
_COUNT_DTYPES = (torch.int32, torch.int64)
_NUM_STREAMS = 4  # Transformer Engine's default number of GEMM streams


# --------------------------------------------------------------------------------------------
# Shared helpers of the backends
# --------------------------------------------------------------------------------------------


def _out_or_new(out: torch.Tensor | None, shape, like: torch.Tensor) -> torch.Tensor:
    return out if out is not None else empty(shape, dtype=like.dtype, device=like.device)


def _host_sizes(counts: torch.Tensor) -> list[int]:
    """Token counts as Python ints (a host sync when ``counts`` lives on the GPU)."""
    return [max(int(c), 0) for c in counts.tolist()]


def _weight(w: torch.Tensor, e: int, trans_b: bool) -> torch.Tensor:
    """``w[e]`` as the ``[K, N]`` right operand."""
    return w[e].t() if trans_b else w[e]


# --------------------------------------------------------------------------------------------
# Loop backends: reference, sequential, multistream
# --------------------------------------------------------------------------------------------


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _reference_forward(x, w, counts, trans_b, out):
    """Per-expert loop in fp32 (or wider) math; differentiable when ``out`` is None."""
    M, N = x.shape[0], w.shape[1] if trans_b else w.shape[2]
    acc = _math_dtype(x.dtype)
    chunks, row = [], 0
    for e, m in enumerate(_host_sizes(counts)):
        m = min(m, M - row)
        if m > 0:
            y_e = x[row : row + m].to(acc) @ _weight(w, e, trans_b).to(acc)
            chunks.append(y_e.to(x.dtype))
            row += m
    chunks.append(x.new_zeros(M - row, N))
    y = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
    if out is None:
        return y
    return out.copy_(y)


def _reference_wgrad(a, b, counts, out):
    """``out[e] = a_e^T b_e`` per expert in fp32 (or wider) math."""
    out = _out_or_new(out, (counts.shape[0], a.shape[1], b.shape[1]), a)
    acc = _math_dtype(a.dtype)
    row = 0
    for e, m in enumerate(_host_sizes(counts)):
        out[e].copy_(a[row : row + m].to(acc).t() @ b[row : row + m].to(acc))
        row += m
    return out


class _StreamPool:
    """Side streams per CUDA device, created once (creating streams per call is slow)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, list[torch.cuda.Stream]] = {}

    def get(self, device: torch.device) -> list[torch.cuda.Stream]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._streams:
                self._streams[index] = [
                    torch.cuda.Stream(device=index) for _ in range(_NUM_STREAMS)
                ]
            return self._streams[index]


_STREAM_POOL = _StreamPool()


class _RoundRobin:
    """Run per-expert GEMMs round-robin on side streams that join the current stream.

    Entering: every side stream waits for the work queued so far on the current stream (the
    inputs are ready). Leaving: the current stream waits for every side stream used, and the
    tensors touched there are ``record_stream``-ed so the caching allocator does not hand their
    memory to someone else while a side stream may still use it.
    """

    def __init__(self, device: torch.device, tensors: list[torch.Tensor]) -> None:
        self.enabled = device.type == "cuda"
        self.tensors = tensors
        self.used: list[torch.cuda.Stream] = []
        if self.enabled:
            self.current = torch.cuda.current_stream(device)
            self.streams = _STREAM_POOL.get(device)

    def run(self, i: int, fn: Callable[[], Any]) -> None:
        if not self.enabled:
            fn()
            return
        stream = self.streams[i % len(self.streams)]
        if stream not in self.used:
            stream.wait_stream(self.current)
            self.used.append(stream)
        with torch.cuda.stream(stream):
            fn()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in self.used:
            self.current.wait_stream(stream)
            for t in self.tensors:
                t.record_stream(stream)


def _loop_forward(x, w, counts, trans_b, out, *, streams: bool):
    M, N = x.shape[0], w.shape[1] if trans_b else w.shape[2]
    out = _out_or_new(out, (M, N), x)
    row = 0
    with _RoundRobin(x.device, [x, w, out] if streams else []) as pool:
        for e, m in enumerate(_host_sizes(counts)):
            m = min(m, M - row)
            if m == 0:
                continue
            rows = slice(row, row + m)
            w_e = _weight(w, e, trans_b)
            pool.run(e, lambda rows=rows, w_e=w_e: torch.mm(x[rows], w_e, out=out[rows]))
            row += m
        if row < M:
            out[row:].zero_()
    return out


def _loop_wgrad(a, b, counts, out, *, streams: bool):
    out = _out_or_new(out, (counts.shape[0], a.shape[1], b.shape[1]), a)
    row = 0
    with _RoundRobin(a.device, [a, b, out] if streams else []) as pool:
        for e, m in enumerate(_host_sizes(counts)):
            if m == 0:
                out[e].zero_()
                continue
            rows = slice(row, row + m)
            pool.run(e, lambda rows=rows, e=e: torch.mm(a[rows].t(), b[rows], out=out[e]))
            row += m
    return out


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------


def _triton_forward(x, w, counts, trans_b, out, bias=None):
    out = _out_or_new(out, (x.shape[0], w.shape[1] if trans_b else w.shape[2]), x)
    return _kernels.grouped_gemm(x, w.transpose(1, 2) if trans_b else w, counts, out,
                                 bias=None if bias is None else bias.contiguous())


def _triton_wgrad(a, b, counts, out):
    out = _out_or_new(out, (counts.shape[0], a.shape[1], b.shape[1]), a)
    return _kernels.grouped_wgrad(a, b, counts, out)


# --------------------------------------------------------------------------------------------
# torch.nn.functional.grouped_mm (PyTorch's own grouped GEMM)
# --------------------------------------------------------------------------------------------


def torch_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """PyTorch's grouped matmul (``F.grouped_mm``, else ``torch._grouped_mm``), or None."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _check_torch(x: torch.Tensor, w: torch.Tensor) -> None:
    if torch_grouped_mm() is None:
        raise ValueError(
            f"grouped_gemm: backend='torch' needs torch.nn.functional.grouped_mm or "
            f"torch._grouped_mm (PyTorch >= 2.8); this is PyTorch {torch.__version__}. "
            "Use backend='triton' or 'sequential'."
        )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when grouped_mm accepts its layout (16-byte aligned base and leading
    stride, one unit stride in the last two dims), else a row-major copy with padded rows."""
    align = 16 // t.element_size()
    rows_stride, cols_stride = t.stride()[-2:]
    ok_layout = (cols_stride == 1 and rows_stride % align == 0) or (
        rows_stride == 1 and cols_stride % align == 0
    )
    if ok_layout and t.data_ptr() % 16 == 0:
        return t
    logger.debug("grouped_gemm(backend='torch'): copying a %s operand to a 16-byte aligned "
                 "layout (strides %s)", tuple(t.shape), t.stride())
    cols = t.shape[-1]
    padded = -(-cols // align) * align
    buf = torch.empty((*t.shape[:-1], padded), dtype=t.dtype, device=t.device)[..., :cols]
    return buf.copy_(t)


def _zero_unwritten(out: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor) -> None:
    """Exact zeros where grouped_mm wrote nothing: the rows past ``offs[-1]`` of a forward
    output ``[M, N]``, or the empty groups of a weight gradient ``[E, P, Q]``. With Triton
    (CUDA, or the interpreter) only those elements are stored; otherwise a masked fill."""
    kernels = out.is_cuda or interpreting()
    if out.dim() == 2:
        if kernels and out.stride(1) == 1:
            _fill.zero_tail_rows(out, offs)
        else:
            rows = torch.arange(out.shape[0], device=out.device)[:, None]
            out.masked_fill_(rows >= offs[-1:].to(torch.int64), 0)
    elif kernels and out[0].is_contiguous():
        _fill.zero_empty_groups(out, counts)
    else:
        out.masked_fill_((counts <= 0)[:, None, None], 0)


def _torch_forward(x, w, counts, trans_b, out):
    M, K = x.shape
    E, N = w.shape[0], w.shape[1] if trans_b else w.shape[2]
    if min(M, N, K, E) == 0:
        return _out_or_new(out, (M, N), x).zero_()
    offs = torch.cumsum(counts.clamp_min(0), 0, dtype=torch.int32)
    b = w.transpose(1, 2) if trans_b else w
    y = torch_grouped_mm()(_aligned(x), _aligned(b), offs=offs)
    _zero_unwritten(y, counts, offs)  # grouped_mm leaves the tail rows uninitialised
    if out is None and y.is_contiguous():
        return y
    return _out_or_new(out, (M, N), x).copy_(y)


def _torch_wgrad(a, b, counts, out):
    E, P, Q = counts.shape[0], a.shape[1], b.shape[1]
    if min(E, P, Q) == 0 or a.shape[0] == 0:
        return _out_or_new(out, (E, P, Q), a).zero_()
    offs = torch.cumsum(counts.clamp_min(0), 0, dtype=torch.int32)
    dw = torch_grouped_mm()(_aligned(a).t(), _aligned(b), offs=offs)
    _zero_unwritten(dw, counts, offs)  # empty groups: exact zeros
    if out is None and dw.is_contiguous():
        return dw
    return _out_or_new(out, (E, P, Q), a).copy_(dw)


# --------------------------------------------------------------------------------------------
# CUTLASS (the extension in csrc/, imported lazily)
# --------------------------------------------------------------------------------------------

_CUTLASS_MODULE = "mtp.ops._cutlass"


def _cutlass() -> Any:
    """The CUTLASS extension module, or ValueError saying why it cannot be used."""
    try:
        module = importlib.import_module(_CUTLASS_MODULE)
    except ImportError as exc:
        raise ValueError(
            "grouped_gemm: backend='cutlass' needs the CUTLASS extension, which is not built "
            f"({_CUTLASS_MODULE}: {exc}). Build it on a machine with nvcc: `make cuda-ext` (or "
            "`MTP_BUILD_CUDA=1 pip install --no-build-isolation -e .` with nvidia-cutlass, "
            "pybind11 and ninja installed); or use backend='triton'."
        ) from exc
    ok, reason = module.is_available()
    if not ok:
        raise ValueError(
            f"grouped_gemm: backend='cutlass' is not available here: {reason}. It needs the "
            "extension built for sm_90a/sm_100a and an sm_90 (H-series) or sm_100 (B-series) "
            "GPU; use backend='triton' otherwise."
        )
    return module


def _check_cutlass(x: torch.Tensor, w: torch.Tensor) -> None:
    _cutlass()  # the extension checks devices, layouts and alignment itself
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"grouped_gemm: backend='cutlass' supports float16 and bfloat16 inputs, got "
            f"{str(x.dtype).replace('torch.', '')}; use backend='triton' for float32"
        )


def _cutlass_forward(x, w, counts, trans_b, out):
    out = _out_or_new(out, (x.shape[0], w.shape[1] if trans_b else w.shape[2]), x)
    # the op validated the counts already (one data check per call, not two)
    _cutlass().grouped_gemm(x, w, counts, trans_b, out, validate=False)
    return out


def _cutlass_wgrad(a, b, counts, out):
    out = _out_or_new(out, (counts.shape[0], a.shape[1], b.shape[1]), a)
    _cutlass().grouped_gemm_wgrad(a, b, counts, out, validate=False)
    return out


# --------------------------------------------------------------------------------------------
# The backend table
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedGemmBackend:
    """One grouped-GEMM backend.

    Attributes:
        forward: ``(x[M, K], w, counts[E], trans_b, out | None) -> y[M, N]``; ``w`` is
            ``[E, K, N]`` (``[E, N, K]`` with ``trans_b``); writes every element of ``out``
            (zeros past ``sum(counts)``) or allocates the result.
        wgrad: ``(a[M, P], b[M, Q], counts[E], out | None) -> c[E, P, Q]`` with
            ``c[e] = a_e^T b_e``, exact zeros for empty experts.
        device_counts: True when ``counts`` must be on the inputs' device (single-launch
            backends); False when the backend reads them on the host (they are copied there
            once, before the call).
        check: raises ``ValueError``/``TypeError`` when the backend cannot run these inputs here.
    """

    forward: Callable[..., torch.Tensor]
    wgrad: Callable[..., torch.Tensor]
    device_counts: bool
    check: Callable[[torch.Tensor, torch.Tensor], None] | None = None


GROUPED_GEMM_BACKENDS: dict[str, GroupedGemmBackend] = {
    "triton": GroupedGemmBackend(_triton_forward, _triton_wgrad, device_counts=True),
    "cutlass": GroupedGemmBackend(
        _cutlass_forward, _cutlass_wgrad, device_counts=True, check=_check_cutlass
    ),
    "torch": GroupedGemmBackend(
        _torch_forward, _torch_wgrad, device_counts=True, check=_check_torch
    ),
    "multistream": GroupedGemmBackend(
        lambda x, w, c, t, o: _loop_forward(x, w, c, t, o, streams=True),
        lambda a, b, c, o: _loop_wgrad(a, b, c, o, streams=True),
        device_counts=False,
    ),
    "sequential": GroupedGemmBackend(
        lambda x, w, c, t, o: _loop_forward(x, w, c, t, o, streams=False),
        lambda a, b, c, o: _loop_wgrad(a, b, c, o, streams=False),
        device_counts=False,
    ),
    "reference": GroupedGemmBackend(_reference_forward, _reference_wgrad, device_counts=False),
}


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


def _n_of(w: torch.Tensor, trans_b: bool) -> int:
    return w.shape[1] if trans_b else w.shape[2]


def _forward(backend, x, w, counts, trans_b, out, bias):
    """The backend's forward plus ``bias[e]`` on expert ``e``'s rows (Triton: in the epilogue)."""
    if backend == "triton":
        return _triton_forward(x, w, counts, trans_b, out, bias)
    y = GROUPED_GEMM_BACKENDS[backend].forward(x, w, counts, trans_b, out)
    return y if bias is None else add_expert_bias_(y, bias, counts)


@torch.library.custom_op("mtp::grouped_gemm", mutates_args=())
def _grouped_gemm_op(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    trans_b: bool,
    backend: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _forward(backend, x, w, tokens_per_expert, trans_b, None, bias)


@_grouped_gemm_op.register_fake
def _(x, w, tokens_per_expert, trans_b, backend, bias=None):
    return x.new_empty(x.shape[0], _n_of(w, trans_b))


@torch.library.custom_op("mtp::grouped_gemm_out", mutates_args=("out",))
def _grouped_gemm_out_op(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    trans_b: bool,
    backend: str,
    bias: torch.Tensor | None = None,
) -> None:
    _forward(backend, x, w, tokens_per_expert, trans_b, out, bias)


@_grouped_gemm_out_op.register_fake
def _(x, w, tokens_per_expert, out, trans_b, backend, bias=None):
    return None


@torch.library.custom_op("mtp::grouped_gemm_wgrad", mutates_args=())
def _grouped_wgrad_op(
    a: torch.Tensor, b: torch.Tensor, tokens_per_expert: torch.Tensor, backend: str
) -> torch.Tensor:
    """``c[e] = a_e^T b_e``: ``[E, P, Q]`` for ``a[M, P]``, ``b[M, Q]``."""
    return GROUPED_GEMM_BACKENDS[backend].wgrad(a, b, tokens_per_expert, None)


@_grouped_wgrad_op.register_fake
def _(a, b, tokens_per_expert, backend):
    return a.new_empty(tokens_per_expert.shape[0], a.shape[1], b.shape[1])


def _backward(ctx, dy: torch.Tensor, bias_index: int):
    x, w, counts = ctx.saved_tensors
    dy = dy.contiguous()
    dx = dw = db = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[bias_index]:
        db = expert_bias_grad(dy, counts, ctx.backend).to(ctx.bias_dtype)
    if ctx.needs_input_grad[0]:
        # dx = dy @ w[e]^T: the same grouped GEMM with the weight read the other way round.
        dx = torch.ops.mtp.grouped_gemm(dy, w, counts, not ctx.trans_b, ctx.backend)
    if ctx.needs_input_grad[1]:
        # dw[e] = x_e^T dy_e ([K, N]); with trans_b the weight is [N, K]: dy_e^T x_e.
        a, b = (dy, x) if ctx.trans_b else (x, dy)
        dw = torch.ops.mtp.grouped_gemm_wgrad(a, b, counts, ctx.backend)
    return dx, dw, db


def _setup_context(ctx, inputs, output) -> None:
    x, w, tokens_per_expert, trans_b, backend, bias = inputs
    ctx.save_for_backward(x, w, tokens_per_expert)
    ctx.trans_b, ctx.backend = trans_b, backend
    ctx.bias_dtype = None if bias is None else bias.dtype


def _op_backward(ctx, dy):
    dx, dw, db = _backward(ctx, dy, 5)
    return dx, dw, None, None, None, db


_grouped_gemm_op.register_autograd(_op_backward, setup_context=_setup_context)


class _GroupedGemmInto(torch.autograd.Function):
    """Autograd for ``grouped_gemm(..., out=buffer)``: the buffer is written and returned."""

    @staticmethod
    def forward(ctx, x, w, tokens_per_expert, out, trans_b, backend, bias):
        torch.ops.mtp.grouped_gemm_out(x, w, tokens_per_expert, out, trans_b, backend, bias)
        ctx.mark_dirty(out)
        ctx.save_for_backward(x, w, tokens_per_expert)
        ctx.trans_b, ctx.backend = trans_b, backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _backward(ctx, dy, 6)
        return dx, dw, None, None, None, None, db


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _check_inputs(x, w, tokens_per_expert, trans_b, out, dtypes=_FLOAT_DTYPES) -> None:
    check_tensor("x", x, ndim=2, dtypes=dtypes)
    check_tensor("w", w, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_tensor("tokens_per_expert", tokens_per_expert, ndim=1, dtypes=_COUNT_DTYPES)
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    if tokens_per_expert.device not in (x.device, torch.device("cpu")):
        raise ValueError(
            f"tokens_per_expert must be on {x.device} (like x) or on the CPU, got "
            f"{tokens_per_expert.device}"
        )
    E = w.shape[0]
    if tokens_per_expert.shape[0] != E:
        raise ValueError(
            f"w has {E} experts (w.shape[0]) but tokens_per_expert has "
            f"{tokens_per_expert.shape[0]} entries; they must match"
        )
    k_dim = 2 if trans_b else 1
    if w.shape[k_dim] != x.shape[1]:
        layout = "[E, N, K] (trans_b=True)" if trans_b else "[E, K, N] (trans_b=False)"
        raise ValueError(
            f"w of shape {tuple(w.shape)} read as {layout} has K={w.shape[k_dim]}, but x of "
            f"shape {tuple(x.shape)} has K={x.shape[1]}"
        )
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
        shape = (x.shape[0], _n_of(w, trans_b))
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        _check_out_memory(out, {"x": x, "w": w, "tokens_per_expert": tokens_per_expert})


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses a (non-empty) strided tensor can touch."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (extent + 1) * t.element_size()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` may overlap in memory (same storage, intersecting spans)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if is_fake(a) or is_fake(b):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def _check_out_memory(out: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
    """``out`` must be written without clobbering an input or itself, and with autograd."""
    for name, t in inputs.items():
        if _shares_memory(out, t):
            raise ValueError(
                f"out shares memory with {name}; grouped_gemm cannot write its result over an "
                "input (the rows of one expert would overwrite what the others still read): "
                "pass a separate buffer"
            )
    if not is_fake(out) and torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(
            f"out (shape {tuple(out.shape)}, strides {out.stride()}) has elements that share "
            "memory (an expanded or broadcast tensor); pass a dense buffer"
        )
    if torch.is_grad_enabled() and out.requires_grad and out.is_leaf:
        raise ValueError(
            "out is a leaf tensor that requires grad; autograd cannot record an in-place write "
            "into it. Pass a buffer with requires_grad=False (the result is differentiable in "
            "x and w either way), or call under torch.no_grad()"
        )


def _check_count_values(tokens_per_expert: torch.Tensor, M: int) -> None:
    """Data-dependent checks (one host read of two numbers)."""
    if tokens_per_expert.numel() == 0:
        return
    low, total = torch.stack([tokens_per_expert.min(), tokens_per_expert.sum()]).tolist()
    if low < 0:
        raise ValueError(f"tokens_per_expert must be non-negative, got a count of {low}")
    if total > M:
        raise ValueError(
            f"tokens_per_expert sums to {total} rows but x has only {M} rows (x.shape[0]); "
            "size x for the routed tokens (rows past the sum are written as zeros)"
        )


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    validate: bool = True,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM over experts: ``y[rows of e] = x[rows of e] @ w[e] (+ bias[e])``.

    Args:
        x: ``[M, K]`` float32/float16/bfloat16; rows grouped by expert (expert 0's rows first).
            ``M`` may exceed ``sum(tokens_per_expert)`` (a buffer sized for the worst case).
        w: ``[E, K, N]``, or ``[E, N, K]`` with ``trans_b=True`` (``nn.Linear`` layout), same
            dtype and device as ``x``.
        tokens_per_expert: ``[E]`` int32/int64 rows per expert, on ``x``'s device or the CPU
            (or a list of ints). Experts with zero tokens are fine (their weight gradient is
            exactly zero). Keep it on the device for CUDA graphs and sync-free backends.
        trans_b: read ``w[e]`` as ``[N, K]`` and multiply by its transpose.
        backend: ``"auto"`` (``triton`` on CUDA, ``reference`` on CPU, or ``MTP_BACKEND``),
            ``"triton"``, ``"cutlass"``, ``"torch"``, ``"multistream"``, ``"sequential"``,
            ``"reference"`` (see the module docstring).
        out: optional ``[M, N]`` buffer in ``x``'s dtype, written completely and returned (keeps
            the output address fixed for CUDA graphs).
        validate: check that the counts are non-negative and sum to at most ``M`` (reads two
            numbers on the host; skipped automatically while tracing or capturing a graph).
        bias: optional per-expert bias ``[E, N]`` (float, any of the three dtypes), added in
            fp32 in the GEMM's epilogue on the ``triton`` backend (after the GEMM on the
            others); rows past ``sum(tokens_per_expert)`` stay zero. Its gradient is the
            per-expert sum of ``dy``'s rows (fp32 accumulation, deterministic).

    Returns:
        ``y[M, N]`` in ``x``'s dtype (fp32 accumulation); rows past ``sum(tokens_per_expert)``
        are zero. Differentiable in ``x`` and ``w``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or devices (naming the argument), counts
            summing past ``M``, or a backend that cannot run here (e.g. ``cutlass`` not built).
    """
    name, counts = prepare_call(x, w, tokens_per_expert, trans_b, out, backend, validate, bias)
    if out is None:
        return torch.ops.mtp.grouped_gemm(x, w, counts, trans_b, name, bias)
    needs_grad = any(t is not None and t.requires_grad for t in (x, w, bias))
    if torch.is_grad_enabled() and needs_grad:
        return _GroupedGemmInto.apply(x, w, counts, out, trans_b, name, bias)
    torch.ops.mtp.grouped_gemm_out(x, w, counts, out, trans_b, name, bias)
    return out


def prepare_call(x, w, tokens_per_expert, trans_b, out, backend, validate, bias=None):
    """Check the arguments of :func:`grouped_gemm` and resolve them: ``(backend name, counts)``
    with the counts where the backend reads them (the loop backends' one host copy)."""
    if isinstance(tokens_per_expert, (list, tuple)):
        tokens_per_expert = torch.tensor(tokens_per_expert, dtype=torch.int64)
    _check_inputs(x, w, tokens_per_expert, trans_b, out)
    if bias is not None:
        check_tensor("bias", bias, ndim=2, dtypes=_FLOAT_DTYPES, device=x.device)
        if tuple(bias.shape) != (w.shape[0], _n_of(w, trans_b)):
            raise ValueError(f"bias must be [{w.shape[0]}, {_n_of(w, trans_b)}] (experts, N), "
                             f"got {tuple(bias.shape)}")  # fmt: skip
    name = resolve_backend("grouped_gemm", backend, x.device, tuple(GROUPED_GEMM_BACKENDS))
    impl = GROUPED_GEMM_BACKENDS[name]
    if impl.check is not None:
        impl.check(x, w)
    # Loop backends read the sizes on the host: copy them once here (their only sync); the
    # validation and the backward read that copy. Single-launch backends read them on the device.
    if not impl.device_counts and tokens_per_expert.device.type == "meta":
        raise ValueError(
            f"grouped_gemm: backend={name!r} reads tokens_per_expert on the host, but it is a "
            "meta tensor (no values); pass the counts on the CPU, or use a backend that reads "
            "them on the device ('triton', 'torch')"
        )
    tokens_per_expert = tokens_per_expert.contiguous()  # [E] ints: a no-op or a tiny copy
    counts = tokens_per_expert if impl.device_counts else tokens_per_expert.to("cpu")
    if data_checks_enabled(validate, counts):
        _check_count_values(counts, x.shape[0])
    return name, (counts.to(x.device) if impl.device_counts else counts)


def grouped_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch per-expert loop with :func:`grouped_gemm`'s contract (fp32 math, result in
    ``x``'s dtype, zero rows past the routed ones); also accepts float64. Differentiable by
    autograd when ``out`` is None. Reads ``tokens_per_expert`` on the host."""
    _check_inputs(x, w, tokens_per_expert, trans_b, out, dtypes=(*_FLOAT_DTYPES, torch.float64))
    return _reference_forward(x, w, tokens_per_expert, trans_b, out)
