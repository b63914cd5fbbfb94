"""Graph-safe MoE preprocess: everything the dispatch needs, computed on the device into a
:class:`~mtp.moe.MoEWorkspace`.

:func:`preprocess` turns a routing (``routing_map [T, E]``, ``probs [T, E]``) into

- ``tokens_per_expert [E]`` (rows per expert of the permuted layout),
- the permutation row map ``row_id_map [N]`` (Megatron's ``sorted_indices``, built by
  :func:`mtp.ops.moe_permute.moe_permute_row_map`: expert-major rows, ascending token within
  an expert; with a capacity each expert owns ``C`` slots and keeps its first ``C`` tokens in
  token order, unused slots hold ``-1``),
- the permuted probabilities ``permuted_probs [N]``,
- with expert parallelism (``P`` ranks): the rows sent to each rank ``send_counts [P]``, the
  rows received per (source rank, local expert) ``recv_counts [P, L]`` (exchanged by a device
  all-to-all of the counts: no host sync), their sum per local expert, and the index pair that
  reorders the received rows from source-major to expert-major (``recv_order``,
  ``recv_inverse``, of static length ``R = P * T * min(k, L)``: the worst case when no rank
  routes more than ``T`` tokens; with ragged token counts over the ranks, only the first ``R``
  received rows are covered and the dispatcher recomputes the pair for the actual count after
  its host sync). With a capacity the split is static (``L * C`` rows per rank) and no count is
  exchanged.

Every shape is static (``N = T * k`` dropless, ``E * C`` with a capacity) and nothing is read on
the host, so :func:`preprocess` passes :func:`mtp.testing.assert_graph_safe`; its outputs are
the workspace's buffers, whose addresses never change.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.utils._pytree

from mtp.moe.workspace import MoEWorkspace
from mtp.ops.moe_permute import TokenMap, moe_permute_row_map, select_probs
from mtp.utils import check_tensor, data_checks_enabled, is_fake

__all__ = ["MoEPreprocessResult", "preprocess"]

from mtp.dtypes import FLOATS as _FLOAT_DTYPES  # noqa: E402


@dataclasses.dataclass
class MoEPreprocessResult:
    """The preprocess outputs (see the module docstring); the EP fields are None when ``P == 1``
    (and ``recv_order``/``recv_inverse`` with a capacity)."""

    tokens_per_expert: torch.Tensor
    row_id_map: torch.Tensor
    permuted_probs: torch.Tensor | None
    probs_index: torch.Tensor | None
    send_counts: torch.Tensor | None = None
    recv_counts: torch.Tensor | None = None
    local_tokens_per_expert: torch.Tensor | None = None
    recv_order: torch.Tensor | None = None
    recv_inverse: torch.Tensor | None = None


# Field names as a constant: torch.compile cannot trace dataclasses.fields() of the class.
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(MoEPreprocessResult))

# Let torch.utils._pytree (assert_graph_safe, torch.compile) see the tensors inside.
_register_dataclass = getattr(torch.utils._pytree, "register_dataclass", None)
if _register_dataclass is not None:
    _register_dataclass(MoEPreprocessResult)


def _recv_reorder(recv_counts: torch.Tensor, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source-major -> expert-major reorder of the received rows, static length ``max_rows``.

    The all-to-all delivers rank ``r``'s rows for local expert ``l`` as chunk ``(r, l)`` in
    source-major order; the experts want chunk ``(l, r)`` order. Returns ``(order, inverse)``:
    ``order[j]`` is the received row that becomes expert-major row ``j`` and ``inverse[i]`` the
    expert-major row of received row ``i`` (``-1`` past the received rows).
    """
    ranks, local = recv_counts.shape
    device = recv_counts.device
    flat_src = recv_counts.reshape(-1)
    src_start = (torch.cumsum(flat_src, 0) - flat_src).view(ranks, local)
    by_expert = recv_counts.t().reshape(-1)  # chunk q = l * ranks + r
    ends = torch.cumsum(by_expert, 0)
    starts = ends - by_expert
    j = torch.arange(max_rows, device=device, dtype=torch.int64)
    chunk = torch.searchsorted(ends, j, right=True)
    valid = chunk < ranks * local
    chunk = chunk.clamp(max=ranks * local - 1)
    expert, rank = chunk // ranks, chunk % ranks
    row = src_start[rank, expert] + (j - starts[chunk])
    order = torch.where(valid, row, -1)
    inverse = torch.full((max_rows + 1,), -1, device=device, dtype=torch.int64)
    inverse.scatter_(0, torch.where(valid, row, max_rows), torch.where(valid, j, -1))
    return order, inverse[:max_rows]


def local_preprocess(
    routing_map: torch.Tensor, probs: torch.Tensor, workspace: MoEWorkspace
) -> MoEPreprocessResult:
    """The rank-local part (no communication): counts, row map, permuted probs and, with
    ``P > 1``, the rows sent to each rank. Pure function of its inputs (fresh tensors)."""
    return local_preprocess_with_map(routing_map, probs, workspace)[0]


def local_preprocess_with_map(
    routing_map: torch.Tensor, probs: torch.Tensor, workspace: MoEWorkspace,
    backend: str = "auto", fused: bool = False,
) -> tuple[MoEPreprocessResult, TokenMap | None]:
    """:func:`local_preprocess` and the token-major map of its row map (None on the reference
    backend), for :func:`mtp.ops.unpermute`'s ``token_map``; ``backend``: the row map's.

    ``fused`` (Triton row map, ``P = 1``): for experts that read their rows and probabilities
    through the row map (:func:`mtp.ops.grouped_mlp`'s ``gather_index``): the counts come from
    the row map's own launch, the token map is ``topk`` wide, and neither the probability
    index nor the permuted probabilities are made (``permuted_probs`` and ``probs_index`` are
    None)."""
    lay = workspace.layout
    num_experts, capacity = lay.num_experts, lay.capacity
    drop = capacity is not None
    if fused:
        row_map = moe_permute_row_map(
            routing_map, lay.num_rows, drop_and_pad=drop, capacity=capacity, backend=backend,
            token_map=True, width=lay.topk, pair=False,
        )  # fmt: skip
        if row_map.token_map is not None:
            result = MoEPreprocessResult(row_map.tokens_per_expert, row_map.row_id_map, None, None)
            return result, row_map.token_map
    device = routing_map.device
    if capacity is None:
        tokens_per_expert = routing_map.sum(dim=0, dtype=torch.int64)
    else:
        tokens_per_expert = torch.full((num_experts,), capacity, dtype=torch.int64, device=device)
    row_map = moe_permute_row_map(
        routing_map, lay.num_rows, drop_and_pad=drop, capacity=capacity, backend=backend,
        token_map=True,
    )  # fmt: skip
    row_id_map, pair = row_map.row_id_map, row_map.pair
    result = MoEPreprocessResult(tokens_per_expert, row_id_map, select_probs(probs, pair), pair)
    if lay.ep_size > 1 and capacity is not None:
        result.send_counts = workspace.send_counts
        result.recv_counts = workspace.recv_counts
        result.local_tokens_per_expert = workspace.local_tokens_per_expert
    elif lay.ep_size > 1:
        result.send_counts = tokens_per_expert.view(lay.ep_size, -1).sum(dim=1)
    return result, row_map.token_map


def exchange_counts(
    tokens_per_expert: torch.Tensor,
    ep_size: int,
    ep_group: dist.ProcessGroup | None,
    meta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Device all-to-all of the per-expert counts ``[E]`` over the EP group: returns
    ``recv_counts [P, L]`` and, when ``meta [m]`` (int64 metadata, e.g. token count and dtype
    codes) is given, every rank's ``meta`` as ``[P, m]`` (it rides in the same exchange)."""
    counts = tokens_per_expert.view(ep_size, -1)
    local = counts.shape[1]
    if meta is not None:
        counts = torch.cat([counts, meta.view(1, -1).expand(ep_size, -1)], dim=1)
    send = counts.contiguous().view(-1)
    recv = torch.empty_like(send)
    if not is_fake(send):
        dist.all_to_all_single(recv, send, group=ep_group)
    recv = recv.view(ep_size, -1)
    return recv[:, :local], (None if meta is None else recv[:, local:])


def finish_ep_preprocess(
    result: MoEPreprocessResult, recv_counts: torch.Tensor, workspace: MoEWorkspace
) -> MoEPreprocessResult:
    """Dropless ``P > 1``: the received counts and the source-major -> expert-major reorder."""
    result.recv_counts = recv_counts
    result.local_tokens_per_expert = recv_counts.sum(dim=0)
    result.recv_order, result.recv_inverse = _recv_reorder(
        recv_counts, workspace.layout.max_recv_rows
    )
    return result


def compute_preprocess(
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    workspace: MoEWorkspace,
    ep_group: dist.ProcessGroup | None = None,
) -> MoEPreprocessResult:
    """The preprocess into fresh tensors (``permuted_probs`` differentiable in ``probs``); no
    checks. :func:`preprocess` copies the result into the workspace."""
    lay = workspace.layout
    result = local_preprocess(routing_map, probs, workspace)
    if lay.ep_size == 1 or lay.capacity is not None:
        return result
    recv, _ = exchange_counts(result.tokens_per_expert, lay.ep_size, ep_group)
    return finish_ep_preprocess(result, recv, workspace)


def store_preprocess(
    result: MoEPreprocessResult, workspace: MoEWorkspace, fields: tuple[str, ...] = _RESULT_FIELDS
) -> MoEPreprocessResult:
    """Copy ``result``'s ``fields`` (default: all) into the workspace; returns the workspace's
    views (fixed addresses; None for the fields not copied)."""
    stored = dict.fromkeys(_RESULT_FIELDS)
    with torch.no_grad():
        for name in fields:
            value = getattr(result, name)
            buf = getattr(workspace, name) if value is not None else None
            if buf is not None and value is not buf:
                buf.copy_(value)
            stored[name] = buf
    return MoEPreprocessResult(**stored)


def resolve_ep_group(workspace: MoEWorkspace, ep_group: dist.ProcessGroup | None):
    """The group of the counts all-to-all: ``ep_group``, else mtp.parallel's expert group."""
    if workspace.ep_size == 1:
        return None
    if ep_group is None:
        from mtp.parallel import get_expert_model_parallel_group

        ep_group = get_expert_model_parallel_group()
    size = dist.get_world_size(ep_group)
    if size != workspace.ep_size:
        raise ValueError(
            f"ep_group has {size} ranks but the workspace was built for ep_size={workspace.ep_size}"
        )
    return ep_group


def check_routing(
    routing_map: torch.Tensor, probs: torch.Tensor, workspace: MoEWorkspace, validate: bool
) -> None:
    """Shape/dtype/device checks (always) and, with ``validate``, the dropless count check."""
    check_tensor("routing_map", routing_map, ndim=2, dtypes=(torch.bool,))
    check_tensor("probs", probs, ndim=2, dtypes=_FLOAT_DTYPES, device=routing_map.device)
    if probs.shape != routing_map.shape:
        raise ValueError(
            f"probs must have routing_map's shape {tuple(routing_map.shape)}, got "
            f"{tuple(probs.shape)}"
        )
    workspace.check(
        "routing_map",
        routing_map.shape[0],
        num_experts=routing_map.shape[1],
        device=routing_map.device,
    )
    if probs.dtype != workspace.probs_dtype:
        raise TypeError(
            f"probs has dtype {probs.dtype} but the workspace was built for probs_dtype="
            f"{workspace.probs_dtype}"
        )
    if (
        workspace.capacity is None
        and routing_map.numel()
        and data_checks_enabled(validate, routing_map)
    ):
        per_token = routing_map.sum(dim=1)
        lo, hi = torch.stack([per_token.min(), per_token.max()]).tolist()
        if lo != workspace.topk or hi != workspace.topk:
            raise ValueError(
                f"dropless routing needs exactly topk={workspace.topk} experts per token in "
                f"routing_map, got between {lo} and {hi} (use a capacity_factor to drop tokens)"
            )


def preprocess(
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    workspace: MoEWorkspace,
    *,
    ep_group: dist.ProcessGroup | None = None,
    validate: bool = True,
) -> MoEPreprocessResult:
    """Compute the MoE dispatch metadata into ``workspace`` (graph-safe, no host sync).

    Args:
        routing_map: ``[T, E]`` bool (``T`` = ``workspace.num_tokens``). Dropless: exactly
            ``topk`` experts per token. With a capacity: any routing; each expert keeps its first
            ``C`` tokens in token order (the router normally drops down to ``C`` already).
        probs: ``[T, E]`` float routing probabilities.
        workspace: built for these sizes (a mismatch raises
            :class:`~mtp.moe.workspace.WorkspaceMismatchError`).
        ep_group: the expert-parallel group when ``workspace.ep_size > 1`` (default: the
            ``mtp.parallel`` expert group); the counts are exchanged over it on the device.
        validate: check the dropless per-token count (one host sync); skipped while tracing or
            capturing.

    Returns:
        A :class:`MoEPreprocessResult` whose tensors are the workspace's buffers.
    """
    if not isinstance(workspace, MoEWorkspace):
        raise TypeError(f"workspace must be a MoEWorkspace, got {type(workspace).__name__}")
    check_routing(routing_map, probs, workspace, validate)
    group = resolve_ep_group(workspace, ep_group)
    with torch.no_grad():
        result = compute_preprocess(routing_map, probs, workspace, group)
    return store_preprocess(result, workspace)
