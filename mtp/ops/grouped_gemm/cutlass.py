"""CUTLASS grouped GEMM backend (sm_90a / sm_100a): the torch side of ``mtp._cuda_gemm``.

**Status: compiled and unit-checked, not yet validated on a GPU.** CI compiles the kernels with
nvcc for sm_90a and sm_100a and checks the SASS (``HGMMA`` on sm_90a, ``UTCHMMA`` (tcgen05.mma)
on sm_100a); the argument checks below are unit-tested on CPU. The GPU tests
(``tests/test_cutlass_grouped_gemm.py``, marked ``gpu``: float64 per-expert reference,
fwd/dgrad/wgrad, skewed and empty groups, bf16/fp16, CUDA-graph replay with new routings) have
not run on a GPU yet. Until they have, prefer ``backend="triton"`` for training runs.

The kernels live in a torch-free pybind11 module (``csrc/``, built by ``make cuda-ext`` or by
``pip install`` where nvcc and the build inputs are present): it takes device pointers, sizes and
a ``cudaStream_t``. This module checks every argument, allocates the workspace through the
PyTorch caching allocator on the current stream and launches on the current stream. A call reads
``tokens_per_expert`` on the device only (a small kernel turns it into the per-expert problem
shapes and pointer arrays), so it never synchronises with the host and can be captured in a
CUDA graph and replayed with new routings.

Layout of an expert batch (the MoE convention): the rows of ``x`` are grouped by expert,
``tokens_per_expert[e]`` consecutive rows for expert ``e``; rows past ``sum(tokens_per_expert)``
belong to no expert.

Functions (``validate`` is the project's data-dependent check switch, see
:func:`mtp.utils.data_checks_enabled`):

* :func:`grouped_gemm` ``(x, w, tokens_per_expert, trans_b, out)``: ``y_e = x_e @ w_e``
  (``w_e^T`` with ``trans_b``) into ``out``; rows past the sum are zeroed. dgrad is the same call
  with the other ``trans_b`` (``dx_e = dy_e @ w_e^T``).
* :func:`grouped_gemm_wgrad` ``(x, dy, tokens_per_expert, out)``: ``out[e] = x_e^T @ dy_e``;
  exact zeros for experts without tokens.

Both are also registered as ``torch.ops.mtp.cutlass_grouped_gemm`` and
``torch.ops.mtp.cutlass_grouped_gemm_wgrad`` (mutating ``out``, with fake implementations) so
they stay opaque to ``torch.compile``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from mtp.utils import check_tensor, data_checks_enabled

logger = logging.getLogger("mtp")

__all__ = ["is_available", "grouped_gemm", "grouped_gemm_wgrad", "BUILD_HINT"]

#: Input dtypes with kernels (accumulation is fp32, the output has the input dtype).
DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}  # mtp._cuda_gemm.DTYPE_*
_OP_FWD, _OP_FWD_TRANS_B, _OP_WGRAD = 0, 1, 2  # mtp._cuda_gemm.OP_*
#: Row alignment CUTLASS's TMA loads need: 16 bytes, i.e. 8 elements of a 16-bit dtype.
ALIGN_BYTES = 16
#: Compute capabilities (major*10+minor) the kernels exist for.
SUPPORTED_ARCHS = {90: "sm_90 (H100/H200)", 100: "sm_100 (B200/GB200)"}

BUILD_HINT = (
    "build it with `make cuda-ext` (needs nvcc >= 12.8; it installs nvidia-cutlass, pybind11 and "
    "ninja into .venv), or `MTP_BUILD_CUDA=1 pip install --no-build-isolation -e .` in an "
    "environment with those packages"
)


# ----------------------------------------------------------------------------------------------
# The extension and availability
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("mtp._cuda_gemm"), ""
    except ImportError as err:  # not built, or built for another Python / missing driver
        return None, str(err)


def extension() -> ModuleType:
    """The compiled ``mtp._cuda_gemm`` module; RuntimeError with what to do when it is absent."""
    module, error = _load()
    if module is None:
        raise RuntimeError(
            f"the CUTLASS grouped GEMM extension mtp._cuda_gemm is not built ({error}); "
            f"{BUILD_HINT}; or use backend='triton'"
        )
    return module


def is_available(device: torch.device | int | str | None = None) -> tuple[bool, str]:
    """Whether the CUTLASS backend can run on ``device`` (default: the current CUDA device).

    Returns ``(True, "")`` or ``(False, reason)``; the reason names what to do: build the
    extension, use a CUDA machine, or use another backend on a GPU other than sm_90 / sm_100.
    """
    module, error = _load()
    if module is None:
        return False, (
            f"the CUTLASS extension mtp._cuda_gemm is not built ({error}); {BUILD_HINT}"
        )
    if not torch.cuda.is_available():
        return False, (
            "no CUDA device (torch.cuda.is_available() is False): the CUTLASS backend runs on "
            "sm_90 / sm_100 GPUs only; use backend='triton' or 'reference'"
        )
    index = _device_index(device)
    major, minor = torch.cuda.get_device_capability(index)
    arch = major * 10 + minor
    compiled = set(module.compiled_archs())
    if arch not in SUPPORTED_ARCHS:
        name = torch.cuda.get_device_name(index)
        return False, (
            f"CUDA device {index} ({name}) is sm_{arch}; the CUTLASS grouped GEMM has kernels "
            f"for {' and '.join(SUPPORTED_ARCHS.values())} only; use backend='triton'"
        )
    if arch not in compiled:
        return False, (
            f"mtp._cuda_gemm was built without sm_{arch} kernels (built: "
            f"{', '.join(f'sm_{a}' for a in sorted(compiled)) or 'none'}); rebuild with "
            f"MTP_CUDA_ARCH_LIST including {arch // 10}.{arch % 10}a ({BUILD_HINT})"
        )
    return True, ""


def _device_index(device: torch.device | int | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


# ----------------------------------------------------------------------------------------------
# Argument checks (free ones; data-dependent ones follow the validate rule)
# ----------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major) for the CUTLASS backend, got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}; call .contiguous() first"
        )


def _check_row_alignment(name: str, t: torch.Tensor, dim_name: str) -> None:
    """Rows of ``t`` (its last dimension) must span a multiple of 16 bytes."""
    size = t.shape[-1]
    if (size * t.element_size()) % ALIGN_BYTES:
        per_row = ALIGN_BYTES // t.element_size()
        raise ValueError(
            f"{name}: rows must be 16-byte aligned for the CUTLASS backend (TMA): {dim_name}="
            f"{size} is not a multiple of {per_row} for {_dtype_name(t.dtype)}; pad {dim_name} "
            "or use backend='triton'"
        )


def check_pointer_alignment(name: str, t: torch.Tensor) -> None:
    """The first element of ``t`` must sit on a 16-byte boundary (TMA descriptors need it)."""
    address = t.data_ptr()
    if address % ALIGN_BYTES:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address for the CUTLASS backend, got "
            f"{address:#x} (storage offset {t.storage_offset()} elements); use a fresh "
            "allocation or .clone()"
        )


def _check_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} must be a CUDA tensor for the CUTLASS backend, got {t.device}; use "
            "backend='reference' (or 'triton') on CPU"
        )


def check_routing(
    tokens_per_expert: torch.Tensor, num_rows: int, validate: bool = True
) -> None:
    """Data-dependent check of the routing (one host sync; skipped when tracing or capturing).

    Raises ValueError when a count is negative or the counts add up to more than ``num_rows``
    (the rows of ``x``). The kernels clamp both cases rather than read out of bounds.
    """
    if tokens_per_expert.numel() == 0 or not data_checks_enabled(validate, tokens_per_expert):
        return
    low, total = torch.stack(
        [tokens_per_expert.min().to(torch.int64), tokens_per_expert.sum(dtype=torch.int64)]
    ).tolist()
    if low < 0:
        raise ValueError(f"tokens_per_expert must be >= 0, got a count of {low}")
    if total > num_rows:
        raise ValueError(
            f"tokens_per_expert sums to {total} but x has only {num_rows} rows; the counts must "
            "add up to at most x.shape[0]"
        )


def _check_tokens(tokens: object, groups: int, device: torch.device) -> torch.Tensor:
    check_tensor("tokens_per_expert", tokens, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=device)  # fmt: skip
    assert isinstance(tokens, torch.Tensor)
    if tokens.shape[0] != groups:
        raise ValueError(
            f"tokens_per_expert must have shape [{groups}] (one count per expert), got "
            f"{tuple(tokens.shape)}"
        )
    _check_contiguous("tokens_per_expert", tokens)
    return tokens


def _check_fwd(
    x: object, w: object, tokens_per_expert: object, trans_b: bool, out: object
) -> tuple[int, int, int, int]:
    """Free checks of :func:`grouped_gemm`'s arguments; returns (M, N, K, E)."""
    x = check_tensor("x", x, ndim=2, dtypes=DTYPES)
    device = x.device
    w = check_tensor("w", w, ndim=3, dtypes=(x.dtype,), device=device)
    out = check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=device)
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    m, k = x.shape
    e = w.shape[0]
    n, w_k = (w.shape[1], w.shape[2]) if trans_b else (w.shape[2], w.shape[1])
    if w_k != k:
        layout = "[E, N, K]" if trans_b else "[E, K, N]"
        raise ValueError(
            f"w must have shape {layout} with K = x.shape[1] = {k} (trans_b={trans_b}), got "
            f"{tuple(w.shape)}"
        )
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out must have shape [M, N] = [{m}, {n}], got {tuple(out.shape)}")
    _check_tokens(tokens_per_expert, e, device)
    for name, t in (("x", x), ("w", w), ("out", out)):
        _check_contiguous(name, t)
    _check_row_alignment("x", x, "K")
    _check_row_alignment("w", w, "K" if trans_b else "N")
    _check_row_alignment("out", out, "N")
    return m, n, k, e


def _check_wgrad(
    x: object, dy: object, tokens_per_expert: object, out: object
) -> tuple[int, int, int, int]:
    """Free checks of :func:`grouped_gemm_wgrad`'s arguments; returns (M, N, K, E)."""
    x = check_tensor("x", x, ndim=2, dtypes=DTYPES)
    device = x.device
    dy = check_tensor("dy", dy, ndim=2, dtypes=(x.dtype,), device=device)
    out = check_tensor("out", out, ndim=3, dtypes=(x.dtype,), device=device)
    m, k = x.shape
    if dy.shape[0] != m:
        raise ValueError(
            f"dy must have the rows of x: shape [{m}, N], got {tuple(dy.shape)}"
        )
    n = dy.shape[1]
    e = out.shape[0]
    if tuple(out.shape[1:]) != (k, n):
        raise ValueError(f"out must have shape [E, K, N] = [E, {k}, {n}], got {tuple(out.shape)}")
    _check_tokens(tokens_per_expert, e, device)
    for name, t in (("x", x), ("dy", dy), ("out", out)):
        _check_contiguous(name, t)
    _check_row_alignment("x", x, "K")
    _check_row_alignment("dy", dy, "N")
    return m, n, k, e


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _workspace_size(op: int, dtype_code: int, groups: int, device: int) -> int:
    return int(extension().workspace_size(op, dtype_code, groups, device))


def _launch(
    op: int, a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
    m: int, n: int, k: int, groups: int,
) -> None:  # fmt: skip
    ext = extension()
    index = _device_index(a.device)
    for name, t in (("x", a), ("dy" if op == _OP_WGRAD else "w", b), ("out", out)):
        check_pointer_alignment(name, t)
    dtype_code = _DTYPE_CODE[a.dtype]
    nbytes = _workspace_size(op, dtype_code, groups, index)
    with torch.cuda.device(index):
        # Caching allocator, current stream: stream-ordered reuse, and graph-pool memory when
        # captured (freed when this call returns; later work on the stream runs after ours).
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
        stream = torch.cuda.current_stream(a.device).cuda_stream
        ext.grouped_gemm(
            op, dtype_code, a.data_ptr(), b.data_ptr(), out.data_ptr(), tokens.data_ptr(),
            tokens.dtype == torch.int64, m, n, k, groups, workspace.data_ptr(), nbytes, stream,
            index,
        )  # fmt: skip


@torch.library.custom_op("mtp::cutlass_grouped_gemm", mutates_args=("out",), device_types="cuda")
def _grouped_gemm_op(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, trans_b: bool,
    out: torch.Tensor,
) -> None:  # fmt: skip
    m, n, k, e = _check_fwd(x, w, tokens_per_expert, trans_b, out)
    op = _OP_FWD_TRANS_B if trans_b else _OP_FWD
    _launch(op, x, w, tokens_per_expert, out, m, n, k, e)


@_grouped_gemm_op.register_fake
def _(x, w, tokens_per_expert, trans_b, out) -> None:
    return None


@torch.library.custom_op(
    "mtp::cutlass_grouped_gemm_wgrad", mutates_args=("out",), device_types="cuda"
)
def _grouped_gemm_wgrad_op(
    x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor, out: torch.Tensor
) -> None:
    m, n, k, e = _check_wgrad(x, dy, tokens_per_expert, out)
    _launch(_OP_WGRAD, x, dy, tokens_per_expert, out, m, n, k, e)


@_grouped_gemm_wgrad_op.register_fake
def _(x, dy, tokens_per_expert, out) -> None:
    return None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    trans_b: bool,
    out: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """``out[rows of e] = x[rows of e] @ w[e]`` (``@ w[e]^T`` with ``trans_b``) for every expert.

    Args:
        x: ``[M, K]`` bf16/fp16, CUDA, contiguous; rows grouped by expert.
        w: ``[E, K, N]`` (``trans_b=False``) or ``[E, N, K]`` (``trans_b=True``), x's dtype.
        tokens_per_expert: ``[E]`` int32/int64 on x's device; read on the device only.
        trans_b: whether ``w[e]`` is stored transposed (``[N, K]``).
        out: ``[M, N]``, x's dtype; every element is written: rows past
            ``sum(tokens_per_expert)`` are zeroed.
        validate: check the counts (>= 0, sum <= M) with one host sync, except while tracing or
            capturing; False skips it (the kernels clamp bad counts instead of faulting).

    K and N must be multiples of 8 and every tensor 16-byte aligned (CUTLASS TMA). Accumulates
    in fp32, rounds to the input dtype. dgrad: ``grouped_gemm(dy, w, tokens, not trans_b, dx)``.

    Raises:
        TypeError / ValueError naming the argument; RuntimeError when the extension or a
        supported GPU is missing (see :func:`is_available`).
    """
    m, n, k, e = _check_fwd(x, w, tokens_per_expert, trans_b, out)
    for name, t in (("x", x), ("w", w), ("tokens_per_expert", tokens_per_expert), ("out", out)):
        _check_cuda(name, t)
    check_routing(tokens_per_expert, m, validate)
    if m == 0 or n == 0:
        return
    if k == 0 or e == 0:
        out.zero_()  # empty reduction / no expert owns any row
        return
    _require_available(x.device)
    torch.ops.mtp.cutlass_grouped_gemm(x, w, tokens_per_expert, trans_b, out)


def grouped_gemm_wgrad(
    x: torch.Tensor,
    dy: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """``out[e] = x[rows of e]^T @ dy[rows of e]`` for every expert (weight gradient).

    Args:
        x: ``[M, K]`` bf16/fp16, CUDA, contiguous; rows grouped by expert.
        dy: ``[M, N]``, x's dtype.
        tokens_per_expert: ``[E]`` int32/int64 on x's device; read on the device only.
        out: ``[E, K, N]``, x's dtype; experts without tokens get exact zeros.
        validate: as in :func:`grouped_gemm`.

    The reduction length (the expert's token count) is ragged and may be anything; K and N must
    be multiples of 8 and every tensor 16-byte aligned.
    """
    m, n, k, e = _check_wgrad(x, dy, tokens_per_expert, out)
    for name, t in (("x", x), ("dy", dy), ("tokens_per_expert", tokens_per_expert), ("out", out)):
        _check_cuda(name, t)
    check_routing(tokens_per_expert, m, validate)
    if e == 0 or k == 0 or n == 0:
        return
    if m == 0:
        out.zero_()
        return
    _require_available(x.device)
    torch.ops.mtp.cutlass_grouped_gemm_wgrad(x, dy, tokens_per_expert, out)


@functools.lru_cache(maxsize=64)
def _available_on(index: int) -> tuple[bool, str]:
    return is_available(index)


def _require_available(device: torch.device) -> None:
    ok, reason = _available_on(_device_index(device))
    if not ok:
        raise RuntimeError(f"CUTLASS grouped GEMM backend unavailable: {reason}")
