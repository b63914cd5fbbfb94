"""The eager path of :func:`mtp.ops.grouped_gemm` (and of :func:`mtp.ops.grouped_mlp`'s checks
and counts): what a call on plain tensors outside any trace runs instead of the custom ops.

- The free argument checks (shapes, dtypes, devices, options, the backend's needs) run once per
  key (:class:`mtp.ops._eager.CheckedKeys`); what depends on addresses or flags (``out``
  overlapping an input, ``main_grad``) every call.
- The counts' data check (``validate=True``, on the device) is the status word that the
  tile-map kernel writes anyway on the ``triton`` backend (one ``torch._assert_async`` on it,
  no reductions of its own); other backends keep the aten check.
- One :class:`~mtp.kernels.grouped_gemm_details.routing.Routing` per call: the tile maps and
  expert rows of the counts, derived once and shared by the forward and the backward.
- The autograd function (:class:`~mtp.ops.grouped_gemm.ops.GroupedGemmFunction`) and the
  custom ops' bodies run directly, so outputs are bit-identical to the custom-op path.
"""

from __future__ import annotations

import torch

from mtp import settings
from mtp.kernels._common import gpu_like
from mtp.kernels._launch import Plans
from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import CheckedKeys, autograd_apply, needs_grad
from mtp.ops.grouped_gemm.backends import GROUPED_GEMM_BACKENDS
from mtp.ops.grouped_gemm.checks import (
    check_arguments,
    check_backend,
    check_count_values,
    check_main_grad,
    check_out_memory,
    check_probs,
    count_message,
    n_of,
)
from mtp.ops.grouped_gemm.config import TUNED_BACKENDS, device_arch, measured_backend
from mtp.ops.grouped_gemm.ops import GroupedGemmFunction, forward
from mtp.utils import capturing_on, validation_mode

__all__ = ["backend_name", "call", "counts_and_routing", "remember", "seen", "tuned_backend"]

_CHECKED = CheckedKeys()
_NAMES = tuple(GROUPED_GEMM_BACKENDS)
_TRITON = GROUPED_GEMM_BACKENDS["triton"]
_APPLY = autograd_apply(GroupedGemmFunction)
_RESOLVED: dict = {}
_MESSAGES = Plans(64)  # the counts check's message per M


def seen(key) -> bool:
    """Whether the checks of ``key`` passed before (False for an unhashable key: an argument of
    a wrong type, which the checks then name)."""
    try:
        return key in _CHECKED.keys
    except TypeError:
        return False


def remember(key) -> None:
    _CHECKED.add(key)


def backend_name(op: str, backend, device: torch.device, names: tuple) -> str:
    """:func:`mtp.ops._backend.resolve_backend`, kept per (op, backend, device) while the
    settings object and :func:`mtp.kernels._common.gpu_like` (what it reads) stay the same."""
    if backend.__class__ is not str:
        return resolve_backend(op, backend, device, names)
    now = settings.current()
    key = (op, backend, device, gpu_like(device))
    hit = _RESOLVED.get(key)
    if hit is None or hit[0] is not now:
        if len(_RESOLVED) > 64:
            _RESOLVED.clear()
        hit = _RESOLVED[key] = (now, resolve_backend(op, backend, device, names))
    return hit[1]


def tuned_backend(x, w, trans_b) -> str | None:
    """The backend the tuning sweep measured fastest at this shape class (config.TUNED_BACKENDS),
    when it can run these inputs here; None otherwise."""
    if not TUNED_BACKENDS or w.dim() != 3:
        return None
    arch, _ = device_arch(x.device)
    name = measured_backend(arch, x.dtype, x.shape[0], n_of(w, trans_b), x.shape[1], w.shape[0])
    check = GROUPED_GEMM_BACKENDS[name].check if name in GROUPED_GEMM_BACKENDS else None
    try:
        if name is not None and check is not None:
            check(x, w)
    except (TypeError, ValueError):
        return None
    return name


def counts_and_routing(tokens_per_expert, x, E: int, impl, mode: str, M: int | None = None):
    """``(counts, routing)``: the counts where backend ``impl`` reads them, and the call's
    :class:`Routing` for ``M`` rows (default ``x``'s; its status word asserted on the device for
    ``validate`` mode ``"device"`` on the ``triton`` backend; the other modes and backends check
    here)."""
    counts = tokens_per_expert.contiguous()
    if not impl.device_counts:
        counts = counts.to("cpu")  # the loop backends' one host copy
    elif counts.device != x.device:
        counts = counts.to(x.device)
    M = x.shape[0] if M is None else M
    check = None
    if mode != "off" and E and not capturing_on(counts):
        if mode == "device" and impl is _TRITON:
            check = _MESSAGES.get(M) or _MESSAGES.add(M, count_message(M))
        else:
            check_count_values(counts, M, mode)
    return counts, Routing(counts, M, E, check)


def call(x, w, tokens_per_expert, trans_b, backend, out, validate, bias, activation, probs,
         limit, alpha, accumulate):  # fmt: skip
    """:func:`mtp.ops.grouped_gemm` on the eager path (same arguments, resolved defaults)."""
    mode = settings.current().validate if validate is True else validation_mode(validate)
    name = backend_name("grouped_gemm", backend, x.device, _NAMES)
    if TUNED_BACKENDS and backend == "auto" and name == "triton" and bias is None \
            and activation is None:
        name = tuned_backend(x, w, trans_b) or name  # the sweep's fastest, if any
    t = tokens_per_expert
    key = (name, x.shape, x.dtype, x.device, w.shape, w.dtype, w.device, t.shape, t.dtype,
           t.device, trans_b, trans_b.__class__, activation,
           bias is None or (bias.shape, bias.dtype, bias.device),
           probs is None or (probs.shape, probs.dtype, probs.device),
           out is None or (out.shape, out.dtype, out.device))  # fmt: skip
    impl = GROUPED_GEMM_BACKENDS[name]
    try:
        known = key in _CHECKED.keys
    except TypeError:  # an argument of a wrong type: the checks name it
        known = False
    if not known:
        check_arguments(x, w, t, trans_b, out, bias, activation)
        check_backend(name, impl, x, w, t)
        check_probs(probs, x, activation)
        remember(key)
    elif out is not None:
        check_out_memory(out, x, w, t, plain=True)
    if accumulate and w.requires_grad:
        check_main_grad(w)
    counts, routing = counts_and_routing(t, x, w.shape[0], impl, mode)
    if limit.__class__ is not float or alpha.__class__ is not float:
        limit, alpha = float(limit), float(alpha)
    if needs_grad(x, w, bias, probs):
        y = _APPLY(x, w, bias, probs, out, counts, (
            trans_b, name, activation, limit, alpha, accumulate, routing))
    else:
        y = forward(x, w, counts, out, bias, probs, trans_b, name, activation, limit, alpha,
                    routing)[0]  # fmt: skip
    if routing.head is None:
        routing.validate()
    return y
