"""Argument and data checks of :func:`mtp.ops.permute` / :func:`mtp.ops.unpermute`.

Shape, dtype and device checks are free and always on. Data checks (indices in range and
distinct, routed pairs against ``num_out_tokens``, row map values) follow the project rule
(:func:`mtp.utils.check_values`): on the device by default (no host sync), typed errors with the
offending values under ``validate="sync"``, none with ``validate=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mtp.utils import check_int, check_tensor, check_values, data_checks_enabled, validation_mode
from mtp.ops.moe_permute.token_map import TokenMap

logger = logging.getLogger("mtp")

from mtp.dtypes import FLOATS as _FLOAT_DTYPES  # noqa: E402
from mtp.dtypes import INDEX_DTYPES as _INDEX_DTYPES  # noqa: E402


def routing_from_indices(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, k]`` top-k expert indices -> ``[T, E]`` bool routing map (device, static shape;
    out-of-range numbers are clamped: validate them first)."""
    idx = indices.to(torch.int64).clamp(0, max(num_experts - 1, 0))
    routing = torch.zeros((indices.shape[0], num_experts), dtype=torch.bool, device=indices.device)
    if indices.numel():
        routing.scatter_(1, idx, True)
    return routing


def indices_message(num_experts: int) -> str:
    return (
        f"indices must hold k distinct expert numbers in [0, {num_experts}) in each token's row"
    )


def count_message(num_out_tokens: int, source: str) -> str:
    return (
        f"num_out_tokens={num_out_tokens} must equal the number of (token, expert) pairs "
        f"{source} routes (without drop_and_pad)"
    )


def check_indices_sync(indices: torch.Tensor, num_experts: int) -> None:
    """Typed errors with the values (one host sync): ``validate="sync"``."""
    if indices.numel() == 0:
        return
    bad_range = ((indices < 0) | (indices >= num_experts)).any()
    sorted_idx = indices.sort(dim=1).values
    dup = (sorted_idx[:, 1:] == sorted_idx[:, :-1]).any()
    bad_range, dup = torch.stack([bad_range, dup]).tolist()
    if bad_range:
        raise ValueError(
            f"indices must hold expert numbers in [0, {num_experts}), got values outside "
            f"(min {int(indices.min())}, max {int(indices.max())})"
        )
    if dup:
        raise ValueError("indices must not repeat an expert within a token's row")


def indices_valid(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """0-d bool on the device: every row of ``indices`` holds distinct experts in range."""
    ok = ((indices >= 0) & (indices < num_experts)).all()
    if indices.shape[1] > 1:
        s = indices.sort(dim=1).values
        ok = ok & (s[:, 1:] != s[:, :-1]).all()
    return ok


def check_permute_data(
    validate: bool | str,
    routing_map: torch.Tensor | None,
    indices: torch.Tensor | None,
    num_experts: int,
    num_out_tokens: int,
    drop_and_pad: bool,
) -> None:
    """The data checks of permute in plain PyTorch (reference backend, or ``"sync"``)."""
    mode = validation_mode(validate)
    if mode == "off":
        return
    if indices is not None:
        if not data_checks_enabled(True, indices):
            return
        if mode == "sync":
            check_indices_sync(indices, num_experts)
        else:
            check_values(indices_valid(indices, num_experts), indices_message(num_experts),
                         validate=mode, tensors=(indices,))
        return  # distinct in-range indices route exactly T * k pairs (checked statically)
    if drop_and_pad or not data_checks_enabled(True, routing_map):
        return
    if mode == "sync":
        routed = int(routing_map.sum())
        if routed != num_out_tokens:
            raise ValueError(
                f"num_out_tokens={num_out_tokens} but routing_map routes {routed} "
                "(token, expert) pairs; they must be equal without drop_and_pad"
            )
        return
    check_values(routing_map.sum() == num_out_tokens,
                 count_message(num_out_tokens, "routing_map"), validate=mode,
                 tensors=(routing_map,))


def resolve_routing(
    tokens_shape: Sequence[int],
    device: torch.device,
    routing_map: torch.Tensor | None,
    indices: torch.Tensor | None,
    probs: torch.Tensor | None,
    num_experts: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None, int]:
    """Check routing_map / indices / probs (shapes, dtypes, devices); return ``(routing_map,
    indices, k, E)``: one of the two routings, ``k`` the row width of ``indices`` (None for a
    routing map) and the number of experts."""
    num_tokens = tokens_shape[0]
    if (routing_map is None) == (indices is None):
        raise ValueError("pass exactly one of routing_map=[T, E] bool or indices=[T, k]")
    if probs is not None:
        check_tensor("probs", probs, ndim=2, dtypes=_FLOAT_DTYPES, device=device)
        if probs.shape[0] != num_tokens:
            raise ValueError(
                f"probs must be [T, E] with T={num_tokens} (tokens' rows), got {tuple(probs.shape)}"
            )
    if routing_map is not None:
        check_tensor("routing_map", routing_map, ndim=2, dtypes=(torch.bool,), device=device)
        if routing_map.shape[0] != num_tokens:
            raise ValueError(
                f"routing_map must be [T, E] with T={num_tokens} (tokens' rows), got "
                f"{tuple(routing_map.shape)}"
            )
        if probs is not None and probs.shape != routing_map.shape:
            raise ValueError(
                f"probs must have routing_map's shape {tuple(routing_map.shape)}, got "
                f"{tuple(probs.shape)}"
            )
        if num_experts is not None and num_experts != routing_map.shape[1]:
            raise ValueError(
                f"num_experts={num_experts} but routing_map has {routing_map.shape[1]} columns"
            )
        return routing_map, None, None, routing_map.shape[1]
    check_tensor("indices", indices, ndim=2, dtypes=_INDEX_DTYPES, device=device)
    if indices.shape[0] != num_tokens:
        raise ValueError(
            f"indices must be [T, k] with T={num_tokens} (tokens' rows), got "
            f"{tuple(indices.shape)}"
        )
    if num_experts is None:
        if probs is None:
            raise ValueError("indices= needs num_experts= (or probs=[T, E]) to know E")
        num_experts = probs.shape[1]
    check_int("num_experts", num_experts, 1)
    if probs is not None and probs.shape[1] != num_experts:
        raise ValueError(
            f"probs must be [T, E] with E={num_experts}, got {tuple(probs.shape)}"
        )
    if indices.shape[1] > num_experts:
        raise ValueError(
            f"indices has k={indices.shape[1]} columns but there are only {num_experts} experts"
        )
    return None, indices, indices.shape[1], num_experts


def resolve_sizes(
    num_tokens: int,
    num_experts: int,
    routing_map: torch.Tensor | None,
    topk: int | None,
    num_out_tokens: int | None,
    drop_and_pad: bool,
    capacity: int | None,
    validate: bool | str,
) -> tuple[int, int | None]:
    """The static row count ``N`` and capacity, checked against the routing's shape."""
    if num_out_tokens is not None:
        check_int("num_out_tokens", num_out_tokens)
    if drop_and_pad:
        if capacity is None:
            if num_out_tokens is None:
                raise ValueError("drop_and_pad=True needs capacity= (or num_out_tokens=E*capacity)")
            if num_experts == 0 or num_out_tokens % num_experts:
                raise ValueError(
                    f"drop_and_pad: num_out_tokens={num_out_tokens} must be a multiple of the "
                    f"number of experts {num_experts} (it is E * capacity)"
                )
            capacity = num_out_tokens // num_experts
        check_int("capacity", capacity)
        if num_out_tokens is not None and num_out_tokens != num_experts * capacity:
            raise ValueError(
                f"drop_and_pad: num_out_tokens={num_out_tokens} must equal E * capacity = "
                f"{num_experts} * {capacity}"
            )
        return num_experts * capacity, capacity
    if capacity is not None:
        raise ValueError("capacity= is only used with drop_and_pad=True")
    if num_out_tokens is None:
        if topk is not None:
            return num_tokens * topk, None
        if data_checks_enabled(True, routing_map):
            # Only here does the shape depend on the data: one host sync, not graph-safe.
            num_out_tokens = int(routing_map.sum())
            logger.debug("permute: num_out_tokens=None, counted %d routed pairs", num_out_tokens)
            return num_out_tokens, None
        raise ValueError(
            "permute: num_out_tokens must be given while tracing or capturing (the output "
            "shape cannot depend on the routing); for top-k routing it is T * k"
        )
    checked = validation_mode(validate) != "off"
    if topk is not None and num_out_tokens != num_tokens * topk and checked:
        raise ValueError(
            f"num_out_tokens={num_out_tokens} but indices route T * k = {num_tokens * topk} "
            "(token, expert) pairs; they must be equal without drop_and_pad"
        )
    return num_out_tokens, None


def check_token_map(tm, num_tokens: int, num_experts: int | None, drop_and_pad: bool) -> None:
    """Shape checks of a ``token_map`` handed to :func:`unpermute` (free)."""
    if not isinstance(tm, TokenMap):
        raise TypeError(f"token_map must be a TokenMap or None, got {type(tm).__name__}")
    if tm.num_tokens != num_tokens:
        raise ValueError(
            f"token_map describes {tm.num_tokens} tokens but restore_shape has {num_tokens}"
        )
    if num_experts is not None and num_experts != tm.num_experts:
        raise ValueError(
            f"token_map was built for {tm.num_experts} experts but probs has {num_experts}"
        )
    if drop_and_pad and not tm.drop_and_pad:
        raise ValueError("token_map was built without drop_and_pad")


def check_row_map(
    validate: bool | str,
    row_id_map: torch.Tensor,
    num_tokens: int,
    pair: torch.Tensor | None,
    routing_map: torch.Tensor | None,
) -> None:
    """Data-dependent checks of unpermute's row map (see :func:`mtp.utils.check_values`)."""
    mode = validation_mode(validate)
    if mode == "off" or row_id_map.numel() == 0 or not data_checks_enabled(True, row_id_map):
        return
    in_range = (row_id_map >= -1) & (row_id_map < num_tokens)
    unrouted = None
    if pair is not None and routing_map is not None:
        routed = torch.cat([routing_map.reshape(-1), routing_map.new_zeros(1)])[pair]
        unrouted = (row_id_map >= 0) & ~routed
    if mode == "sync":
        stats = [row_id_map.min().to(torch.int64), row_id_map.max().to(torch.int64)]
        if unrouted is not None:
            stats.append(unrouted.sum())
        lo, hi, *bad = torch.stack(stats).tolist()
        if lo < -1 or hi >= num_tokens:
            raise ValueError(
                f"row_id_map must hold token numbers in [0, {num_tokens}) or -1, got values in "
                f"[{lo}, {hi}]"
            )
        if bad and bad[0]:
            raise ValueError(
                f"row_id_map does not match routing_map: {bad[0]} rows hold a token that "
                "routing_map does not send to that row's expert"
            )
        return
    check_values(in_range.all(),
                 f"row_id_map must hold token numbers in [0, {num_tokens}) or -1",
                 validate=mode, tensors=(row_id_map,))
    if unrouted is not None:
        check_values(~unrouted.any(),
                     "row_id_map does not match routing_map: some rows hold a token that "
                     "routing_map does not send to that row's expert",
                     validate=mode, tensors=(row_id_map, routing_map))


def check_unpermute_args(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None,
    routing_map: torch.Tensor | None,
    indices: torch.Tensor | None,
    drop_and_pad: bool,
) -> tuple[int, int | None, torch.Tensor | None, torch.Tensor | None]:
    """Shape, dtype and device checks of :func:`mtp.ops.unpermute` (free); returns ``(T, E or
    None, routing_map, indices)``, the routings checked (without ``probs`` only their shapes:
    they bound the rows a token may have)."""
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
    if probs is None:
        for name, routing, dtypes in (("routing_map", routing_map, (torch.bool,)),
                                      ("indices", indices, _INDEX_DTYPES)):
            if routing is not None:
                check_tensor(name, routing, ndim=2, dtypes=dtypes, device=device)
                if routing.shape[0] != num_tokens:
                    raise ValueError(
                        f"{name} must have T={num_tokens} rows (restore_shape), got "
                        f"{tuple(routing.shape)}"
                    )
        return num_tokens, None, routing_map, indices
    check_tensor("probs", probs, ndim=2, dtypes=_FLOAT_DTYPES, device=device)
    if probs.shape[0] != num_tokens:
        raise ValueError(
            f"probs must be [T, E] with T={num_tokens} (restore_shape), got {tuple(probs.shape)}"
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
    return num_tokens, experts, routing_map, indices


def inversion(
    num_rows: int,
    num_tokens: int,
    experts: int | None,
    routing_map: torch.Tensor | None,
    indices: torch.Tensor | None,
    drop_and_pad: bool,
) -> tuple[int, int, int, int, bool, str] | None:
    """How a Triton unpermute without a token map inverts its row map (see
    :mod:`mtp.ops.moe_permute.invert`): ``(routing (0: none, 1: routing_map, 2: indices), E,
    W, capacity (-1: dropless), experts needed, message of the device check)``, or None when
    nothing bounds the rows of a token (no probs and no routing: the sort path)."""
    route = 1 if routing_map is not None else (2 if indices is not None else 0)
    width = (routing_map.shape[1] if route == 1 else indices.shape[1]) if route else experts
    if width is None:
        return None
    what = [f"row_id_map must hold token numbers in [0, {num_tokens}) or -1, at most {width} "
            "per token"]
    if experts is None:
        return 0, width, width, -1, False, _device_message(what)
    capacity = num_rows // experts if drop_and_pad else -1
    if route:
        what.append("row_id_map does not match routing_map (or indices) where a row holds a "
                    "token not routed to that row's expert")
    if route == 2:
        what.append(indices_message(experts))
    return route, experts, width, capacity, True, _device_message(what)


def _device_message(what: list[str]) -> str:
    return "unpermute: " + "; ".join(what) + " (validate='sync' reports the values)"
