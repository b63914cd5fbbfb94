"""Fused bias + activation ops: ``bias_gelu`` (erf or tanh GeLU) and ``bias_swiglu``.

Custom ops (``torch.ops.mtp.*``), each with a fake implementation and autograd:

- ``mtp::bias_gelu(x, bias, approximate, backend)``
- ``mtp::bias_swiglu(x, bias, backend)``
- ``mtp::bias_act_backward(dy, x, bias, act, need_dbias, backend) -> (dx, dbias)``

Autograd saves only ``x`` and ``bias`` (never ``y`` or ``x + bias``); the backward recomputes
the pre-activation and reduces ``dbias`` over rows in fp32 in two deterministic stages.

``bias`` may be None (a ``bias=False`` layer): the op is then the plain activation. Math is fp32
for every input dtype (fp32, fp16, bf16); the output has ``x``'s dtype and ``dbias`` the bias
dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp.dtypes import KERNEL_FLOATS
from mtp.kernels.bias_act import bias_act_backward, bias_act_forward
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import CheckedKeys, autograd_apply, eager, needs_grad
from mtp.utils import check_tensor, empty

__all__ = [
    "bias_gelu",
    "bias_swiglu",
    "bias_gelu_reference",
    "bias_swiglu_reference",
]

_DTYPES = KERNEL_FLOATS
_BACKENDS = ("triton", "reference")
_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}
# Where the activations are linear (or zero) in fp32: the maths runs on clamped values.
_GELU_LIMIT = 20.0
_SILU_LOW, _SILU_HIGH = -200.0, 20.0


# --------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32 math)
# --------------------------------------------------------------------------------------------


def _pre_activation(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    u = x.float()
    return u if bias is None else u + bias.float()


def _silu_parts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(silu(a), sigmoid(c), c)`` with ``c`` = ``a`` clamped where silu is linear or zero in
    fp32, so that ``silu(+inf) = +inf`` and ``silu(-inf) = 0`` (not ``inf * 0 = NaN``)."""
    c = a.clamp(_SILU_LOW, _SILU_HIGH)
    sig = torch.sigmoid(c)
    return torch.where(a > _SILU_HIGH, a, c * sig), sig, c


def _act_reference(u: torch.Tensor, act: str) -> torch.Tensor:
    """The activation of fp32 ``u`` with PyTorch's own functions (+-inf safe: PyTorch's CPU
    ``gelu`` returns NaN for +-inf in its vectorised path; here ``gelu(+inf) = +inf`` and
    ``gelu(-inf) = 0``)."""
    if act == "swiglu":
        a, g = torch.chunk(u, 2, dim=-1)
        return _silu_parts(a)[0] * g
    c = u.clamp(-_GELU_LIMIT, _GELU_LIMIT)
    y = F.gelu(c, approximate="tanh" if act == "gelu_tanh" else "none")
    return torch.where(u > _GELU_LIMIT, u, y)


def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none"
) -> torch.Tensor:
    """Plain-PyTorch ``gelu(x + bias)``: fp32 math, ``x.dtype`` result (differentiable)."""
    _check_approximate(approximate)
    return _act_reference(_pre_activation(x, bias), _APPROXIMATE[approximate]).to(x.dtype)


def bias_swiglu_reference(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch ``silu(a) * g`` with ``a, g = chunk(x + bias, 2, -1)``, fp32 math."""
    return _act_reference(_pre_activation(x, bias), "swiglu").to(x.dtype)


def _backward_reference(dy, x, bias, act, need_dbias):
    """PyTorch's own backward formulas (aten ``gelu_backward`` / ``silu`` derivative) in fp32, on
    the clamped pre-activation (finite derivatives for +-inf). Differentiable: the double
    backward of the ops runs through it."""
    u = _pre_activation(x, bias)
    dy = dy.float()
    if act == "swiglu":
        a, g = torch.chunk(u, 2, dim=-1)
        silu, sig, c = _silu_parts(a)
        du = torch.cat([dy * g * (sig + c * sig * (1 - sig)), dy * silu], dim=-1)
    else:
        approximate = "tanh" if act == "gelu_tanh" else "none"
        c = u.clamp(-_GELU_LIMIT, _GELU_LIMIT)
        inner = torch.ops.aten.gelu_backward(dy, c, approximate=approximate)
        du = torch.where(u > _GELU_LIMIT, dy, inner)
    dx = du.to(x.dtype)
    if not need_dbias:
        return dx, x.new_empty((0,))
    return dx, du.sum(dim=tuple(range(du.dim() - 1))).to(bias.dtype)


# --------------------------------------------------------------------------------------------
# Triton dispatch
# --------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with a contiguous last dim (a view when possible)."""
    if width == 0:  # reshape(-1, 0) is ambiguous
        return t.reshape(t.shape[:-1].numel(), 0)
    t2 = t.reshape(-1, width)
    if width > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _out_width(x: torch.Tensor, act: str) -> int:
    return x.shape[-1] // 2 if act == "swiglu" else x.shape[-1]


def _forward_impl(x, bias, act, backend):
    return _forward(x, bias, act, resolve_backend(f"bias_{act}", backend, x.device, _BACKENDS))


def _forward(x, bias, act, backend):
    """The forward on a resolved backend (the custom op's body and the eager path's)."""
    if backend == "reference":
        return _act_reference(_pre_activation(x, bias), act).to(x.dtype)
    n = _out_width(x, act)
    y = empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    bias_c = None if bias is None else bias.contiguous()
    bias_act_forward(_rows(x, x.shape[-1]), bias_c, _rows(y, n), act)
    return y


def _forward_fake(x, bias, act):
    return x.new_empty((*x.shape[:-1], _out_width(x, act)))


@torch.library.custom_op("mtp::bias_gelu", mutates_args=())
def _bias_gelu_op(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str, backend: str
) -> torch.Tensor:
    return _forward_impl(x, bias, _APPROXIMATE[approximate], backend)


@_bias_gelu_op.register_fake
def _(x, bias, approximate, backend):
    return _forward_fake(x, bias, "gelu")


@torch.library.custom_op("mtp::bias_swiglu", mutates_args=())
def _bias_swiglu_op(x: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    return _forward_impl(x, bias, "swiglu", backend)


@_bias_swiglu_op.register_fake
def _(x, bias, backend):
    return _forward_fake(x, bias, "swiglu")


@torch.library.custom_op("mtp::bias_act_backward", mutates_args=())
def _bias_act_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    act: str,
    need_dbias: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    backend = resolve_backend(f"bias_{act}", backend, x.device, _BACKENDS)
    return _backward_resolved(dy, x, bias, act, need_dbias and bias is not None, backend)


def _backward_resolved(dy, x, bias, act, need_dbias, backend):
    if backend == "reference":
        return _backward_reference(dy, x, bias, act, need_dbias)
    width = x.shape[-1]
    dx = empty(x.shape, dtype=x.dtype, device=x.device)
    dbias = empty((width,) if need_dbias else (0,), dtype=_dbias_dtype(x, bias), device=x.device)
    bias_act_backward(
        _rows(dy, _out_width(x, act)),
        _rows(x, width),
        None if bias is None else bias.contiguous(),
        _rows(dx, width),
        dbias if need_dbias else None,
        act,
    )
    return dx, dbias


def _dbias_dtype(x: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    return x.dtype if bias is None else bias.dtype


@_bias_act_backward_op.register_fake
def _(dy, x, bias, act, need_dbias, backend):
    n = x.shape[-1] if (need_dbias and bias is not None) else 0
    return x.new_empty(x.shape), x.new_empty((n,), dtype=_dbias_dtype(x, bias))


def _setup_context(ctx, inputs, output, act: str) -> None:
    x, bias = inputs[0], inputs[1]
    ctx.save_for_backward(x, bias)
    ctx.act = act
    ctx.backend = inputs[-1]


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[1]
    if torch.is_grad_enabled():
        # create_graph=True (double backward, e.g. a gradient penalty): the differentiable
        # fp32 formulas in aten ops; the fused kernel has no derivative of its own.
        dx, dbias = _backward_reference(dy, x, bias, ctx.act, need_dbias)
    elif eager(dy):
        backend = resolve_backend(f"bias_{ctx.act}", ctx.backend, x.device, _BACKENDS)
        dx, dbias = _backward_resolved(dy, x, bias, ctx.act, need_dbias, backend)
    else:
        dx, dbias = torch.ops.mtp.bias_act_backward(dy, x, bias, ctx.act, need_dbias, ctx.backend)
    return dx, (dbias if need_dbias else None)


class _BiasAct(torch.autograd.Function):
    """The eager path's autograd: the custom ops' formulas, without the custom-op layer."""

    @staticmethod
    def forward(ctx, x, bias, act, backend):
        ctx.save_for_backward(x, bias)
        ctx.act, ctx.backend = act, backend
        return _forward(x, bias, act, backend)

    @staticmethod
    def backward(ctx, dy):
        return (*_backward(ctx, dy), None, None)


_bias_gelu_op.register_autograd(
    lambda ctx, dy: (*_backward(ctx, dy), None, None),
    setup_context=lambda ctx, inputs, output: _setup_context(
        ctx, inputs, output, _APPROXIMATE[inputs[2]]
    ),
)
_bias_swiglu_op.register_autograd(
    lambda ctx, dy: (*_backward(ctx, dy), None),
    setup_context=lambda ctx, inputs, output: _setup_context(ctx, inputs, output, "swiglu"),
)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _check_approximate(approximate: str) -> None:
    if approximate not in _APPROXIMATE:
        raise ValueError(
            f"approximate must be one of {list(_APPROXIMATE)} (as in torch.nn.functional.gelu), "
            f"got {approximate!r}"
        )


_CHECKED = CheckedKeys()


_BIAS_ACT_APPLY = autograd_apply(_BiasAct)  # the eager path's (C) apply


def _call(op: str, act: str, x, bias, backend: str, custom_op, *op_args):
    """Check the arguments (once per key on the eager path), then run eagerly, or through
    ``custom_op`` when compiling or tracing."""
    if not eager(x, bias):
        _check_inputs(op, x, bias, backend, act == "swiglu")
        backend = resolve_backend(op, backend, x.device, _BACKENDS)
        return custom_op(x, bias, *op_args, backend)
    key = (act, x.shape, x.dtype, x.device,
           None if bias is None else (bias.shape, bias.dtype, bias.device))
    if key not in _CHECKED:
        _check_inputs(op, x, bias, backend, act == "swiglu")
        _CHECKED.add(key)
    backend = resolve_backend(op, backend, x.device, _BACKENDS)
    if needs_grad(x, bias):
        return _BIAS_ACT_APPLY(x, bias, act, backend)
    return _forward(x, bias, act, backend)


def _check_inputs(op: str, x, bias, backend: str, gated: bool) -> None:
    check_tensor("x", x, dtypes=_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the hidden size), got 0-D")
    if gated and x.shape[-1] % 2:
        raise ValueError(
            f"{op}: the last dim of x holds the two SwiGLU halves and must be even, got "
            f"{x.shape[-1]} (shape {tuple(x.shape)})"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=_DTYPES, device=x.device)
        if bias.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{op}: bias must have shape ({x.shape[-1]},) to match the last dim of x "
                f"{tuple(x.shape)}, got {tuple(bias.shape)}"
            )
    resolve_backend(op, backend, x.device, _BACKENDS)


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    approximate: str = "none",
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``gelu(x + bias)`` fused: one read of ``x``, one write of ``y``.

    Args:
        x: ``[..., H]``, float32 / float16 / bfloat16, any leading dims (a copy is made only
            when the rows cannot be viewed with a contiguous last dim).
        bias: ``[H]`` (float32 / float16 / bfloat16), or None for a bias-free layer.
        approximate: ``"none"`` (exact erf GeLU, PyTorch's default) or ``"tanh"`` (the tanh
            approximation Megatron-LM fuses), as in :func:`torch.nn.functional.gelu`.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"`` (see :mod:`mtp.ops`).

    Returns:
        ``[..., H]`` in ``x.dtype``; math in fp32.

    Autograd saves ``x`` and ``bias`` only; backward recomputes ``x + bias``, writes ``dx``
    (``x.dtype``) and ``dbias`` (``bias.dtype``, fp32 two-stage row reduction, deterministic on
    a given device). With ``create_graph=True`` the backward runs as differentiable fp32 aten
    formulas, so double backward works. ``gelu(+inf) = +inf``, ``gelu(-inf) = 0`` (finite
    derivatives 1 and 0); NaN propagates. Zero-width ``x`` gives an empty result.

    Launches: one forward; backward one, two with ``dbias``. The grid is persistent: about as
    many programs as fit on the device at once (``SMs x`` resident blocks for the kernel's
    registers), each owning a column block, loading its bias slice once and walking the rows.

    Bytes (``s`` = element size of ``x``, ``sb`` of ``bias``, ``M`` rows, ``P`` programs):
    forward reads ``M*H*s`` plus the bias once per program and writes ``M*H*s``; backward reads
    ``dy``, ``x`` (``2*M*H*s``) and the bias, writes ``dx`` and ``dbias`` (``M*H*s + H*sb``),
    plus an fp32 partial-sum workspace (one ``H``-row per row program, about ``P*4`` bytes per
    column) written and read once (none without bias).
    """
    act = _APPROXIMATE.get(approximate) if isinstance(approximate, str) else None
    if act is None:
        _check_approximate(approximate)
    return _call("bias_gelu", act, x, bias, backend, torch.ops.mtp.bias_gelu, approximate)


def bias_swiglu(
    x: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """``silu(a) * g`` where ``a, g = torch.chunk(x + bias, 2, dim=-1)``, fused.

    The first half of the last dim goes through SiLU and gates the second half (Megatron-LM's
    ``bias_swiglu`` convention, the activation of gated MoE experts).

    Args:
        x: ``[..., 2*H]``, float32 / float16 / bfloat16, any leading dims.
        bias: ``[2*H]`` or None.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``[..., H]`` in ``x.dtype``; math in fp32.

    Autograd saves ``x`` and ``bias``; backward writes ``dx`` ``[..., 2*H]`` and ``dbias``
    ``[2*H]`` (fp32 two-stage reduction, deterministic). Launches, grid, non-finite inputs and
    double backward as in :func:`bias_gelu` (``silu(-inf) = 0``, ``silu(+inf) = +inf``).

    Bytes (``s`` = element size of ``x``, ``sb`` of ``bias``, ``M`` rows): forward reads
    ``2*M*H*s`` plus the bias once per program and writes ``M*H*s``; backward reads ``dy`` and
    ``x`` (``3*M*H*s``) and the bias, writes ``dx`` and ``dbias`` (``2*M*H*s + 2*H*sb``), plus the
    fp32 partial-sum workspace (none without bias).
    """
    return _call("bias_swiglu", "swiglu", x, bias, backend, torch.ops.mtp.bias_swiglu)
