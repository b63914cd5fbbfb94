"""What the token dispatchers share: their construction from a
:class:`~mtp.moe.config.DispatcherConfig` and a :class:`~mtp.parallel.dims.ParallelDims` (or
the older flat form), when the ranks' agreement is checked, and the all-to-all dispatcher's
:class:`AllToAllDispatchMetadata` (what ``dispatch()`` hands ``combine()``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mtp.moe.config import DispatcherConfig
from mtp.moe.preprocess import MoEPreprocessResult
from mtp.moe.workspace import MoEWorkspace
from mtp.ops.moe_permute import TokenMap
from mtp.parallel.agreement import check_collectives_enabled
from mtp.parallel.dims import ParallelDims
from mtp.utils import data_checks_enabled, is_capturing

__all__ = ["AllToAllDispatchMetadata", "TokenDispatcherBase"]


@dataclasses.dataclass(frozen=True)
class AllToAllDispatchMetadata:
    """What one :meth:`AllToAllTokenDispatcher.dispatch` leaves for its
    :meth:`~AllToAllTokenDispatcher.combine` (and :meth:`~AllToAllTokenDispatcher.
    dispatch_preprocess` for :meth:`~AllToAllTokenDispatcher.token_dispatch`).

    ``preprocess``: the preprocess tensors (the row map, counts, reorders); ``num_tokens`` /
    ``hidden_size``: the input's ``[T, H]``; ``backend``: the permute backend; ``token_map``:
    the row map's token-major map (the combine's one-launch unpermute). Set by the
    exchange: dropless ``P > 1`` the host split sizes ``send_sizes``/``recv_sizes`` and the
    received rows' reorder ``recv_inverse``; ``Q > 1`` the expert-TP gather's ``etp_sizes`` and
    ``etp_inverse`` (dropless) or ``etp_rows`` (capacity). ``received_order``: the expert
    output comes back in the order the rows were received in (``dispatch_received``'s
    contract), so the combine sends it back without reordering it.
    """

    workspace: MoEWorkspace
    preprocess: MoEPreprocessResult
    backend: str
    num_tokens: int
    hidden_size: int
    token_map: TokenMap | None = None
    send_sizes: list[int] | None = None
    recv_sizes: list[int] | None = None
    recv_inverse: torch.Tensor | None = None
    etp_sizes: list[int] | None = None
    etp_inverse: torch.Tensor | None = None
    etp_rows: int | None = None
    received_order: bool = False


class TokenDispatcherBase:
    """Construction and the rank-check policy of :class:`~mtp.moe.AllToAllTokenDispatcher`
    and :class:`~mtp.moe.AllGatherTokenDispatcher`.

    ``Dispatcher(config, dims)``: a :class:`DispatcherConfig` and the groups as a
    :class:`ParallelDims` (its ``ep_group``/``etp_group``; None: one rank). The flat form
    ``Dispatcher(ep_group, num_experts, topk, *, capacity_factor=None, backend="auto",
    etp_group=None, check_ranks=None)`` builds both.

    Attributes (read them; the groups do not change): ``config``, ``dims``, ``ep_group``,
    ``ep_size``, ``ep_rank``, ``etp_group``, ``etp_size``, ``etp_rank``, ``num_experts``,
    ``topk``, ``num_local_experts``, ``local_expert_indices``, ``capacity_factor``,
    ``backend``; ``check_ranks`` may be changed (see :meth:`should_check_ranks`).
    """

    def __init__(
        self,
        config: DispatcherConfig | dist.ProcessGroup | None = None,
        num_experts: int | ParallelDims | None = None,
        topk: int | None = None,
        *,
        dims: ParallelDims | None = None,
        capacity_factor: float | None = None,
        backend: str = "auto",
        etp_group: dist.ProcessGroup | None = None,
        check_ranks: bool | None = None,
    ) -> None:
        if isinstance(config, DispatcherConfig) and isinstance(num_experts, ParallelDims):
            num_experts, dims = None, num_experts  # Dispatcher(config, dims)
        if isinstance(config, DispatcherConfig):
            if num_experts is not None or topk is not None or etp_group is not None:
                raise TypeError(
                    f"{type(self).__name__}(config, dims): pass the groups in dims and the "
                    "rest in config, not as separate arguments"
                )
        else:  # the flat form: (ep_group, num_experts, topk, ...)
            if dims is not None:
                raise TypeError(f"{type(self).__name__}: dims= goes with a DispatcherConfig")
            dims = ParallelDims(ep_group=config, etp_group=etp_group)
            config = DispatcherConfig(
                num_experts, topk, capacity_factor=capacity_factor, backend=backend,
                check_ranks=check_ranks,
            )  # fmt: skip
        dims = dims if dims is not None else ParallelDims()
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"dims must be a ParallelDims, got {type(dims).__name__}")
        if config.num_experts % dims.ep:
            raise ValueError(
                f"num_experts={config.num_experts} must be divisible by the expert-parallel "
                f"size {dims.ep}"
            )
        self.config, self.dims = config, dims
        self.ep_group, self.ep_size, self.ep_rank = dims.ep_group, dims.ep, dims.ep_rank
        self.etp_group, self.etp_size, self.etp_rank = dims.etp_group, dims.etp, dims.etp_rank
        self.num_experts, self.topk = config.num_experts, config.topk
        self.num_local_experts = config.num_experts // dims.ep
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.capacity_factor, self.backend = config.capacity_factor, config.backend
        self.check_ranks = config.check_ranks
        self._checked_once = False

    def groups(self) -> list[tuple[dist.ProcessGroup, int, int]]:
        """``(group, size, rank)`` of the expert-parallel and expert-tensor-parallel groups
        with more than one rank, in that order."""
        return [(g, s, r) for g, s, r in (
            (self.ep_group, self.ep_size, self.ep_rank),
            (self.etp_group, self.etp_size, self.etp_rank),
        ) if s > 1]  # fmt: skip

    def should_check_ranks(self, like) -> bool:
        """Whether this dispatch runs the extra rank-agreement exchange: never with
        ``check_ranks=False``, one rank, tracing or capture; every dispatch with ``True`` or
        ``MTP_CHECK_COLLECTIVES`` set; else (``None``) the first one only."""
        if self.check_ranks is False or not self.groups():
            return False
        if not data_checks_enabled(True, like) or is_capturing():
            return False
        every = self.check_ranks or check_collectives_enabled()
        if self._checked_once and not every:
            return False
        self._checked_once = True
        return True
