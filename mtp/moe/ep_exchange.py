"""The expert-parallel exchanges of :class:`~mtp.moe.AllToAllTokenDispatcher`.

Dropless: the split sizes read on the host (the layer's one sync, with the ranks' metadata
check), the token and probability all-to-alls, and the source-major -> expert-major reorder of
the received rows. Capacity (:func:`check_static`, :func:`dispatch_static`): the fixed-size
all-to-alls and all-gathers, reordered by views; :func:`static_received` leaves the received
rows as they arrived and returns the (static) order of the views instead.

:func:`exchange_rows` leaves the received buffer as it arrived (source-rank-major) and returns
the reorder index ``order`` (expert-major row ``j`` is received row ``order[j]``): the
dispatcher's :meth:`~mtp.moe.AllToAllTokenDispatcher.dispatch` gathers the rows through it (a
copy), while fused Triton experts read them through it in fc1 (``grouped_mlp(...,
gather_index=order, token_map=received_token_map(inverse))``, see :mod:`mtp.moe.gathered`).
"""

from __future__ import annotations

import dataclasses

import torch

from mtp.moe.comm import SAME_TOKENS_HINT, all_to_all, gather_v, rank_meta
from mtp.moe.dispatcher_base import AllToAllDispatchMetadata
from mtp.moe.preprocess import _recv_reorder
from mtp.ops.moe_permute import TokenMap
from mtp.parallel.agree import group_ranks
from mtp.parallel.groups import group_description
from mtp.utils import is_fake

__all__ = [
    "check_static",
    "dispatch_static",
    "exchange_rows",
    "read_sizes",
    "received_map",
    "received_token_map",
    "static_received",
    "unit_rows",
]


def read_sizes(dispatcher, res, spec, ep_rows, etp_counts, etp_rows) -> dict:
    """The one device-to-host copy of a dropless dispatch: ``{"send", "recv"}`` (``P > 1``)
    and ``"etp_sizes"`` (``Q > 1``) as host lists; the ranks' metadata rows (``ep_rows`` /
    ``etp_rows``, None when unchecked) are checked against ``spec`` on the way."""
    ep, q = dispatcher.ep_size, dispatcher.etp_size
    parts = []
    if ep > 1:
        parts += [res.send_counts, res.recv_counts.sum(dim=1)]
    if etp_counts is not None:
        parts.append(etp_counts.sum(dim=1))
    for m in (ep_rows, etp_rows):
        if m is not None:
            parts.append(m.reshape(-1))
    flat = torch.cat(parts).tolist()
    host, i = {}, 0
    if ep > 1:
        host["send"], host["recv"] = flat[:ep], flat[ep : 2 * ep]
        i = 2 * ep
    if etp_counts is not None:
        host["etp_sizes"] = flat[i : i + q]
        i += q
    groups = ((ep_rows, ep, dispatcher.ep_group), (etp_rows, q, dispatcher.etp_group))
    for m, size, group in groups:
        if m is not None:
            width = m.shape[1]
            rows = [flat[i + r * width : i + (r + 1) * width] for r in range(size)]
            i += size * width
            # dropless: the token counts may differ; the rest must not
            spec.check_rows(rows, group_ranks(group, size), where=group_description(group),
                            skip=("token count",))  # fmt: skip
    return host


def exchange_rows(ep_group, permuted: torch.Tensor, meta: AllToAllDispatchMetadata, host: dict):
    """``(recv [R, H], recv_probs [R], order [R], meta)``: the all-to-alls of the rows and their
    probabilities (``R`` received rows, source-rank-major) and the expert-major order of the
    received rows; ``meta`` gains the split sizes and ``recv_inverse`` (the expert-major row of
    each received row) for the combine."""
    res = meta.preprocess
    send, recv_sizes = host["send"], host["recv"]
    received = sum(recv_sizes)
    recv = all_to_all(permuted, ep_group, recv_sizes, send)
    recv_probs = all_to_all(res.permuted_probs, ep_group, recv_sizes, send)
    order, inverse = res.recv_order[:received], res.recv_inverse[:received]
    if received > res.recv_order.shape[0]:
        # Another rank routed more tokens than this one (the workspace's worst case assumes
        # at most T per rank): reorder for the actual count, now known on the host.
        order, inverse = _recv_reorder(res.recv_counts, received)
    meta = dataclasses.replace(meta, send_sizes=send, recv_sizes=recv_sizes,
                               recv_inverse=inverse)  # fmt: skip
    return recv, recv_probs, order, meta


def received_token_map(inverse: torch.Tensor, units: torch.Tensor | None = None) -> TokenMap:
    """The :class:`~mtp.ops.moe_permute.TokenMap` of the received rows read through their
    expert-major ``order``: received row ``i`` is expert-major row ``inverse[i]`` alone (a
    permutation: one row per source row, its probability in column 0 of a ``[R]``), so the
    gathered fc1's data gradient of the received buffer is a plain row gather, no sum.
    ``units``: an int32 ``[2, >= R]`` of zeros then ones to slice (see :func:`unit_rows`),
    else made here."""
    rows = inverse.to(torch.int32).view(-1, 1)
    n = rows.shape[0]
    if units is None or units.shape[1] < n:
        units = unit_rows(n, rows.device)
    return TokenMap(rows, units[0, :n].view(n, 1), units[1, :n], 1, False)


def unit_rows(n: int, device: torch.device) -> torch.Tensor:
    """int32 ``[2, n]``: a row of zeros (the experts' column of a one-to-one map), a row of
    ones (its counts)."""
    return torch.arange(2, dtype=torch.int32, device=device).view(2, 1).expand(2, n).contiguous()


def received_map(dispatcher, meta: AllToAllDispatchMetadata) -> TokenMap:
    """:func:`received_token_map` of ``meta``'s received rows, its constant columns cut from
    ``dispatcher._units`` (kept for the workspace's worst case, regrown when exceeded)."""
    inverse = meta.recv_inverse
    if is_fake(inverse):
        return received_token_map(inverse)
    units, n = dispatcher._units, max(inverse.shape[0], meta.workspace.max_recv_rows)
    if units is None or units.shape[1] < n or units.device != inverse.device:
        units = dispatcher._units = unit_rows(n, inverse.device)
    return received_token_map(inverse, units)


def check_static(dispatcher, hidden_states, probs, num_tokens: int) -> None:
    """Capacity mode: one tiny exchange of the metadata before the fixed-size all-to-alls."""
    if not dispatcher.should_check_ranks(hidden_states):
        return
    spec = rank_meta(hidden_states, probs, num_tokens)
    row = spec.tensor(hidden_states.device)
    for group, size, _ in dispatcher.groups():
        rows = all_to_all(row.view(1, -1).expand(size, -1).contiguous(), group)
        spec.check_device(rows, group, validate=True, hint=SAME_TOKENS_HINT)


def dispatch_static(dispatcher, permuted, meta: AllToAllDispatchMetadata):
    """Capacity mode's ``(tokens, tokens_per_expert, probs, meta)``: the fixed-size exchanges
    (``P > 1``: all-to-all; ``Q > 1``: all-gather), reordered expert-major by views."""
    d = dispatcher
    res, local, cap = meta.preprocess, d.num_local_experts, meta.workspace.capacity
    tokens, probs, counts = permuted, res.permuted_probs, res.tokens_per_expert
    rows = cap
    if d.ep_size > 1:
        ep = d.ep_size
        recv = all_to_all(permuted, d.ep_group)
        recv_probs = all_to_all(res.permuted_probs, d.ep_group)
        tokens = recv.view(ep, local, cap, -1).transpose(0, 1).reshape(local * ep * cap, -1)
        probs = recv_probs.view(ep, local, cap).transpose(0, 1).reshape(-1)
        counts, rows = res.local_tokens_per_expert, ep * cap
    if d.etp_size > 1:
        q = d.etp_size
        n = tokens.shape[0]
        tokens = gather_v(tokens, d.etp_group, [n] * q, d.etp_rank)
        probs = gather_v(probs, d.etp_group, [n] * q, d.etp_rank)
        tokens = tokens.view(q, local, rows, -1).transpose(0, 1).reshape(q * n, -1)
        probs = probs.view(q, local, rows).transpose(0, 1).reshape(-1)
        counts = torch.full_like(counts, q * rows)
        meta = dataclasses.replace(meta, etp_rows=rows)
    return tokens, counts, probs, meta


def static_received(dispatcher, permuted, meta: AllToAllDispatchMetadata):
    """Capacity mode, ``P > 1``, ``Q == 1``: ``(recv, tokens_per_expert, recv_probs, order,
    token_map, meta)``, the all-to-alls of :func:`dispatch_static` without its reorder copies
    (``order``: the received row of each expert-major row, the reorder of its views as an index;
    ``token_map``: that permutation's one-to-one map)."""
    d, res = dispatcher, meta.preprocess
    recv = all_to_all(permuted, d.ep_group)
    recv_probs = all_to_all(res.permuted_probs, d.ep_group)
    order, token_map = _static_maps(d, meta.workspace.capacity, recv.device, is_fake(recv))
    return recv, res.local_tokens_per_expert, recv_probs, order, token_map, meta


def _static_maps(dispatcher, cap: int, device, fake: bool):
    """``(order, token_map)`` of the capacity exchange's reorder (static: kept on the
    dispatcher for its sizes)."""
    ep, local = dispatcher.ep_size, dispatcher.num_local_experts
    key = (ep, local, cap, device)
    kept = None if fake else dispatcher._static_maps
    if kept is not None and kept[0] == key:
        return kept[1:]
    idx = torch.arange(ep * local * cap, device=device)
    order = idx.view(ep, local, cap).transpose(0, 1).reshape(-1)
    inverse = idx.view(local, ep, cap).transpose(0, 1).reshape(-1)
    maps = (order, received_token_map(inverse))
    if not fake:
        dispatcher._static_maps = (key, *maps)
    return maps
