"""MoE token permutation: :func:`permute` and :func:`unpermute` (Megatron-Core order).

``permute`` groups the token rows by expert for the expert computation; ``unpermute`` merges the
expert outputs back into token order, weighted by the routing probabilities. The row order and
the ``row_id_map`` are Megatron-Core's (``megatron/core/transformer/moe/moe_utils.py``,
``permute``/``unpermute`` without ``fused=True``), so outputs are interchangeable with it:

- Row order: expert-major, ascending token index within each expert.
- ``row_id_map`` is Megatron's ``sorted_indices``: an int64 ``[N]`` tensor whose entry ``i`` is
  the token (row of ``tokens``) that permuted row ``i`` was copied from, so
  ``permuted[i] == tokens[row_id_map[i]]``. The only addition: ``-1`` marks a row that holds no
  token (an unused drop-and-pad slot, or a row past the routed pairs when validation is off);
  such rows are zero and ``unpermute`` skips them.

Where this differs from Megatron-Core (on purpose):

- ``drop_and_pad``: ``capacity`` may be given explicitly (Megatron derives it from
  ``num_out_tokens // E``, also accepted); an expert with fewer than ``capacity`` tokens gets
  zero rows and ``-1`` in ``row_id_map`` (Megatron assumes the router filled every slot and
  would copy unrouted tokens there). The kept tokens are the same: the first ``capacity`` in
  token order.
- ``unpermute`` is a per-token gather summed in fp32 in ascending row order (deterministic, no
  atomics) instead of a scatter-add; the permute backward is the same gather (Megatron's
  ``index_select`` backward accumulates in the tokens' dtype).
- ``num_out_tokens`` is checked against the routing (data check) instead of silently cutting or
  padding; ``indices=[T, k]`` is accepted in place of ``routing_map``.

Everything runs on the device with static shapes (graph-safe) and without a host sync: the
data checks are device-side asserts by default (:func:`mtp.utils.check_values`;
``validate="sync"`` gives typed errors with the values at the cost of a sync). The one exception
is ``num_out_tokens=None`` with a routing map: the output shape is the routed count, read on the
host.

Backends: ``"triton"`` and ``"reference"`` (plain PyTorch, same signature), chosen by
:func:`mtp.ops._backend.resolve_backend`. Triton: :func:`permute` builds the row map on the
device without a sort (:mod:`mtp.kernels.moe_row_map`: count per expert, then scan and place)
and reads each token row once, writing it to its rows; the token-major map built with it is
a :class:`~mtp.ops.moe_permute.token_map.TokenMap` (``permute(..., return_token_map=True)``),
and with it (``unpermute(..., token_map=...)``) :func:`unpermute` and both backwards run in one
launch each, eagerly and compiled alike. Without one (Megatron's ``sorted_indices``, a three-output
``permute``), ``row_id_map`` is inverted on the device first, in one launch, rows in ascending
order (:mod:`mtp.ops.moe_permute.invert`; logged once), when ``probs`` or a routing bounds the
rows of a token; with neither, with a sort, for the row kernels of :mod:`mtp.kernels.moe_permute`.

An eager call (not compiling or tracing, plain tensors) skips the custom-op layer: its argument
checks run once per key of shapes, dtypes, devices, alignment and options, and the op bodies
run with their cached launches (:mod:`mtp.ops.moe_permute.paths`); the custom ops and fakes are
what ``torch.compile`` and tracers see, with bit-identical results.

This module holds the two entry points; the pieces behind them, all importable from here too:
the row map on its own (:func:`moe_permute_row_map`, :class:`RowMap`, :func:`select_probs`) in
:mod:`mtp.ops.moe_permute.row_map` and the rows of a permutation whose token map is known
(:func:`scatter_rows`) in :mod:`mtp.ops.moe_permute.rows`, the references (:func:`permute_reference`,
:func:`unpermute_reference`) in :mod:`mtp.ops.moe_permute.reference`, the argument and data
checks in :mod:`mtp.ops.moe_permute.checks`, the fused custom ops and :class:`TokenMap` in
:mod:`mtp.ops.moe_permute.token_map` and the row-kernel custom ops in
:mod:`mtp.ops.moe_permute.row_ops`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mtp import settings
from mtp.kernels._launch import Plans, aligned
from mtp.ops.moe_permute import row_ops  # noqa: F401 - registers mtp::moe_gather_rows & co.
from mtp.ops._eager import eager
from mtp.ops.moe_permute.paths import (
    permute_args_plan,
    permute_eager,
    permute_general,
    unpermute_args_plan,
    unpermute_eager,
    unpermute_general,
)
from mtp.ops.moe_permute.reference import permute_reference, unpermute_reference
from mtp.ops.moe_permute.row_map import RowMap, moe_permute_row_map, select_probs
from mtp.ops.moe_permute.rows import scatter_rows
from mtp.ops.moe_permute.token_map import TokenMap

__all__ = [
    "RowMap",
    "TokenMap",
    "permute",
    "unpermute",
    "permute_reference",
    "unpermute_reference",
    "moe_permute_row_map",
    "scatter_rows",
    "select_probs",
]

logger = logging.getLogger("mtp")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
    capacity: int | None = None,
    *,
    indices: torch.Tensor | None = None,
    num_experts: int | None = None,
    backend: str = "auto",
    validate: bool | str = True,
    return_token_map: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor, TokenMap | None
]:
    """Group token rows by expert (Megatron-Core's ``moe_utils.permute`` order).

    Args:
        tokens: ``[T, H]`` fp32/fp16/bf16 (fp64 too).
        routing_map: ``[T, E]`` bool, ``True`` where token ``t`` goes to expert ``e``.
        probs: optional ``[T, E]`` routing probabilities (any float dtype); the probability of
            each permuted row is returned.
        num_out_tokens: ``N``, a Python int so the output shape is static. Dropless: the number
            of routed pairs (``T * k`` for top-k; the default with ``indices=``). Omitted with a
            routing map, it is counted on the host (one sync, not graph-safe). With
            ``drop_and_pad`` it may stand for ``E * capacity`` (Megatron's convention).
        drop_and_pad: give every expert exactly ``capacity`` rows: an expert keeps its first
            ``capacity`` tokens **in token order** (the same tokens Megatron-Core keeps; not
            the top-capacity by probability: drop by probability in the router), and its unused
            slots are zero rows (Megatron assumes the router filled every slot instead).
        capacity: rows per expert with ``drop_and_pad`` (explicit; Megatron derives it from
            ``num_out_tokens // E``, which is also accepted).
        indices: ``[T, k]`` int32/int64 top-k expert numbers instead of ``routing_map``
            (distinct within a row); gives the same order as the equivalent routing map.
        num_experts: ``E`` for ``indices=`` when ``probs`` is not given.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        validate: the checks that read tensor values (``indices`` distinct and in range, routed
            pairs equal to ``num_out_tokens``). ``True``: on the device, no host sync (a
            device-side assert on CUDA; on CPU a ``RuntimeError`` naming the argument).
            ``"sync"`` (or ``MTP_VALIDATE=sync``): a ``ValueError`` with the offending values,
            at the cost of a host sync. ``False``: off. Skipped while tracing/capturing.

    Returns:
        ``(permuted, permuted_probs, row_id_map)``:

        - ``permuted``: ``[N, H]``, tokens' dtype. Rows are expert-major and, within an expert,
          in ascending token order; with ``drop_and_pad`` expert ``e`` owns rows
          ``[e * capacity, (e + 1) * capacity)``.
        - ``permuted_probs``: ``[N]`` in probs' dtype (``probs[row_id_map[i], expert of row i]``;
          0 for an empty row), or None without ``probs``.
        - ``row_id_map``: int64 ``[N]``, Megatron's ``sorted_indices``: ``row_id_map[i]`` is the
          token that row ``i`` holds (``permuted[i] == tokens[row_id_map[i]]``), ``-1`` for a
          row that holds none (an unused drop-and-pad slot, zero in ``permuted``; also rows past
          the routed pairs when ``num_out_tokens`` exceeds them with ``validate=False``). With
          ``validate=False`` and fewer rows than routed pairs, the last pairs are dropped, as in
          Megatron.
        - with ``return_token_map=True``, a fourth output: the token-major
          :class:`~mtp.ops.moe_permute.token_map.TokenMap` the Triton backend built (None on the
          reference backend), for ``unpermute(..., token_map=...)``.

    Triton backend: the row map is built on the device in two launches (count per expert, then
    scan and place; no sort; one for a small routing, which each place program counts itself)
    and each token row is read once and written to its ``k`` rows: three launches (two), no
    host sync; the device-side check reads the status word the place launch writes. Gradients flow to
    ``tokens`` (a per-token fp32 sum of the row gradients, no atomics) and to ``probs``, in one
    launch. The whole path is graph-safe (static shapes, no host sync) once ``num_out_tokens``
    (or ``capacity``) is given.
    """
    routing = routing_map if routing_map is not None else indices
    if eager(tokens, routing, probs) and routing is not None:
        # the kernels take contiguous tensors: the plan is for these (aligned) copies or views
        tokens, routing = tokens.contiguous(), routing.contiguous()
        probs = None if probs is None else probs.contiguous()
        s = settings.current()
        try:
            key = (tokens.shape, tokens.dtype, tokens.device, routing.shape, routing.dtype,
                   routing.device, routing_map is None,
                   None if probs is None else (probs.shape, probs.dtype, probs.device),
                   aligned(tokens, routing, probs), num_out_tokens, drop_and_pad, capacity,
                   num_experts, backend, validate, s.backend, s.validate)  # fmt: skip
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: the checks below name it
            key = plan = None
        if plan is None and key is not None and (
            num_out_tokens is not None or routing_map is None or drop_and_pad
        ):  # the checks and sizes depend on the key only (not on the routing's values)
            plan = _PLANS.add(key, permute_args_plan(
                tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity, indices,
                num_experts, backend, validate))  # fmt: skip
        if plan:
            return permute_eager(tokens, routing, probs, drop_and_pad, return_token_map, *plan)
    return permute_general(tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity,
                           indices, num_experts, backend, validate, return_token_map)


_PLANS = Plans(4096)  # eager calls: argument key -> checks done, sizes, launches


def unpermute(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
    *,
    indices: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool | str = True,
    token_map: TokenMap | None = None,
) -> torch.Tensor:
    """Merge permuted rows back into token order (Megatron-Core's ``moe_utils.unpermute``).

    ``out[t] = sum_i p_i * permuted[i]`` over the rows ``i`` with ``row_id_map[i] == t``, where
    ``p_i = probs[t, expert of row i]`` (or 1 without ``probs``). Computed as a per-token gather
    in fp32, rows summed in ascending order (deterministic, no atomics; Megatron scatter-adds),
    and returned in ``permuted``'s dtype.

    Args:
        permuted: ``[N, H]`` fp32/fp16/bf16 (fp64 too): rows in :func:`permute`'s order.
        row_id_map: int64/int32 ``[N]`` from :func:`permute` (or Megatron's ``sorted_indices``):
            the token of each row; rows with ``-1`` are skipped.
        restore_shape: ``(T, H)`` of the output (``tokens.shape``).
        probs: optional ``[T, E]`` routing probabilities (any float dtype); gets a gradient.
        routing_map: ``[T, E]`` bool; needed with ``probs`` to know each row's expert (unless
            ``drop_and_pad``, where row ``i`` belongs to expert ``i // (N / E)``).
        drop_and_pad: the rows are ``E`` blocks of ``capacity = N / E`` slots.
        indices: ``[T, k]`` top-k expert numbers instead of ``routing_map``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        validate: check the values of ``row_id_map`` (in ``[-1, T)``) and that every row's
            ``(token, expert)`` pair is routed: on the device by default (no host sync),
            ``"sync"`` for typed errors with the values, ``False`` off; skipped while
            tracing/capturing and with a ``token_map`` (built with the row map).
        token_map: see below.

    Returns:
        ``[T, H]`` in ``permuted``'s dtype; tokens no row maps to are zero. Gradients flow to
        ``permuted`` (``p_i * grad[t]``) and ``probs`` (``<permuted[i], grad[t]>``).

    Triton backend with ``token_map`` (the :class:`~mtp.ops.moe_permute.token_map.TokenMap` of
    ``permute(..., return_token_map=True)`` or ``moe_permute_row_map(..., token_map=True)``,
    describing ``row_id_map``; not checked against it): one launch forward (each token loads all
    its row numbers and weights, then its rows) and one backward (each token reads its output
    gradient once and writes its rows' gradients and its probs gradient), eagerly and under
    ``torch.compile``. Without it ``row_id_map`` is inverted on the device first: one launch
    (two for dropless rows with ``probs``, which need the experts' row counts), which also counts
    what the default device check reports (token numbers out of range, rows not routed to their
    expert, more rows for a token than ``routing_map``'s width or ``indices``' ``k``); said once
    in the log. With neither ``probs`` nor a routing, nothing bounds a token's rows: a sort.
    """
    if eager(permuted, row_id_map, probs, routing_map, indices) and (
        token_map is None or type(token_map) is TokenMap
    ):
        s = settings.current()
        try:
            key = ("unpermute", permuted.shape, permuted.dtype, permuted.device,
                   row_id_map.shape, row_id_map.dtype, row_id_map.device, restore_shape,
                   None if probs is None else (probs.shape, probs.dtype, probs.device),
                   None if routing_map is None else
                   (routing_map.shape, routing_map.dtype, routing_map.device),
                   None if indices is None else (indices.shape, indices.dtype, indices.device),
                   drop_and_pad, backend, validate, s.backend, s.validate,
                   None if token_map is None else (token_map.count.shape[0],
                                                   token_map.num_experts, token_map.drop_and_pad))
            plan = _PLANS.get(key)
            if plan is None:
                plan = _PLANS.add(key, unpermute_args_plan(
                    permuted, row_id_map, restore_shape, probs, routing_map, drop_and_pad,
                    indices, backend, validate, token_map))  # fmt: skip
        except TypeError:  # an unhashable argument: the general path's checks name it
            plan = ()
        if plan:
            return unpermute_eager(permuted, row_id_map, probs, routing_map, indices,
                                   token_map, *plan)  # fmt: skip
    return unpermute_general(permuted, row_id_map, restore_shape, probs, routing_map,
                             drop_and_pad, indices, backend, validate, token_map)
