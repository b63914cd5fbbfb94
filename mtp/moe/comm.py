"""Communication pieces of the MoE token dispatchers: row gathers, differentiable
all-to-all / all-gather-v / reduce-scatter-v, and the rank-agreement metadata
(an :class:`~mtp.parallel.agree.Agreement` folded into the exchanges)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp.ops._backend import resolve_backend
from mtp.ops.moe_permute import TokenMap, scatter_rows
from mtp.parallel.agree import Agreement, agreement
from mtp.utils import is_fake

__all__ = [
    "all_to_all",
    "gather_rows",
    "gather_v",
    "permute_backend",
    "permute_rows",
    "rank_meta",
    "reduce_scatter_v",
]

_PERMUTE_BACKENDS = ("triton", "reference")


def permute_backend(backend: str, device: torch.device) -> str:
    """The permute/unpermute backend for a layer backend name (grouped-GEMM-only names such as
    ``"sequential"`` fall back to ``"auto"``)."""
    name = backend if backend in _PERMUTE_BACKENDS else "auto"
    return resolve_backend("permute", name, device, _PERMUTE_BACKENDS)


def permute_rows(x: torch.Tensor, row_id_map: torch.Tensor, backend: str,
                 token_map: TokenMap | None) -> torch.Tensor:
    """The permuted rows ``x[row_id_map]`` of a dispatch (zero where ``row_id_map < 0``): with
    the Triton backend's token map, each token row read once and scattered to its rows (and a
    sort-free backward: :func:`mtp.ops.moe_permute.rows.scatter_rows`), else
    :func:`gather_rows`."""
    if token_map is not None and backend == "triton":
        return scatter_rows(x, token_map, row_id_map)
    return gather_rows(x, row_id_map, backend)


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


def rank_meta(
    hidden_states: torch.Tensor, probs: torch.Tensor, num_tokens: int | None = None,
    what: str = "MoE dispatch",
) -> Agreement:  # fmt: skip
    """What every rank of a token exchange must agree on: the token count (``num_tokens``,
    default the rows of ``hidden_states``), the hidden size and the dtypes of the tokens and the
    probabilities. ``.tensor(device)`` is the ``[4]`` int64 row folded into the exchange."""
    return agreement(what, {
        "token count": hidden_states.shape[0] if num_tokens is None else num_tokens,
        "hidden size": hidden_states.shape[1],
        "hidden_states dtype": hidden_states.dtype,
        "probs dtype": probs.dtype,
    })  # fmt: skip


#: The capacity hint of a token-count mismatch.
SAME_TOKENS_HINT = (
    "a capacity_factor makes every split static, so all ranks need the same token count"
)
