"""Quantised weights reused while the weight is unchanged: :class:`Fp8WeightCache`.

An expert weight changes once per optimizer step but is read by every micro-batch's forward and
backward; quantising it on every call would cost a read of the BF16/FP32 weight and a write of
its FP8 copies per GEMM. The cache keeps the FP8 operands of a weight and hands them back as
long as the weight is the same tensor with the same *version* and storage:

- ``tensor._version`` is bumped by every in-place write (the optimizer's ``add_``/``copy_``,
  ``load_state_dict``, ``with torch.no_grad(): w.copy_(...)``), also through a view of a larger
  buffer (views share their base's counter: a distributed optimizer's parameter buffer);
- ``data_ptr()`` catches ``w.data = ...`` and storage that is freed and re-allocated.

Some optimizers write the parameters through ``param.data`` (Megatron-Core's distributed
optimizer copies its main parameters so), which bumps no version; so every entry also records
a global *generation*, advanced after every ``torch.optim.Optimizer.step`` (a global step
post-hook: also the inner optimizer of a wrapper) and by :meth:`Fp8WeightCache.invalidate_all`
(for updates made any other way). Bypassed (the weight quantised on every call, nothing
stored): while a CUDA graph is being captured (a replay cannot re-check the version, so the
captured graph must quantise: once per replay, i.e. per captured step), while compiling or
tracing, and for inference-mode tensors (no version counter).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mtp.ops._eager import eager

__all__ = ["Fp8WeightCache"]


def _capturing(w: torch.Tensor) -> bool:
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


_GENERATION = [0]


def _next_generation(*_) -> None:
    _GENERATION[0] += 1


register_optimizer_step_post_hook(_next_generation)


def _stamp(w: torch.Tensor) -> tuple:
    return _GENERATION[0], w._version, w.data_ptr()


class Fp8WeightCache:
    """``get(w, key, make)``: ``make()``'s value for ``(w, key)``, computed again only when
    ``w`` changed since (see the module doc); ``lookup(w, key)``: the value or None. Holds the
    values (not ``w``: a weak reference); pickling or copying gives an empty cache.
    ``hits``/``misses`` count the lookups that found a value / computed one to keep."""

    def __init__(self) -> None:
        self._entries: dict = {}
        self.hits = 0
        self.misses = 0

    def _usable(self, w: torch.Tensor) -> bool:
        return eager(w) and not w.is_inference() and not _capturing(w)

    def lookup(self, w: torch.Tensor, key):
        """The value stored for ``(w, key)`` while ``w`` is unchanged, else None."""
        if not self._usable(w):
            return None
        entry = self._entries.get((id(w), key))
        if entry is not None and entry[0]() is w and entry[1] == _stamp(w):
            self.hits += 1
            return entry[2]
        return None

    def get(self, w: torch.Tensor, key, make: Callable[[], object]):
        value = self.lookup(w, key)
        if value is not None:
            return value
        value = make()
        if not self._usable(w):
            return value
        self.misses += 1
        stamp = _stamp(w)
        # drop entries of dead tensors and stale versions of this one
        self._entries = {k: e for k, e in self._entries.items()
                         if e[0]() is not None and (k[0] != id(w) or e[1] == stamp)}  # fmt: skip
        self._entries[(id(w), key)] = (weakref.ref(w), stamp, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    @staticmethod
    def invalidate_all() -> None:
        """Every cache's entries are stale from now on (after weights were changed in a way
        that bumps no version and is no ``torch.optim`` step)."""
        _next_generation()

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
