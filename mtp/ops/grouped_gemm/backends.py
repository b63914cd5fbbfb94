"""The backends of :func:`mtp.ops.grouped_gemm` (the op layer picks one by name) and the
epilogues of the backends that have no fused ones.

=============== ========================================================== ==================
name            what runs                                                  host syncs
=============== ========================================================== ==================
``triton``      :mod:`mtp.kernels.grouped_gemm_details` on the config of   none
                :func:`mtp.ops.grouped_gemm.config.make_config`; every
                epilogue fused
``cutlass``     the CUTLASS extension (``mtp.ops.grouped_gemm.cutlass``, sm_90/sm_100) none
``torch``       ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` none for bf16 [1]_
``multistream`` one ``torch.mm`` per expert over 4 CUDA streams (TE style) one (sizes)
``sequential``  one ``torch.mm`` per expert on the current stream          one (sizes)
``reference``   per-expert loop in fp32 math (plain PyTorch)               one (sizes)
=============== ========================================================== ==================

.. [1] PyTorch's grouped_mm runs its CUTLASS kernel for bf16 on sm_90/sm_100; for other dtypes
   and GPUs it falls back to a loop that reads the offsets on the host. Rows it leaves
   unwritten (past ``sum(tokens_per_expert)``) are zeroed here, and rows or weights whose
   strides are not 16-byte aligned are copied to aligned buffers first.

The backends other than ``triton`` run the epilogues after the GEMM (:func:`add_expert_bias_`,
:func:`activation_reference`, :func:`expert_bias_sums`), with the same results.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from mtp.kernels._common import launchable
from mtp.kernels.grouped_gemm_details import fill as _fill
from mtp.ops.bias_act import bias_gelu, bias_swiglu
from mtp.ops.grouped_gemm.plans import (
    triton_dgrad_act,
    triton_forward,
    triton_forward_act,
    triton_wgrad,
)
from mtp.utils import empty

__all__ = [
    "GROUPED_GEMM_BACKENDS",
    "GroupedGemmBackend",
    "activation_reference",
    "add_expert_bias_",
    "clamped_swiglu",
    "expert_bias_sums",
    "torch_grouped_mm",
    "triton_dgrad_act",
    "triton_forward",
    "triton_forward_act",
    "triton_wgrad",
]

logger = logging.getLogger("mtp")

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
    kernels = launchable(out.device)
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

_CUTLASS_MODULE = "mtp.ops.grouped_gemm.cutlass"


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
# Epilogues of the backends without fused ones
# --------------------------------------------------------------------------------------------


def _expert_of_rows(counts: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """Expert of each grouped row; ``E`` for the rows past ``sum(counts)``."""
    ends = torch.cumsum(counts.to(device=device, dtype=torch.int64).clamp_min(0), 0)
    return torch.searchsorted(ends, torch.arange(rows, device=device), right=True)


def add_expert_bias_(y: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of e] += bias[e]`` in place (``y`` ``[M, N]``, ``bias`` ``[E, N]``); rows past
    ``sum(counts)`` stay as they are."""
    padded = torch.cat([bias.to(y.dtype), bias.new_zeros(1, bias.shape[1], dtype=y.dtype)])
    return y.add_(padded.index_select(0, _expert_of_rows(counts, y.shape[0], y.device)))


def expert_bias_sums(dy: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """fp32 ``[E, N]``: the sum of ``dy``'s rows of each expert (``torch.segment_reduce``,
    deterministic; rows past ``sum(counts)`` ignored)."""
    E, M = counts.shape[0], dy.shape[0]
    lengths = counts.to(device=dy.device, dtype=torch.int64).clamp_min(0)
    lengths = torch.cat([lengths, (M - lengths.sum()).clamp_min(0).view(1)])
    sums = torch.segment_reduce(dy.float(), "sum", lengths=lengths, axis=0, unsafe=True)
    return sums[:E]


def clamped_swiglu(h: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """GPT-OSS's SwiGLU on interleaved columns: ``gate = h[..., 0::2].clamp(max=limit)``,
    ``up = h[..., 1::2].clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = h[..., 0::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def activation_reference(h: torch.Tensor, act: str, probs: torch.Tensor | None, limit: float,
                         alpha: float) -> torch.Tensor:  # fmt: skip
    """``act(h) * probs`` in fp32 math, in ``h``'s dtype (differentiable by autograd): the
    activation epilogue of the backends without a fused one."""
    if act == "clamped_swiglu":
        y = clamped_swiglu(h.float(), limit, alpha).to(h.dtype)
    elif act == "swiglu":
        y = bias_swiglu(h, backend="reference")
    else:
        y = bias_gelu(h, approximate="tanh" if act == "gelu_tanh" else "none",
                      backend="reference")  # fmt: skip
    if probs is not None:
        y = (y.float() * probs.float().unsqueeze(-1)).to(y.dtype)
    return y


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
        fused_epilogues: True when the backend runs the bias, the activation and probability
            scaling, the bias gradient and main-grad accumulation in its kernels' epilogues
            (:func:`triton_forward`, :func:`triton_forward_act`, ``wgrad(..., accumulate)``);
            otherwise the op layer runs them after the GEMM with this module's helpers.
    """

    forward: Callable[..., torch.Tensor]
    wgrad: Callable[..., torch.Tensor]
    device_counts: bool
    check: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    fused_epilogues: bool = False


GROUPED_GEMM_BACKENDS: dict[str, GroupedGemmBackend] = {
    "triton": GroupedGemmBackend(triton_forward, triton_wgrad, device_counts=True,
                                 fused_epilogues=True),
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
