"""The CPU-side proxy for "a CUDA graph can capture this": :func:`assert_graph_safe` (the routine
runs under ``FakeTensorMode``, then twice on real tensors with no host sync and outputs that keep
their addresses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mtp.testing.counters import count_host_syncs

__all__ = [
    "GraphSafetyError",
    "assert_graph_safe",
]


class GraphSafetyError(AssertionError):
    """A routine is not graph-safe: host sync, data-dependent shape, or moving outputs."""


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _clone_args(tree):
    from torch.utils._pytree import tree_map

    def clone(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)

    return tree_map(clone, tree)


def _perturbed(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Same shape, dtype and value set per row, different arrangement (or value for scalars).

    Shuffling along the last dim keeps what callers rely on (a routing map keeps k experts per
    token, probabilities still sum to 1, counts keep their total) while changing the data.
    """
    if t.numel() == 0:
        return t.clone()
    if t.dim() == 0 or t.shape[-1] == 1:
        return t + 1 if t.dtype != torch.bool else ~t
    keys = torch.rand(t.shape, generator=generator).to(t.device)
    order = keys.argsort(dim=-1)
    return t.detach().gather(-1, order)


def _run_fake(fn, args, kwargs) -> None:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )
    from torch.utils._pytree import tree_map

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args, fake_kwargs = tree_map(
        lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    try:
        with mode:
            out = fn(*fake_args, **fake_kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise GraphSafetyError(
            f"not graph-safe: {type(exc).__name__} under FakeTensorMode ({exc}); a value was read "
            "on the host (.item(), .tolist(), a data-dependent if) or an output shape depends on "
            "the data (nonzero, masked_select, boolean indexing)"
        ) from exc
    # Outputs may be real tensors: a routine that writes into state allocated once (a module
    # buffer, a workspace) returns that state. Only symbolic sizes would be a problem.
    for t in _tensors(out):
        if any(not isinstance(s, int) for s in t.shape):
            raise GraphSafetyError(f"not graph-safe: output has a dynamic shape {t.shape}")


def assert_graph_safe(fn: Callable[..., Any], *args: Any, second_args=None, **kwargs: Any) -> Any:
    """Check the CPU-side proxy of "a CUDA graph can capture ``fn``".

    1. ``fn(*args, **kwargs)`` runs under ``FakeTensorMode``: reading a value on the host or
       producing a data-dependent shape raises there.
    2. On real tensors (copies of ``args``), ``fn`` runs twice; between the calls new values are
       copied *into the same input buffers*, as before a graph replay (``second_args`` if given,
       else each tensor shuffled along its last dim). No host sync may happen (counted as in
       :func:`count_host_syncs`), and every output must keep its ``data_ptr()``.

    Both runs happen inside :func:`mtp.utils.simulated_capture`, so data-dependent validation is
    skipped as it would be during a real capture. Returns the outputs of the second call.

    Raises:
        GraphSafetyError: with what went wrong.
    """
    from torch.utils._pytree import tree_map

    from mtp.utils import simulated_capture

    with simulated_capture():
        _run_fake(fn, args, kwargs)
        inputs = _clone_args((args, kwargs))
        with count_host_syncs() as syncs:
            first = fn(*inputs[0], **inputs[1])
        first_ptrs = [t.data_ptr() for t in _tensors(first)]
        if second_args is None:
            generator = torch.Generator().manual_seed(1234)
            new_values = tree_map(
                lambda x: _perturbed(x, generator) if isinstance(x, torch.Tensor) else x,
                inputs[0],
            )
        else:
            new_values = second_args
        targets, sources = _tensors(inputs[0]), _tensors(new_values)
        if len(targets) != len(sources):
            raise ValueError("second_args must hold as many tensors as args")
        with torch.no_grad():
            for dst, src in zip(targets, sources):
                dst.copy_(src)
        with count_host_syncs() as syncs_second:
            second = fn(*inputs[0], **inputs[1])
    events = syncs.events + syncs_second.events
    if events:
        raise GraphSafetyError(f"not graph-safe: host synchronisation(s) {events}")
    second_ptrs = [t.data_ptr() for t in _tensors(second)]
    if len(first_ptrs) != len(second_ptrs):
        raise GraphSafetyError(
            f"not graph-safe: {len(first_ptrs)} output tensors, then {len(second_ptrs)}"
        )
    moved = [i for i, (p, q) in enumerate(zip(first_ptrs, second_ptrs)) if p != q]
    if moved:
        raise GraphSafetyError(
            f"not graph-safe: outputs {moved} changed address between calls (allocate them once, "
            "e.g. in a workspace, and write into them)"
        )
    return second
