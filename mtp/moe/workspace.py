"""Fixed-address buffers of the MoE preprocess and dispatch: :class:`MoEWorkspace`.

Every buffer :func:`mtp.moe.preprocess` and :class:`mtp.moe.AllToAllTokenDispatcher` write is
allocated once, at its worst-case size for the token count the workspace was built for, and
rewritten in place, so ``data_ptr()`` never changes: a CUDA graph captured over the preprocess
(or the whole layer) keeps reading and writing the same memory at replay. The dispatcher
writes them only while a graph is captured (:func:`mtp.utils.is_capturing`); an eager dispatch
keeps its fresh preprocess tensors (in its metadata) and skips the copies.

Shapes (``T`` tokens on this rank, ``E`` experts, ``k`` = topk, ``P`` = ep_size, ``L = E / P``
local experts, ``H`` hidden size; ``N`` permuted rows on this rank: ``T * k`` dropless,
``E * C`` with capacity ``C``; ``R`` the worst-case rows this rank receives: ``P * T *
min(k, L)`` dropless, ``P * L * C`` with capacity):

==================== ============ ====== =======================================================
buffer               shape        dtype  content
==================== ============ ====== =======================================================
tokens_per_expert    [E]          int64  rows per expert in the permuted layout (``C`` each with
                                         capacity)
row_id_map           [N]          int64  token of each permuted row, -1 for an empty slot
                                         (:func:`mtp.ops.moe_permute.moe_permute_row_map`)
probs_index          [N]          int64  flat ``t * E + e`` index of each row (``T * E``: none)
permuted_probs       [N]          probs  routing probability of each permuted row (0: none)
send_counts          [P]          int64  rows sent to each EP rank            (P > 1)
recv_counts          [P, L]       int64  rows received per (source rank, local expert) (P > 1)
local_tokens_per_e.. [L]          int64  rows per local expert after the all-to-all (P > 1)
recv_order           [R]          int64  received row feeding expert-major row ``j`` (-1: none)
                                         (P > 1, dropless)
recv_inverse         [R]          int64  expert-major row of received row ``i`` (P > 1,
                                         dropless)
output               [T, H]       dtype  the layer output while a graph is captured (allocated
                                         by :meth:`MoEWorkspace.static_output` on first use)
==================== ============ ====== =======================================================

Token-sized activations (the permuted rows, what the all-to-alls send and receive, the expert
inputs and outputs) are not workspace buffers: autograd saves some of them for the backward, so
they must not be overwritten by the next forward, and holding them per layer would cost
``2 * N * H`` elements per MoE layer for the whole run (about 900 MiB per layer for a
DeepSeek-V3-like layer with ``P = 8`` and a capacity). They are allocated per call by PyTorch's
caching allocator (a captured CUDA graph gives them fixed addresses from its pool). With
``P > 1`` dropless, the received row count is data-dependent: those rows are sized exactly after
the one host sync, and only the index buffers above use the worst case ``R``.
"""

from __future__ import annotations

import dataclasses

import torch

from mtp.moe.router import get_capacity
from mtp.moe._checks import check_device, check_float_dtype, check_positive
from mtp.utils import check_int

__all__ = ["MoEWorkspace", "WorkspaceMismatchError"]


class WorkspaceMismatchError(ValueError):
    """A workspace used with sizes, dtypes or devices other than it was built for."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    num_tokens: int
    hidden_size: int
    num_experts: int
    topk: int
    ep_size: int
    capacity: int | None

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_rows(self) -> int:
        """Permuted rows on this rank (``N``)."""
        if self.capacity is not None:
            return self.num_experts * self.capacity
        return self.num_tokens * self.topk

    @property
    def max_recv_rows(self) -> int:
        """Worst-case rows received by this rank (``R``)."""
        if self.capacity is not None:
            return self.ep_size * self.num_local_experts * self.capacity
        return self.ep_size * self.num_tokens * min(self.topk, self.num_local_experts)


class MoEWorkspace:
    """Buffers of the MoE preprocess and dispatch, allocated once (see the module table).

    Args:
        num_tokens: ``T``, tokens on this rank per forward (the product of the input's leading
            dims). A different count needs a new workspace (:class:`mtp.moe.MoELayer` rebuilds
            it, with a log line).
        hidden_size: ``H``.
        num_experts: ``E``, all experts (over every expert-parallel rank).
        topk: experts per token.
        ep_size: expert-parallel ranks ``P`` (``E`` must be divisible by it).
        capacity_factor: None (dropless) or the capacity factor; then ``capacity`` =
            ``min(ceil(T * topk / E * capacity_factor), T)`` slots per expert.
        dtype: dtype of the token buffers (the activations).
        probs_dtype: dtype of ``permuted_probs`` (the router's probabilities; default ``dtype``).
        device: where the buffers live.

    Attributes: the buffers of the table, ``capacity``, ``num_rows`` (``N``),
    ``max_recv_rows`` (``R``) and ``nbytes`` (bytes held).

    Raises:
        ValueError: ``num_experts`` not divisible by ``ep_size``, ``topk > num_experts``,
            non-positive sizes.
    """

    def __init__(
        self,
        num_tokens: int,
        hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        ep_size: int = 1,
        capacity_factor: float | None = None,
        dtype: torch.dtype = torch.float32,
        probs_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        check_int("num_tokens", num_tokens, 0)
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_experts", num_experts),
            ("topk", topk),
            ("ep_size", ep_size),
        ):
            check_int(name, value, 1)
        if topk > num_experts:
            raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by ep_size={ep_size} (each "
                "expert-parallel rank holds num_experts / ep_size experts)"
            )
        check_positive("capacity_factor", capacity_factor)
        check_float_dtype("dtype", dtype)
        check_float_dtype("probs_dtype", probs_dtype, allow_none=True)
        check_device("device", device)
        capacity = None
        if capacity_factor is not None:
            capacity = min(
                get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens
            )
        self.layout = _Layout(num_tokens, hidden_size, num_experts, topk, ep_size, capacity)
        self.capacity_factor = capacity_factor
        self.dtype = dtype
        self.probs_dtype = probs_dtype or dtype
        self.device = torch.device(device)
        self._allocate()

    # -- allocation ---------------------------------------------------------------------------

    def _buffer(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        self._buffers[name] = t
        return t

    def _allocate(self) -> None:
        lay, i64 = self.layout, torch.int64
        self._buffers: dict[str, torch.Tensor] = {}
        n, ep, local = lay.num_rows, lay.ep_size, lay.num_local_experts
        self.tokens_per_expert = self._buffer("tokens_per_expert", (lay.num_experts,), i64)
        self.row_id_map = self._buffer("row_id_map", (n,), i64)
        self.probs_index = self._buffer("probs_index", (n,), i64)
        self.permuted_probs = self._buffer("permuted_probs", (n,), self.probs_dtype)
        self.output: torch.Tensor | None = None
        self.send_counts = self.recv_counts = self.local_tokens_per_expert = None
        self.recv_order = self.recv_inverse = None
        if ep == 1:
            return
        self.send_counts = self._buffer("send_counts", (ep,), i64)
        self.recv_counts = self._buffer("recv_counts", (ep, local), i64)
        self.local_tokens_per_expert = self._buffer("local_tokens_per_expert", (local,), i64)
        if lay.capacity is not None:
            # Static split: every rank sends local * capacity rows to every rank.
            self.send_counts.fill_(local * lay.capacity)
            self.recv_counts.fill_(lay.capacity)
            self.local_tokens_per_expert.fill_(ep * lay.capacity)
            return
        self.recv_order = self._buffer("recv_order", (lay.max_recv_rows,), i64)
        self.recv_inverse = self._buffer("recv_inverse", (lay.max_recv_rows,), i64)

    def static_output(self) -> torch.Tensor:
        """The ``[T, H]`` output buffer of a captured layer, allocated on the first call."""
        if self.output is None:
            self.output = self._buffer("output", (self.num_tokens, self.hidden_size), self.dtype)
        return self.output

    # -- description --------------------------------------------------------------------------

    num_tokens = property(lambda self: self.layout.num_tokens, doc="``T``")
    hidden_size = property(lambda self: self.layout.hidden_size, doc="``H``")
    num_experts = property(lambda self: self.layout.num_experts, doc="``E``")
    topk = property(lambda self: self.layout.topk, doc="experts per token")
    ep_size = property(lambda self: self.layout.ep_size, doc="``P``")
    num_local_experts = property(lambda self: self.layout.num_local_experts, doc="``L``")
    capacity = property(lambda self: self.layout.capacity, doc="``C`` (None: dropless)")
    num_rows = property(lambda self: self.layout.num_rows, doc="``N``, permuted rows")
    max_recv_rows = property(lambda self: self.layout.max_recv_rows, doc="``R``")

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers by name."""
        return dict(self._buffers)

    @property
    def nbytes(self) -> int:
        """Device memory held by the workspace, in bytes."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def data_ptrs(self) -> dict[str, int]:
        """``{name: data_ptr()}`` of every buffer (stable for the workspace's lifetime)."""
        return {name: t.data_ptr() for name, t in self._buffers.items()}

    def __repr__(self) -> str:
        lay = self.layout
        mode = "dropless" if lay.capacity is None else f"capacity={lay.capacity}"
        return (
            f"MoEWorkspace(num_tokens={lay.num_tokens}, hidden_size={lay.hidden_size}, "
            f"num_experts={lay.num_experts}, topk={lay.topk}, ep_size={lay.ep_size}, {mode}, "
            f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )

    # -- checks -------------------------------------------------------------------------------

    def _problems(self, num_tokens, num_experts, hidden_size, dtype, device) -> list[str]:
        lay, problems = self.layout, []
        for what, got, have in (
            ("tokens", num_tokens, lay.num_tokens),
            ("experts", num_experts, lay.num_experts),
            ("hidden size", hidden_size, lay.hidden_size),
            ("dtype", dtype, self.dtype),
            ("device", None if device is None else torch.device(device), self.device),
        ):
            if got is not None and got != have:
                problems.append(f"{what} {got} (workspace: {have})")
        return problems

    def matches(
        self,
        num_tokens: int,
        num_experts: int | None = None,
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> bool:
        """Whether the workspace fits these sizes (None: not compared)."""
        return not self._problems(num_tokens, num_experts, hidden_size, dtype, device)

    def check(
        self,
        what: str,
        num_tokens: int,
        num_experts: int | None = None,
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Raise :class:`WorkspaceMismatchError` unless the workspace fits (``what`` names the
        caller's tensor in the message)."""
        problems = self._problems(num_tokens, num_experts, hidden_size, dtype, device)
        if problems:
            raise WorkspaceMismatchError(
                f"{what} does not fit the MoEWorkspace: " + ", ".join(problems) + ". Build a "
                "workspace for these sizes (MoEWorkspace(num_tokens, hidden_size, num_experts, "
                "topk, ...)); MoELayer rebuilds its own when the token count changes."
            )

    @classmethod
    def estimate_nbytes(cls, *args, **kwargs) -> int:
        """``nbytes`` of ``MoEWorkspace(*args, **kwargs)`` without allocating it (built on the
        meta device)."""
        kwargs["device"] = "meta"
        return cls(*args, **kwargs).nbytes
