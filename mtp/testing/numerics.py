"""Numerical comparison: :func:`assert_close` and every tolerance of the project, in one place.

Three kinds of bound, each for its use:

- :data:`TOLERANCES` / :func:`tolerance`: elementwise ``(rtol, atol)`` per dtype for an op that
  computes in fp32 and rounds to the dtype, against a float64 reference (:func:`assert_close`);
  :data:`OP_TOLERANCES` holds the few ops whose result goes through one more rounding.
- :func:`own_error_atol`: flash-attention's rule, an absolute bound of ``k`` x PyTorch's own error
  on the same inputs in the same low precision. It grows with the reduction length where a
  fixed table entry would not (a 1,000-row weight gradient in fp32).
- :data:`RELATIVE_ERROR_LIMITS` / :func:`relative_error_limit`: the benchmarks' check of
  ``||actual - expected|| / ||expected||`` per dtype (``mtp.bench``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "TOLERANCES",
    "OP_TOLERANCES",
    "RELATIVE_ERROR_LIMITS",
    "tolerance",
    "assert_close",
    "own_error_atol",
    "relative_error_limit",
]

#: (rtol, atol) per dtype of the result under test, for ops that compute in fp32 and round the
#: result to the dtype, compared with a float64 reference on the same inputs. An element passes
#: when ``|actual - expected| <= atol + rtol * |expected|``.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (3e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


#: Ops whose result goes through a rounding the table above does not model, with their own
#: ``(rtol, atol)``: linear_cross_entropy computes logits by a GEMM over the hidden size and
#: rounds them to the input dtype before the loss, as the unfused ``F.linear`` +
#: ``F.cross_entropy`` it is compared with does; a different accumulation order flips some of
#: those roundings.
OP_TOLERANCES: dict[str, dict[torch.dtype, tuple[float, float]]] = {
    "linear_cross_entropy": {
        torch.float32: (2e-5, 2e-5),
        torch.bfloat16: (3e-2, 3e-2),
        torch.float16: (5e-3, 5e-3),
    },
}


def tolerance(dtype: torch.dtype, op: str | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` from :data:`TOLERANCES`, or from :data:`OP_TOLERANCES`
    when ``op`` names an op there (exact for integer and bool)."""
    if not dtype.is_floating_point:
        return (0.0, 0.0)
    if op is not None:
        if op not in OP_TOLERANCES or dtype not in OP_TOLERANCES[op]:
            raise ValueError(f"no tolerance defined for {op} in {dtype}; known: "
                             f"{ {k: list(v) for k, v in OP_TOLERANCES.items()} }")
        return OP_TOLERANCES[op][dtype]
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for dtype {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def _index_str(flat_index: int, shape: Sequence[int]) -> str:
    if len(shape) == 0:
        return "()"
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size)
        flat_index //= size
    return str(tuple(reversed(idx)))


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """Assert ``actual`` matches ``expected`` within the tolerance of ``dtype``.

    Args:
        actual: the result under test, any dtype and device.
        expected: the reference (typically float64), same shape.
        dtype: the dtype whose tolerance applies (default: ``actual.dtype``).
        rtol, atol: override the table (say why at the call site).
        msg: prefix for the failure message.

    NaN is only accepted where the reference is NaN; infinities must match exactly. The failure
    message reports the number of failing elements, the max absolute error, the max and RMS
    relative error (RMS of the error over RMS of the reference) and where the worst element is.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError("assert_close compares two tensors")
    prefix = f"{msg}: " if msg else ""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected "
            f"{tuple(expected.shape)}"
        )
    dtype = dtype or actual.dtype
    table_rtol, table_atol = tolerance(dtype)
    rtol = table_rtol if rtol is None else rtol
    atol = table_atol if atol is None else atol
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return
    nan_mismatch = torch.isnan(a) != torch.isnan(e)
    inf_mismatch = (torch.isinf(a) | torch.isinf(e)) & (a != e) & ~torch.isnan(a) & ~torch.isnan(e)
    both_special = (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(e) & (a == e))
    err = (a - e).abs()
    err = torch.where(both_special, torch.zeros_like(err), err)
    bound = atol + rtol * e.abs()
    bad = (err > bound) | nan_mismatch | inf_mismatch
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    finite = ~(torch.isnan(err) | torch.isinf(err))
    err_f = torch.where(finite, err, torch.zeros_like(err))
    rel = err_f / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(torch.argmax(torch.where(bad, err_f + 1.0, torch.zeros_like(err_f))))
    if bool(nan_mismatch.any()) or bool(inf_mismatch.any()):
        worst = int(torch.argmax((nan_mismatch | inf_mismatch).flatten().to(torch.int8)))
    rms_ref = float(e[finite].pow(2).mean().sqrt()) if bool(finite.any()) else float("nan")
    rms_err = float(err_f.pow(2).mean().sqrt())
    flat_a, flat_e = a.flatten(), e.flatten()
    lines = [
        f"{prefix}tensors are not close (tolerance of {str(dtype).replace('torch.', '')}: "
        f"rtol={rtol:g}, atol={atol:g})",
        f"  mismatched elements: {n_bad} / {a.numel()} ({100.0 * n_bad / a.numel():.3g}%)",
        f"  non-finite mismatches: {int(nan_mismatch.sum())} NaN, {int(inf_mismatch.sum())} inf",
        f"  max abs error: {float(err_f.max()):.6g} at {_index_str(int(err_f.argmax()), a.shape)}",
        f"  max rel error: {float(rel.max()):.6g} at {_index_str(int(rel.argmax()), a.shape)}",
        f"  RMS rel error: {rms_err / rms_ref if rms_ref > 0 else float('inf'):.6g}",
        f"  worst element {_index_str(worst, a.shape)}: actual {float(flat_a[worst]):.8g}, "
        f"expected {float(flat_e[worst]):.8g}",
    ]
    raise AssertionError("\n".join(lines))


def own_error_atol(
    baseline: torch.Tensor, expected: torch.Tensor, factor: float, *, floor: float = 0.0
) -> float:
    """``factor * max(max|baseline - expected|, floor)``: an absolute tolerance scaled by
    PyTorch's own error (flash-attention's rule).

    Args:
        baseline: the same computation done by plain PyTorch in the low precision under test.
        expected: the float64 reference (same shape).
        factor: ``k``, how many times PyTorch's own error the kernel may make.
        floor: the smallest error to scale (a few ulps of the result), for inputs on which
            PyTorch happens to be exact.
    """
    if baseline.numel() == 0:
        return factor * floor
    err = float((baseline.detach().double() - expected.detach().double()).abs().max())
    return factor * max(err, floor)


#: Largest ``||actual - expected|| / ||expected||`` the benchmarks accept per dtype (a
#: norm-wise check of a whole output against the float64 reference).
RELATIVE_ERROR_LIMITS: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
    torch.float64: 1e-9,
}


def relative_error_limit(dtype: torch.dtype) -> float:
    """:data:`RELATIVE_ERROR_LIMITS` for ``dtype`` (0 for dtypes that must match exactly)."""
    return RELATIVE_ERROR_LIMITS.get(dtype, 0.0)
