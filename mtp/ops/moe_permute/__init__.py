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
``permute``), ``row_id_map`` is inverted on the device with a sort (logged once) and handled by
the row kernels of :mod:`mtp.kernels.moe_permute`.

This module holds the two entry points; the pieces behind them, all importable from here too:
the row map on its own (:func:`moe_permute_row_map`, :class:`RowMap`, :func:`select_probs`) in
:mod:`mtp.ops.moe_permute.row_map`, the references (:func:`permute_reference`,
:func:`unpermute_reference`) in :mod:`mtp.ops.moe_permute.reference`, the argument and data
checks in :mod:`mtp.ops.moe_permute.checks`, the fused custom ops and :class:`TokenMap` in
:mod:`mtp.ops.moe_permute.token_map` and the row-kernel custom ops in
:mod:`mtp.ops.moe_permute.row_ops`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mtp.dtypes import FLOATS as _FLOAT_DTYPES
from mtp.dtypes import INDEX_DTYPES as _INDEX_DTYPES
from mtp.ops.moe_permute import row_ops  # noqa: F401 - registers mtp::moe_gather_rows & co.
from mtp.ops._backend import resolve_backend
from mtp.ops.moe_permute.checks import (
    check_permute_data,
    check_row_map,
    check_token_map,
    count_message,
    indices_message,
    resolve_routing,
    resolve_sizes,
    routing_from_indices,
)
from mtp.ops.moe_permute.reference import (
    combine_reference,
    permute_reference,
    unpermute_reference,
)
from mtp.ops.moe_permute.row_map import PERMUTE_BACKENDS as _BACKENDS
from mtp.ops.moe_permute.row_map import RowMap, moe_permute_row_map, row_pairs, select_probs
from mtp.ops.moe_permute.token_map import TokenMap, say_once
from mtp.utils import check_tensor, check_values, data_checks_enabled, validation_mode

__all__ = [
    "RowMap",
    "TokenMap",
    "permute",
    "unpermute",
    "permute_reference",
    "unpermute_reference",
    "moe_permute_row_map",
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
    scan and place; no sort) and each token row is read once and written to its ``k`` rows:
    three launches (four with the device-side check), no host sync. Gradients flow to
    ``tokens`` (a per-token fp32 sum of the row gradients, no atomics) and to ``probs``, in one
    launch. The whole path is graph-safe (static shapes, no host sync) once ``num_out_tokens``
    (or ``capacity``) is given.
    """
    check_tensor("tokens", tokens, ndim=2, dtypes=_FLOAT_DTYPES)
    routing_map, indices, topk, num_experts = resolve_routing(
        tokens.shape, tokens.device, routing_map, indices, probs, num_experts
    )
    n, capacity = resolve_sizes(
        tokens.shape[0], num_experts, routing_map, topk, num_out_tokens, drop_and_pad,
        capacity, validate,
    )
    choice = resolve_backend("permute", backend, tokens.device, _BACKENDS)
    mode = validation_mode(validate)
    if choice == "reference" or mode == "sync":
        check_permute_data(mode, routing_map, indices, num_experts, n, drop_and_pad)
    if choice == "reference":
        if routing_map is None:
            routing_map = routing_from_indices(indices, num_experts)
        out = permute_reference(tokens, routing_map, probs, n, drop_and_pad, capacity)
        return (*out, None) if return_token_map else out
    routing = routing_map if routing_map is not None else indices
    checking = mode == "device" and data_checks_enabled(True, routing)
    # Rows that may hold no token are zeroed by the scatter launch's extra programs.
    zero_empty = drop_and_pad or not (checking or mode == "sync")
    permuted, pprobs, row_id_map, rows, experts, count, ok = torch.ops.mtp.moe_permute(
        tokens, routing, probs, n, num_experts, -1 if capacity is None else capacity, zero_empty
    )
    if checking and (indices is not None or not drop_and_pad):
        what = [indices_message(num_experts)] if indices is not None else []
        if not drop_and_pad and indices is None:
            what.append(count_message(n, "routing_map"))
        check_values(ok, "permute: " + "; ".join(what) + " (validate='sync' reports the values)",
                     validate=mode, tensors=(routing,))
    out = (permuted, (pprobs if probs is not None else None), row_id_map)
    if return_token_map:
        return (*out, TokenMap(rows, experts, count, num_experts, drop_and_pad))
    return out


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
    ``torch.compile``. Without it ``row_id_map`` is inverted on the device first (a sort; said
    once in the log).
    """
    check_tensor("permuted", permuted, ndim=2, dtypes=_FLOAT_DTYPES)
    device = permuted.device
    check_tensor("row_id_map", row_id_map, ndim=1, dtypes=_INDEX_DTYPES, device=device)
    num_rows, hidden = permuted.shape
    if row_id_map.shape[0] != num_rows:
        raise ValueError(
            f"row_id_map must have one entry per permuted row ({num_rows}), got "
            f"{row_id_map.shape[0]}"
        )
    shape = tuple(restore_shape)
    if len(shape) != 2 or any(isinstance(s, bool) or not isinstance(s, int) for s in shape):
        raise ValueError(f"restore_shape must be (T, H) ints, got {restore_shape!r}")
    if shape[1] != hidden:
        raise ValueError(f"restore_shape {shape} must end in permuted's hidden size {hidden}")
    num_tokens = shape[0]
    experts = None
    if probs is not None:
        check_tensor("probs", probs, ndim=2, dtypes=_FLOAT_DTYPES, device=device)
        if probs.shape[0] != num_tokens:
            raise ValueError(
                f"probs must be [T, E] with T={num_tokens} (restore_shape), got "
                f"{tuple(probs.shape)}"
            )
        experts = probs.shape[1]
        if routing_map is not None or indices is not None:
            routing_map, indices, _, _ = resolve_routing(
                shape, device, routing_map, indices, probs, experts
            )
        elif not drop_and_pad:
            raise ValueError(
                "unpermute with probs needs routing_map= (or indices=) to know each row's "
                "expert (not needed with drop_and_pad)"
            )
        if drop_and_pad and (experts == 0 or num_rows % experts):
            raise ValueError(
                f"drop_and_pad: permuted has {num_rows} rows, not a multiple of E={experts}"
            )
    choice = resolve_backend("unpermute", backend, device, _BACKENDS)
    if token_map is not None:
        check_token_map(token_map, num_tokens, experts, drop_and_pad)
    if choice == "triton":
        if token_map is not None:
            tm = token_map
            return torch.ops.mtp.moe_unpermute(
                permuted, tm.rows, tm.experts, tm.count, row_id_map, probs
            )
        say_once(
            "mtp.ops.unpermute: no token_map given, so row_id_map is inverted on the device "
            "with a sort (one launch more than the fused path); pass the TokenMap of "
            "permute(..., return_token_map=True) as token_map="
        )
    pair = None
    if probs is not None:
        mode = validation_mode(validate)
        if indices is not None:
            check_permute_data(mode, None, indices, experts, indices.numel(), True)
            routing_map = routing_from_indices(indices, experts)
        pair = row_pairs(row_id_map, num_tokens, experts, routing_map, drop_and_pad)
    check_row_map(validate, row_id_map, num_tokens, pair, routing_map)
    weight = None if pair is None else select_probs(probs, pair)
    if choice == "reference":
        return combine_reference(permuted, row_id_map, weight, num_tokens)
    return torch.ops.mtp.moe_combine_rows(permuted, row_id_map, weight, num_tokens)
