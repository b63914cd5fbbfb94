"""Communication pieces of the MoE token dispatchers: row gathers, differentiable
all-to-all / all-gather-v / reduce-scatter-v, and the rank-agreement metadata
(:class:`~mtp.parallel.errors.RankMismatchError`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.ops._backend import resolve_backend
from mtp.parallel.errors import RankMismatchError
from mtp.utils import is_fake

__all__ = [
    "all_to_all",
    "check_rank_meta",
    "gather_rows",
    "gather_v",
    "permute_backend",
    "rank_meta",
    "reduce_scatter_v",
]

_PERMUTE_BACKENDS = ("triton", "reference")


def permute_backend(backend: str, device: torch.device) -> str:
    """The permute/unpermute backend for a layer backend name (grouped-GEMM-only names such as
    ``"sequential"`` fall back to ``"auto"``)."""
    name = backend if backend in _PERMUTE_BACKENDS else "auto"
    return resolve_backend("permute", name, device, _PERMUTE_BACKENDS)


def gather_rows(x: torch.Tensor, index: torch.Tensor, backend: str) -> torch.Tensor:
    """``out[i] = x[index[i]]`` (zero row where ``index[i] < 0``); differentiable in ``x``."""
    if backend == "triton":
        return torch.ops.mtp.moe_gather_rows(x, index, None)
    valid = (index >= 0).unsqueeze(1)
    if x.shape[0] == 0:  # nothing to gather; keep the autograd link (collectives hang on it)
        x = torch.cat([x, x.new_zeros((1, x.shape[1]))])
    rows = x.index_select(0, index.clamp(min=0))
    return torch.where(valid, rows, rows.new_zeros(()))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with its adjoint as backward (the reverse exchange)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.in_rows = x.shape[0]
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        if not is_fake(x):  # tracing: shapes only
            dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_in = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        if not is_fake(grad):
            dist.all_to_all_single(
                grad_in, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group
            )
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (equal splits when None)."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


def gather_v(x: torch.Tensor, group, sizes: list[int], rank: int) -> torch.Tensor:
    """Differentiable all-gather along dim 0 of ``sizes[r]`` rows from each rank ``r`` (backward:
    the reduce-scatter), as an ``all_to_all_single`` of ``x`` sent to every rank."""
    world = len(sizes)
    return all_to_all(torch.cat([x] * world), group, list(sizes), [sizes[rank]] * world)


def reduce_scatter_v(y: torch.Tensor, group, sizes: list[int], rank: int) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0: rank ``r`` gets the sum over the ranks of their
    ``sizes[r]`` rows at offset ``sum(sizes[:r])`` (backward: :func:`gather_v`)."""
    world = len(sizes)
    mine = sizes[rank]
    out = all_to_all(y, group, [mine] * world, list(sizes))
    return out.view(world, mine, *y.shape[1:]).sum(dim=0)


from mtp.dtypes import FLOATS, dtype_code  # noqa: E402
_DTYPE_CODES = {dtype: dtype_code(dtype) for dtype in FLOATS}  # 1, 2, 3, 4
_META_NAMES = ("token count", "hidden size", "hidden_states dtype", "probs dtype")


def _dtype_name(code: int) -> str:
    for dtype, c in _DTYPE_CODES.items():
        if c == code:
            return str(dtype)
    return f"code {code}"


def rank_meta(
    hidden_states: torch.Tensor, probs: torch.Tensor, num_tokens: int | None = None
) -> torch.Tensor:
    """``[4]`` int64 on the device: token count (``num_tokens``, default the rows of
    ``hidden_states``), hidden size and the dtype codes of the tokens and the probabilities
    (what every rank of a token exchange must agree on)."""
    values = [
        hidden_states.shape[0] if num_tokens is None else num_tokens,
        hidden_states.shape[1],
        _DTYPE_CODES.get(hidden_states.dtype, 0),
        _DTYPE_CODES.get(probs.dtype, 0),
    ]
    return torch.tensor(values, dtype=torch.int64).to(hidden_states.device, non_blocking=True)


def check_rank_meta(rows: list[list[int]], ranks: list[int], same_tokens: bool, what: str) -> None:
    """Raise :class:`RankMismatchError` (on every rank: each holds every row) unless the ranks
    agree on the hidden size and dtypes, and on the token count when ``same_tokens``."""
    for i, name in enumerate(_META_NAMES):
        if i == 0 and not same_tokens:
            continue
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = [_dtype_name(v) for v in values] if i >= 2 else values
            pairs = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, shown))
            raise RankMismatchError(
                f"MoE {what}: the ranks of the group disagree on the {name} ({pairs}); every "
                "rank must pass the same " + name + (
                    " (a capacity_factor makes every split static, so all ranks need the same "
                    "token count)" if i == 0 else ""
                )
            )


def _group_ranks(group, size: int) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - only for the message
        return list(range(size))


def set_dispatch_groups(dispatcher, ep_group, etp_group, num_experts: int, topk: int) -> None:
    """Set a token dispatcher's group attributes (``ep_group/ep_size/ep_rank``, ``etp_*``,
    ``num_experts``, ``topk``, ``num_local_experts``), checking that the experts split evenly
    over the expert-parallel ranks and that ``topk <= num_experts``."""
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the expert-parallel size {ep_size}"
        )
    if topk > num_experts:
        raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
    dispatcher.ep_group, dispatcher.ep_size = ep_group, ep_size
    dispatcher.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    etp_size = 1 if etp_group is None else dist.get_world_size(etp_group)
    dispatcher.etp_size = etp_size
    dispatcher.etp_rank = 0 if etp_group is None else dist.get_rank(etp_group)
    dispatcher.etp_group = etp_group if etp_size > 1 else None
    dispatcher.num_experts, dispatcher.topk = num_experts, topk
    dispatcher.num_local_experts = num_experts // ep_size
