"""mtp.ops.linear_cross_entropy, structurally: the GEMM FLOPs of each pass (3 GEMMs' worth for a
reduced loss, the logits never recomputed; 4 for ``reduction="none"``; 1 without gradients) and
its memory, measured by the storages its ops allocate (alive until freed) and by the bytes it
saves for the backward: the forward holds one chunk of logits beyond ``O(rows)``, and the
forward and backward together the fp32 ``d_weight``, ``d_hidden`` and one chunk."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mtp import settings
from mtp.ops.linear_cross_entropy import linear_cross_entropy
from mtp.testing.traffic import _custom_op_impl

N, H, V = 64, 16, 96


def _inputs(n=N, h=H, v=V, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_(grad)
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_(grad)
    target = torch.randint(0, v, (n,), generator=g)
    target[::7] = -100
    return hidden, weight, target


class _Entering(TorchDispatchMode):
    """A mode that sees the aten ops inside mtp's custom ops too: ``op(func, args, kwargs)``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("mtp::"):
            with self:
                return _custom_op_impl(name)(*args, **kwargs)
        return self.op(func, args, kwargs)


class _Gemms(_Entering):
    """FLOPs and calls of the matrix products."""

    def __init__(self):
        super().__init__()
        self.flops, self.calls = 0, 0

    def op(self, func, args, kwargs):
        if func._schema.name in ("aten::mm", "aten::addmm", "aten::addmm_"):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.calls += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _gemms():
    mode = _Gemms()
    with mode:
        yield mode


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gemm_flops_per_pass(reduction, backend):
    """``2 N H V`` FLOPs per GEMM. Reduced loss: the three GEMMs (logits, ``d_hidden``,
    ``d_weight``) all in the forward, none in the backward; ``"none"``: the logits forward, and
    again with the two gradient GEMMs backward; without gradients: the logits only. Three calls
    per chunk (a bias rides in the logits GEMM's epilogue)."""
    hidden, weight, target = _inputs()
    bias = torch.zeros(V, requires_grad=True)
    kw = dict(bias=bias, reduction=reduction, chunk_size=16, backend=backend)
    gemm = 2 * N * H * V
    with _gemms() as fwd:
        loss = linear_cross_entropy(hidden, weight, target, **kw)
    with _gemms() as bwd:
        loss.sum().backward()
    chunks = N // 16
    if reduction == "none":
        assert (fwd.flops, bwd.flops) == (gemm, 3 * gemm), (fwd.flops, bwd.flops)
        assert (fwd.calls, bwd.calls) == (chunks, 3 * chunks)
    else:
        assert (fwd.flops, bwd.flops) == (3 * gemm, 0), (fwd.flops, bwd.flops)
        assert (fwd.calls, bwd.calls) == (3 * chunks, 0)
    with torch.no_grad(), _gemms() as nograd:
        linear_cross_entropy(hidden, weight, target, **kw)
    assert (nograd.flops, nograd.calls) == (gemm, chunks)


def test_frozen_weight_or_hidden_skips_its_gemm():
    """Only the gradients asked for are computed: a frozen head skips the ``d_weight`` GEMM, a
    frozen trunk the ``d_hidden`` GEMM."""
    for frozen in (0, 1):
        hidden, weight, target = _inputs()
        (hidden, weight)[frozen].requires_grad_(False)
        with _gemms() as fwd:
            loss = linear_cross_entropy(hidden, weight, target, chunk_size=16, backend="torch")
        loss.backward()
        assert fwd.flops == 2 * (2 * N * H * V), (frozen, fwd.flops)
        assert (hidden, weight)[1 - frozen].grad is not None


class _Allocations(_Entering):
    """Live bytes of the storages the ops in the block create, each counted until it is freed
    (a finalizer on its storage); ``peak``: their most at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.alive: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self.alive.discard(ptr)
        self.live -= nbytes

    def op(self, func, args, kwargs):
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # views, out= and in-place ops: not new
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and ptr not in self.alive and ptr not in inputs:
                self.alive.add(ptr)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, ptr, nbytes)
        return out


def _collect_interpreter_cycles() -> None:
    """The Triton interpreter leaves its launches' arguments in reference cycles (a GPU launch
    keeps none): a collection frees the forward's chunk buffer as a GPU run would at once."""
    gc.collect()


def _peak_bytes(fn) -> int:
    """Peak bytes of the tensors ``fn()`` allocates, alive at once."""
    with _Allocations() as mode:
        fn()
    return mode.peak


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward that are not the inputs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    inputs = {id(t) for t in fn.inputs}
    extra = {t.data_ptr(): t.untyped_storage().nbytes() for t in saved
             if t is not None and id(t) not in inputs and t.numel()}  # fmt: skip
    return out, sum(extra.values())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_memory_is_one_chunk_forward_and_the_gradients_backward(reduction):
    """fp32, Triton kernels (the interpreter), chunks of N/8 rows (the default chunk at 8k+
    rows): the forward without gradients peaks at 1/8 of the logits' bytes plus ``O(rows)``;
    with gradients the whole step peaks at ``4 V H`` (fp32 ``d_weight``) + ``4 N H``
    (``d_hidden``) + 1/8 of the logits; a reduced loss saves only its fp32 gradients."""
    settings.configure(poison_outputs=False)
    n, h, v = 256, 32, 1000
    hidden, weight, target = _inputs(n, h, v, seed=1)
    logits, rows = n * v * 4, 64 * n
    kw = dict(chunk_size=n // 8, reduction=reduction, backend="triton")
    with torch.no_grad():
        fwd = _peak_bytes(lambda: linear_cross_entropy(hidden, weight, target, **kw))
    assert fwd <= logits // 8 + rows, (fwd, logits // 8)

    def step():
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, target, **kw)
        _collect_interpreter_cycles()
        loss.sum().backward()

    both = _peak_bytes(step)
    grads = 4 * v * h + 4 * n * h
    assert both <= grads + logits // 8 + rows, (both, grads, logits // 8)

    def call():
        return linear_cross_entropy(hidden, weight, target, **kw)

    call.inputs = (hidden, weight, target)
    _, saved = _saved_bytes(call)
    assert saved <= (grads if reduction == "mean" else 0) + rows, (saved, grads)
