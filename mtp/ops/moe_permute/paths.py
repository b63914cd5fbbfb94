"""The two paths of :func:`~mtp.ops.permute` and :func:`~mtp.ops.unpermute`.

- Eager (:func:`mtp.ops._eager.eager`, the Triton backend): the checks run once per key of
  argument shapes, dtypes, devices, alignment and options (:func:`permute_args_plan`,
  :func:`unpermute_args_plan`), which also holds the launches; a call then runs the op bodies
  and cached launches directly (under the :class:`~mtp.ops.moe_permute.token_map.Permute` /
  :class:`~mtp.ops.moe_permute.token_map.Unpermute` autograd functions when a gradient is
  recorded). The device checks read the status word the kernels already write.
- General (:func:`permute_general`, :func:`unpermute_general`): the custom ops and their fakes
  (compiling, tracing, meta tensors), the reference backend and ``validate="sync"``.
"""

from __future__ import annotations

import torch

from mtp.dtypes import FLOATS as _FLOAT_DTYPES
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import autograd_apply, needs_grad
from mtp.ops.moe_permute.checks import (
    check_permute_data,
    check_row_map,
    check_token_map,
    check_unpermute_args,
    count_message,
    indices_message,
    inversion,
    resolve_routing,
    resolve_sizes,
    routing_from_indices,
)
from mtp.ops.moe_permute.invert import invert_impl, invert_row_map, token_map_of
from mtp.ops.moe_permute.reference import combine_reference, permute_reference
from mtp.ops.moe_permute.row_map import PERMUTE_BACKENDS as _BACKENDS
from mtp.ops.moe_permute.row_map import row_pairs, select_probs
from mtp.ops.moe_permute.token_map import (
    Permute,
    TokenMap,
    Unpermute,
    log_once,
    permute_plan,
    run_permute,
    say_once,
    unpermute_impl,
)
from mtp.utils import check_tensor, check_values, data_checks_enabled, is_capturing, validation_mode

__all__ = [
    "permute_args_plan",
    "permute_eager",
    "permute_general",
    "unpermute_args_plan",
    "unpermute_eager",
    "unpermute_general",
]


def permute_args_plan(tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity, indices,
                      num_experts, backend, validate) -> tuple:
    """What an eager call with these argument shapes and options does: ``(N, capacity (-1:
    dropless), E, message of the device check or None, device check on, launches)``
    (``launches[zero_empty]``: the :func:`permute_plan` of each scatter variant, made on first
    use); ``()`` for the general path (reference backend, ``validate="sync"``, meta tensors).
    Runs the checks."""
    routing_map, indices, num_experts, n, capacity, choice, mode = permute_args(
        tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity, indices, num_experts,
        backend, validate)  # fmt: skip
    if choice != "triton" or mode == "sync" or tokens.device.type == "meta":
        return ()
    message = None
    if indices is not None or not drop_and_pad:
        message = permute_message(num_experts, n, indices is not None, drop_and_pad)
    cap = -1 if capacity is None else capacity
    return n, cap, num_experts, message, mode == "device", [None, None]


def permute_args(tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity, indices,
                 num_experts, backend, validate) -> tuple:
    """The argument checks of :func:`permute`: ``(routing_map, indices, E, N, capacity,
    backend, validation mode)``."""
    check_tensor("tokens", tokens, ndim=2, dtypes=_FLOAT_DTYPES)
    routing_map, indices, topk, num_experts = resolve_routing(
        tokens.shape, tokens.device, routing_map, indices, probs, num_experts
    )
    n, capacity = resolve_sizes(
        tokens.shape[0], num_experts, routing_map, topk, num_out_tokens, drop_and_pad,
        capacity, validate,
    )
    choice = resolve_backend("permute", backend, tokens.device, _BACKENDS)
    return routing_map, indices, num_experts, n, capacity, choice, validation_mode(validate)


def permute_message(num_experts: int, n: int, by_indices: bool, drop_and_pad: bool) -> str:
    what = [indices_message(num_experts)] if by_indices else []
    if not drop_and_pad and not by_indices:
        what.append(count_message(n, "routing_map"))
    return "permute: " + "; ".join(what) + " (validate='sync' reports the values)"


def permute_eager(tokens, routing, probs, drop_and_pad, return_token_map, n, capacity,
                  num_experts, message, device_check, launches):
    """The eager Triton permute on contiguous tensors: the op body (under :class:`Permute`
    when autograd records)."""
    checking = device_check and not is_capturing()
    # Rows that may hold no token are zeroed by the scatter launch's extra programs.
    zero_empty = drop_and_pad or not checking
    plan = launches[zero_empty]
    if plan is None:
        plan = launches[zero_empty] = permute_plan(tokens, routing, probs, n, num_experts,
                                                   capacity, zero_empty)  # fmt: skip
    with_p = probs is not None and probs.requires_grad
    if (tokens.requires_grad or with_p) and torch.is_grad_enabled():  # needs_grad, inlined
        maps = []
        out = _PERMUTE_APPLY(tokens, probs, (plan, routing, n, num_experts, with_p, maps))
        if with_p:
            (permuted, pprobs), (row_id_map, rows, experts, count, ok) = out, maps
        else:
            permuted, (pprobs, row_id_map, rows, experts, count, ok) = out, maps
    else:
        permuted, pprobs, row_id_map, rows, experts, count, ok = run_permute(
            plan, tokens, routing, probs, n, num_experts)
    if checking and message is not None:
        torch._assert_async(ok, message)
    out = (permuted, (pprobs if probs is not None else None), row_id_map)
    if return_token_map:
        return (*out, TokenMap(rows, experts, count, num_experts, drop_and_pad))
    return out


def permute_general(tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity,
                    indices, num_experts, backend, validate, return_token_map):
    """The general path: the custom op (compiling, tracing, meta tensors), the reference
    backend, ``validate="sync"``."""
    routing_map, indices, num_experts, n, capacity, choice, mode = permute_args(
        tokens, routing_map, probs, num_out_tokens, drop_and_pad, capacity, indices, num_experts,
        backend, validate)  # fmt: skip
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
        message = permute_message(num_experts, n, indices is not None, drop_and_pad)
        check_values(ok, message, validate=mode, tensors=(routing,))
    out = (permuted, (pprobs if probs is not None else None), row_id_map)
    if return_token_map:
        return (*out, TokenMap(rows, experts, count, num_experts, drop_and_pad))
    return out


_PERMUTE_APPLY = autograd_apply(Permute)  # the eager path's (C) apply
_UNPERMUTE_APPLY = autograd_apply(Unpermute)

_INVERTED = (
    "mtp.ops.unpermute: no token_map given, so row_id_map is inverted on the device first "
    "(one launch more than with it); pass the TokenMap of permute(..., return_token_map=True) "
    "as token_map="
)
_SORTED = (
    "mtp.ops.unpermute: no token_map given and no probs or routing to bound a token's rows, "
    "so row_id_map is inverted on the device with a sort; pass the TokenMap of "
    "permute(..., return_token_map=True) as token_map= (or routing_map=)"
)


def unpermute_args_plan(permuted, row_id_map, restore_shape, probs, routing_map, drop_and_pad,
                        indices, backend, validate, token_map) -> tuple:
    """``(T, inversion or None, device check on)`` of an eager Triton call with these argument
    shapes and options (see :func:`~mtp.ops.moe_permute.checks.inversion`); ``()`` for the
    general path. Runs the checks."""
    num_tokens, experts, routing_map, indices, choice, mode = unpermute_args(
        permuted, row_id_map, restore_shape, probs, routing_map, drop_and_pad, indices, backend,
        validate, token_map)  # fmt: skip
    if choice != "triton" or permuted.device.type == "meta":
        return ()
    if token_map is not None:
        return num_tokens, None, False
    inv = inversion(permuted.shape[0], num_tokens, experts, routing_map, indices, drop_and_pad)
    if inv is None or mode == "sync":
        return ()
    return num_tokens, inv, mode == "device" and row_id_map.shape[0] > 0


def unpermute_args(permuted, row_id_map, restore_shape, probs, routing_map, drop_and_pad,
                   indices, backend, validate, token_map) -> tuple:
    """The argument checks of :func:`unpermute`: ``(T, E or None, routing_map, indices,
    backend, validation mode)``."""
    num_tokens, experts, routing_map, indices = check_unpermute_args(
        permuted, row_id_map, restore_shape, probs, routing_map, indices, drop_and_pad
    )
    choice = resolve_backend("unpermute", backend, permuted.device, _BACKENDS)
    if token_map is not None:
        check_token_map(token_map, num_tokens, experts, drop_and_pad)
    mode = validation_mode(validate)
    return num_tokens, experts, routing_map, indices, choice, mode


def unpermute_eager(permuted, row_id_map, probs, routing_map, indices, token_map, num_tokens,
                    inv, device_check):
    """The eager Triton unpermute: the op body (under :class:`Unpermute` when autograd
    records), after inverting ``row_id_map`` when no token map is given."""
    if token_map is not None:
        rows, experts, count = token_map.rows, token_map.experts, token_map.count
    else:
        route, num_experts, width, capacity, want_experts, message = inv
        checking = device_check and not is_capturing()
        routing = None if route == 0 else (routing_map if route == 1 else indices)
        packed, counts = invert_impl(row_id_map, routing, num_tokens, num_experts, width,
                                     capacity, want_experts, checking)  # fmt: skip
        rows, experts, count, problems = token_map_of(packed, counts)
        if checking:
            torch._assert_async(problems == 0, message)
        log_once(_INVERTED)
    if needs_grad(permuted, probs):
        return _UNPERMUTE_APPLY(permuted, probs, (rows, experts, count, row_id_map))
    return unpermute_impl(permuted, rows, experts, count, probs)


def unpermute_general(permuted, row_id_map, restore_shape, probs, routing_map, drop_and_pad,
                      indices, backend, validate, token_map):
    """The general path: the custom ops (compiling, tracing, meta tensors), the reference
    backend, ``validate="sync"``, no token map and nothing to bound a token's rows."""
    num_tokens, experts, routing_map, indices, choice, mode = unpermute_args(
        permuted, row_id_map, restore_shape, probs, routing_map, drop_and_pad, indices, backend,
        validate, token_map)  # fmt: skip
    if choice == "triton":
        if token_map is not None:
            tm = token_map
            return torch.ops.mtp.moe_unpermute(
                permuted, tm.rows, tm.experts, tm.count, row_id_map, probs
            )
        inv = inversion(permuted.shape[0], num_tokens, experts, routing_map, indices,
                        drop_and_pad)  # fmt: skip
        if inv is not None and mode != "sync":
            route, num_experts, width, capacity, want_experts, message = inv
            checking = (mode == "device" and row_id_map.shape[0] > 0
                        and data_checks_enabled(True, row_id_map))  # fmt: skip
            routing = None if route == 0 else (routing_map if route == 1 else indices)
            rows, exps, count, problems = invert_row_map(
                row_id_map, routing, num_tokens, num_experts, width, capacity, want_experts,
                checking)  # fmt: skip
            if checking:
                check_values(problems == 0, message, validate=mode, tensors=(row_id_map,))
            say_once(_INVERTED)
            return torch.ops.mtp.moe_unpermute(permuted, rows, exps, count, row_id_map,
                                               probs)  # fmt: skip
        say_once(_SORTED)
    pair = None
    if probs is not None:
        if indices is not None:
            check_permute_data(mode, None, indices, experts, indices.numel(), True)
            routing_map = routing_from_indices(indices, experts)
        pair = row_pairs(row_id_map, num_tokens, experts, routing_map, drop_and_pad)
    check_row_map(validate, row_id_map, num_tokens, pair, routing_map)
    weight = None if pair is None else select_probs(probs, pair)
    if choice == "reference":
        return combine_reference(permuted, row_id_map, weight, num_tokens)
    return torch.ops.mtp.moe_combine_rows(permuted, row_id_map, weight, num_tokens)
