"""Expert-parallel token dispatch and combine: :class:`AllToAllTokenDispatcher`.

``dispatch(hidden_states [T, H], probs [T, E], routing_map [T, E])`` returns the rows this rank's
experts must process, grouped by local expert, with their counts and probabilities;
``combine(expert_output)`` brings the results back and sums them per token. The dispatcher owns
the whole flow; the preprocess pieces it calls (:mod:`mtp.moe.preprocess`) are functions of the
routing and the workspace, and the workspace only holds the fixed buffers.

Steps (``P`` expert-parallel ranks, ``L = E / P`` local experts, ``Q`` expert-tensor-parallel
ranks):

1. :func:`~mtp.moe.preprocess.local_preprocess` (counts, row map, permuted probs), copied into
   the :class:`~mtp.moe.MoEWorkspace` while a CUDA graph is captured (eager calls keep the
   fresh tensors: the copies would only cost launches); dropless ``P > 1``: a device
   all-to-all of the per-expert counts, which also carries each rank's token count, hidden
   size and dtypes.
2. Permute: gather the token rows in expert-major order.
3. ``P > 1``: ``all_to_all_single`` of the rows and of their probabilities, then reorder the
   received rows from source-major to expert-major (:mod:`mtp.moe.ep_exchange`; fused Triton
   experts skip this and the combine's reorder: :meth:`dispatch_received`).
4. ``Q > 1``: all-gather the rows (and probabilities) of the ``Q`` ranks sharing the experts
   (each holds ``F / Q`` of their features) and reorder them expert-major again.
5. ``combine``: the inverse of each step (the expert-TP partial outputs are reduce-scattered),
   then :func:`mtp.ops.unpermute` (a deterministic per-token sum of the expert outputs).

``dispatch()`` returns the rows with an :class:`AllToAllDispatchMetadata` (frozen: the
workspace, the preprocess tensors, the split sizes and reorders the exchange used) that
``combine()`` takes back; nothing of one call is kept on the dispatcher. ``dispatch()`` is
``token_dispatch(*dispatch_preprocess(...))``: the local part of step 1 and step 2 (no
communication or host sync: graph-safe for every ``P``), then the rest.

Host synchronisation:

- ``P == Q == 1``, or any ``P``/``Q`` with ``capacity_factor``: none (every split size is known
  in advance; graph-safe). The rank-agreement check of a capacity dispatch (see
  ``check_ranks``) is a tiny all-to-all and a device-side assert, no host sync.
- Dropless ``P > 1`` or ``Q > 1``: exactly **one** device-to-host copy per layer, of the split
  sizes (and the ranks' metadata, checked there: a :class:`RankMismatchError` on every rank when
  they disagree), placed right before the token all-to-all (after the permutation is queued, as
  late as possible, like Megatron-Core's ``before_ep_alltoall`` sync point). The backward
  reuses the sizes (no sync there).

Collectives per forward on the EP group (``all_to_all_single``): dropless 4 (counts + metadata,
tokens, probs, combine), capacity 3 (+1 tiny one on the first dispatch), none for ``P == 1``;
with ``Q > 1`` three more on the expert-TP group (counts, tokens, probs; capacity: two) and one
in the combine. The backward runs one all-to-all per forward token/probs/combine exchange.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mtp.moe.comm import (  # noqa: F401 - all_to_all & co. re-exported
    SAME_TOKENS_HINT,
    all_to_all,
    gather_rows,
    gather_v,
    permute_backend,
    permute_rows,
    rank_meta,
    reduce_scatter_v,
)
from mtp.moe.dispatcher_base import AllToAllDispatchMetadata, TokenDispatcherBase
from mtp.moe.ep_exchange import (
    check_static,
    dispatch_static,
    exchange_rows,
    read_sizes,
    received_map,
    static_received,
)
from mtp.moe.preprocess import (
    _RESULT_FIELDS,
    MoEPreprocessResult,
    _recv_reorder,
    check_routing,
    exchange_counts,
    finish_ep_preprocess,
    local_preprocess_with_map,
    store_preprocess,
)
from mtp.moe.workspace import MoEWorkspace
from mtp.ops.moe_permute import TokenMap, unpermute
from mtp.parallel.errors import RankMismatchError
from mtp.utils import data_checks_enabled, is_capturing, is_fake

__all__ = [
    "AllToAllDispatchMetadata",
    "AllToAllTokenDispatcher",
    "RankMismatchError",
    "all_to_all",
    "gather_v",
    "reduce_scatter_v",
]

logger = logging.getLogger("mtp")

# What the dropless EP exchange adds to the local preprocess (stored into the workspace).
_EP_FIELDS = ("recv_counts", "local_tokens_per_expert", "recv_order", "recv_inverse")


class AllToAllTokenDispatcher(TokenDispatcherBase):
    """Dispatch tokens to experts over the expert-parallel group and combine the results.

    Construction (see :class:`~mtp.moe.dispatcher_base.TokenDispatcherBase`):
    ``AllToAllTokenDispatcher(config, dims)`` with a :class:`~mtp.moe.config.DispatcherConfig`
    and a :class:`~mtp.parallel.dims.ParallelDims`, or the flat
    ``AllToAllTokenDispatcher(ep_group, num_experts, topk, *, capacity_factor=None,
    backend="auto", etp_group=None, check_ranks=None)``.

    The fields (``num_experts``, ``topk``, ``capacity_factor``, ``backend``, ``check_ranks``)
    are described on :class:`~mtp.moe.config.DispatcherConfig`; ``ep_group`` is the
    expert-parallel group (``P`` ranks; None for ``P = 1``), ``etp_group`` the expert-tensor-
    parallel group (``Q`` ranks holding shards of the same experts, Megatron's expert-TP
    group): after the EP all-to-all the rows of the ``Q`` ranks are all-gathered so that each
    shard sees every row of its experts, and the partial outputs are reduce-scattered back in
    :meth:`combine` (Megatron-Core's order).

    The :class:`~mtp.moe.MoEWorkspace` is built on the first :meth:`dispatch` for its token
    count, dtype and device and rebuilt (with an INFO log line) when they change.
    Megatron-Core's method names work too: :meth:`token_permutation` and
    :meth:`token_unpermutation` (stateful, as Megatron's: the second uses the metadata of the
    last first).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workspace: MoEWorkspace | None = None
        self._megatron_metadata: AllToAllDispatchMetadata | None = None
        self._units: torch.Tensor | None = None  # see mtp.moe.ep_exchange.received_map
        self._static_maps: tuple | None = None  # see mtp.moe.ep_exchange.static_received

    # -- workspace ----------------------------------------------------------------------------

    def get_workspace(
        self,
        num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        probs_dtype: torch.dtype,
        device: torch.device,
    ) -> MoEWorkspace:
        """The workspace for these sizes: the current one, or a new one (logged)."""
        ws = self.workspace
        if (
            ws is not None
            and ws.matches(num_tokens, self.num_experts, hidden_size, dtype, device)
            and ws.probs_dtype == probs_dtype
        ):
            return ws
        new = self._new_workspace(num_tokens, hidden_size, dtype, probs_dtype, device)
        if ws is not None:
            logger.info(
                "MoE dispatcher: rebuilding the workspace for %d tokens (was %d): %s",
                num_tokens,
                ws.num_tokens,
                new,
            )
        self.workspace = new
        return new

    def _new_workspace(self, num_tokens, hidden_size, dtype, probs_dtype, device):
        return MoEWorkspace(
            num_tokens,
            hidden_size,
            self.num_experts,
            self.topk,
            ep_size=self.ep_size,
            capacity_factor=self.capacity_factor,
            dtype=dtype,
            probs_dtype=probs_dtype,
            device=device,
        )

    def _workspace_for(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> MoEWorkspace:
        args = (hidden_states.shape[0], hidden_states.shape[1], hidden_states.dtype, probs.dtype)
        if is_fake(hidden_states):
            # Tracing with fake tensors: a throwaway workspace (never keep fake buffers).
            return self._new_workspace(*args, hidden_states.device)
        return self.get_workspace(*args, device=hidden_states.device)

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllToAllDispatchMetadata]:
        """Send each routed (token, expert) row to the rank that holds the expert:
        :meth:`dispatch_preprocess` then :meth:`token_dispatch`.

        Args:
            hidden_states: ``[T, H]``.
            probs: ``[T, E]`` routing probabilities (differentiable).
            routing_map: ``[T, E]`` bool.

        Returns:
            ``(tokens [M, H], tokens_per_expert [L] int64 (device), permuted_probs [M],
            metadata)``: the rows of this rank's ``L`` experts, expert-major; ``M`` is
            ``T * topk`` (``P = 1``), ``L * P * C`` (capacity) or the received count (dropless
            ``P > 1``), times ``Q`` with expert tensor parallelism; ``metadata`` (an
            :class:`AllToAllDispatchMetadata`) goes to :meth:`combine`.
        """
        return self.token_dispatch(*self.dispatch_preprocess(hidden_states, probs, routing_map))

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllDispatchMetadata]:
        """The rank-local, graph-safe first half of :meth:`dispatch` (Megatron-Core's
        ``dispatch_preprocess``): :func:`~mtp.moe.preprocess.local_preprocess` (copied into the
        workspace while a CUDA graph is captured) and the permutation of the rows; no
        communication, no host sync.

        Returns ``(permuted_tokens [N, H], permuted_probs [N], metadata)`` (``N`` = ``T *
        topk``, or ``E * C`` with a capacity), differentiable in ``hidden_states`` and
        ``probs``; :meth:`token_dispatch` takes all three. The other tensors it and
        :meth:`combine` read are :meth:`preprocess_tensors`: a CUDA graph that stops here
        outputs them, and :meth:`restore_preprocess` makes the metadata of a replay's copies.
        """
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be [T, H], got {tuple(hidden_states.shape)}")
        if routing_map.dim() == 2 and routing_map.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"routing_map has {routing_map.shape[0]} rows but hidden_states has "
                f"{hidden_states.shape[0]} tokens"
            )
        ws = self._workspace_for(hidden_states, probs)
        check_routing(routing_map, probs, ws, validate=False)
        res, token_map = local_preprocess_with_map(routing_map, probs, ws)
        if is_capturing():  # a graph replays into the workspace's fixed addresses
            store_preprocess(res, ws)  # ``res`` keeps the autograd link
        meta = self._metadata(ws, res, *hidden_states.shape, hidden_states.device, token_map)
        permuted = permute_rows(hidden_states, res.row_id_map, meta.backend, token_map)
        return permuted, res.permuted_probs, meta

    def _metadata(self, ws, res, num_tokens, hidden, device, token_map):
        backend = permute_backend(self.backend, device)
        return AllToAllDispatchMetadata(ws, res, backend, num_tokens, hidden, token_map)

    @staticmethod
    def preprocess_tensors(metadata: AllToAllDispatchMetadata) -> dict[str, torch.Tensor]:
        """The preprocess tensors of ``metadata`` (besides the permuted tokens and
        probabilities) that :meth:`token_dispatch` and :meth:`combine` read, by
        :class:`~mtp.moe.preprocess.MoEPreprocessResult` field name, and the token map's
        (``token_rows``, ``token_experts``, ``token_count``) (Megatron-Core's
        ``cudagraph_attrs``)."""
        res, tm = metadata.preprocess, metadata.token_map
        out = {
            name: getattr(res, name)
            for name in _RESULT_FIELDS
            if name != "permuted_probs" and getattr(res, name) is not None
        }
        if tm is not None:
            out.update(token_rows=tm.rows, token_experts=tm.experts, token_count=tm.count)
        return out

    def restore_preprocess(
        self, num_tokens: int, permuted_tokens, permuted_probs, tensors
    ) -> AllToAllDispatchMetadata:
        """The metadata :meth:`dispatch_preprocess` returns, from tensors a replayed graph
        produced (``tensors`` as :meth:`preprocess_tensors` named them, for ``num_tokens``
        tokens), so that :meth:`token_dispatch` and :meth:`combine` can follow eagerly."""
        hidden, dev, dtype = permuted_tokens.shape[1], permuted_tokens.device, permuted_tokens.dtype
        ws = self.get_workspace(num_tokens, hidden, dtype, permuted_probs.dtype, dev)
        tensors = dict(tensors)
        parts = [tensors.pop(k, None) for k in ("token_rows", "token_experts", "token_count")]
        tm = None
        if parts[0] is not None:
            tm = TokenMap(*parts, self.num_experts, ws.capacity is not None)
        res = MoEPreprocessResult(permuted_probs=permuted_probs, **tensors)
        return self._metadata(ws, res, num_tokens, hidden, dev, tm)

    def token_dispatch(
        self,
        permuted_tokens: torch.Tensor,
        permuted_probs: torch.Tensor,
        metadata: AllToAllDispatchMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllToAllDispatchMetadata]:
        """The second half of :meth:`dispatch` (Megatron-Core's ``token_dispatch`` and
        ``dispatch_postprocess``): dropless ``P > 1``: the count exchange, its one host sync
        and the token all-to-all; with a capacity the fixed-size all-to-alls; then the
        expert-TP gather. Takes what :meth:`dispatch_preprocess` returned; returns what
        :meth:`dispatch` returns."""
        if not isinstance(metadata, AllToAllDispatchMetadata):
            raise TypeError(
                "token_dispatch() takes the metadata dispatch_preprocess() returned, got "
                f"{type(metadata).__name__}"
            )
        meta = metadata
        if permuted_probs is not metadata.preprocess.permuted_probs:  # probs changed in between
            res = dataclasses.replace(metadata.preprocess, permuted_probs=permuted_probs)
            meta = dataclasses.replace(metadata, preprocess=res)
        if meta.workspace.capacity is not None:
            check_static(self, permuted_tokens, permuted_probs, meta.num_tokens)
            return dispatch_static(self, permuted_tokens, meta)
        return self._dispatch_dropless(permuted_tokens, meta)

    def _dispatch_dropless(self, permuted, meta: AllToAllDispatchMetadata, reorder=True):
        distributed = bool(self.groups())
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if distributed and capturing:
            raise RuntimeError(
                "dropless expert parallelism reads the all-to-all split sizes on the host (one "
                "sync per layer) and cannot be captured in a CUDA graph; set capacity_factor "
                "for a static, capturable dispatch (or capture only up to the dispatch)"
            )
        res, ws = meta.preprocess, meta.workspace
        ep, q = self.ep_size, self.etp_size
        check = (
            self.check_ranks is not False and distributed and data_checks_enabled(True, permuted)
        )
        spec = rank_meta(permuted, res.permuted_probs, meta.num_tokens) if check else None
        row = spec.tensor(permuted.device) if check else None
        ep_rows = etp_rows = None
        if ep > 1:
            recv_counts, ep_rows = exchange_counts(res.tokens_per_expert, ep, self.ep_group, row)
            # on a copy: the caller's metadata (dispatch_preprocess's) stays as it was
            res = finish_ep_preprocess(dataclasses.replace(res), recv_counts, ws)
            store_preprocess(res, ws, _EP_FIELDS)
            meta = dataclasses.replace(meta, preprocess=res)
            local_counts = res.local_tokens_per_expert
        else:
            local_counts = res.tokens_per_expert
        if q > 1:
            mine = local_counts if row is None else torch.cat([local_counts, row])
            gathered = all_to_all(mine.view(1, -1).expand(q, -1).contiguous(), self.etp_group)
            etp_counts = gathered[:, : self.num_local_experts]
            if row is not None:
                etp_rows = gathered[:, self.num_local_experts :]
        if not distributed:
            return permuted, res.tokens_per_expert, res.permuted_probs, meta
        # The one device-to-host sync of the layer: split sizes (and the ranks' metadata).
        host = read_sizes(self, res, spec, ep_rows, etp_counts if q > 1 else None, etp_rows)
        tokens, probs, counts = permuted, res.permuted_probs, res.tokens_per_expert
        if ep > 1:
            tokens, probs, meta, order = self._ep_exchange(permuted, meta, host, reorder)
            counts = res.local_tokens_per_expert
            if not reorder:  # dispatch_received (q == 1)
                return tokens, counts, probs, order, meta
        if q > 1:
            sizes = host["etp_sizes"]
            total = sum(sizes)
            tokens = gather_v(tokens, self.etp_group, sizes, self.etp_rank)
            probs = gather_v(probs, self.etp_group, sizes, self.etp_rank)
            order, inverse = _recv_reorder(etp_counts, total)
            meta = dataclasses.replace(meta, etp_sizes=sizes, etp_inverse=inverse)
            tokens = gather_rows(tokens, order, meta.backend)
            probs = probs.index_select(0, order)
            counts = etp_counts.sum(dim=0)
        return tokens, counts, probs, meta

    def _ep_exchange(self, permuted, meta: AllToAllDispatchMetadata, host, reorder=True):
        recv, recv_probs, order, meta = exchange_rows(self.ep_group, permuted, meta, host)
        if not reorder and recv.shape[0]:  # fused experts read the rows through ``order``
            return recv, recv_probs, meta, order
        return gather_rows(recv, order, meta.backend), recv_probs.index_select(0, order), meta, None

    def dispatch_received(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                          routing_map: torch.Tensor):  # fmt: skip
        """:meth:`dispatch` without the reorder copy of the received rows (``P > 1``,
        ``Q == 1``; dropless or with a capacity): ``(recv [R, H], tokens_per_expert [L],
        recv_probs [R], order [R], token_map, metadata)``, the rows and probabilities as they
        arrived (source-rank-major), the received row of each expert-major row and the map of
        that permutation (fused experts read the rows through them and write their outputs back
        through ``order``, in the received order :meth:`combine` then expects, see
        :mod:`mtp.moe.gathered`); ``order`` and ``token_map`` are None where the rows were
        reordered anyway (``Q > 1``, one rank, nothing received), then ``recv`` and the
        output are expert-major."""
        permuted, pprobs, meta = self.dispatch_preprocess(hidden_states, probs, routing_map)
        if meta.workspace.capacity is not None and self.etp_size == 1 and self.ep_size > 1:
            check_static(self, permuted, pprobs, meta.num_tokens)
            *rows, meta = static_received(self, permuted, meta)
            return (*rows, dataclasses.replace(meta, received_order=True))
        if meta.workspace.capacity is not None or self.etp_size > 1 or self.ep_size == 1:
            tokens, counts, pprobs, meta = self.token_dispatch(permuted, pprobs, meta)
            return tokens, counts, pprobs, None, None, meta
        recv, counts, recv_probs, order, meta = self._dispatch_dropless(permuted, meta, False)
        if order is None:
            return recv, counts, recv_probs, None, None, meta
        tm, meta = received_map(self, meta), dataclasses.replace(meta, received_order=True)
        return recv, counts, recv_probs, order, tm, meta

    # -- combine ------------------------------------------------------------------------------

    def combine(
        self, expert_output: torch.Tensor, metadata: AllToAllDispatchMetadata
    ) -> torch.Tensor:
        """Return the expert outputs to their tokens and sum them: ``[T, H]``.

        Args:
            expert_output: ``[M, H]``, rows as returned by :meth:`dispatch` (already scaled by
                the probabilities, as :class:`~mtp.moe.GroupedMLP` does; partial sums over the
                expert-tensor-parallel shards with ``Q > 1``).
            metadata: what :meth:`dispatch` returned with those rows.
        """
        if not isinstance(metadata, AllToAllDispatchMetadata):
            raise TypeError(
                "combine() takes the metadata dispatch() returned, got "
                f"{type(metadata).__name__}"
            )
        meta, res, ws = metadata, metadata.preprocess, metadata.workspace
        shape = (meta.num_tokens, meta.hidden_size)
        if expert_output.dim() != 2 or expert_output.shape[1] != shape[1]:
            raise ValueError(
                f"expert_output must be [M, {shape[1]}], got {tuple(expert_output.shape)}"
            )
        y = self._combine_etp(expert_output, meta)
        if self.ep_size > 1 and ws.capacity is not None:
            ep, local, cap = self.ep_size, self.num_local_experts, ws.capacity
            if not meta.received_order:
                y = y.view(local, ep, cap, -1).transpose(0, 1).reshape(ep * local * cap, -1)
            y = all_to_all(y, self.ep_group)
        elif self.ep_size > 1:
            if not meta.received_order:
                y = gather_rows(y, meta.recv_inverse, meta.backend)
            y = all_to_all(y, self.ep_group, meta.send_sizes, meta.recv_sizes)
        out = unpermute(y, res.row_id_map, shape, backend=meta.backend, validate=False,
                        token_map=meta.token_map)  # fmt: skip
        if shape[0] == 0 and y.requires_grad and not out.requires_grad:
            # No token here: keep the autograd link anyway, so that this rank's backward still
            # joins the all-to-alls the other ranks run.
            out = out + y.sum() * 0
        return out

    def _combine_etp(self, y, meta: AllToAllDispatchMetadata):
        """``Q > 1``: sum the shards' partial outputs and give each rank its own rows back."""
        q = self.etp_size
        if q == 1:
            return y
        if meta.workspace.capacity is not None:
            local, rows = self.num_local_experts, meta.etp_rows
            y = y.view(local, q, rows, -1).transpose(0, 1).reshape(q * local * rows, -1)
            n = local * rows
            return reduce_scatter_v(y, self.etp_group, [n] * q, self.etp_rank)
        y = gather_rows(y, meta.etp_inverse, meta.backend)
        return reduce_scatter_v(y, self.etp_group, meta.etp_sizes, self.etp_rank)

    # -- Megatron-Core names ------------------------------------------------------------------

    def token_permutation(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron-Core's stateful :meth:`dispatch` (``hidden_states`` may be ``[..., H]``):
        returns the first three outputs and keeps the metadata for
        :meth:`token_unpermutation`."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens, counts, permuted_probs, self._megatron_metadata = self.dispatch(
            flat, probs, routing_map
        )
        return tokens, counts, permuted_probs

    def token_unpermutation(
        self, hidden_states: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """Megatron-Core's stateful :meth:`combine` (after :meth:`token_permutation`); returns
        ``(output [T, H], None)``."""
        if bias is not None:
            raise ValueError("token_unpermutation: bias is not supported (add it in the experts)")
        meta, self._megatron_metadata = self._megatron_metadata, None
        if meta is None:
            raise RuntimeError("token_unpermutation() needs a token_permutation() first")
        return self.combine(hidden_states, meta), None
