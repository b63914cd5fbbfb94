"""Per-expert bias of the grouped GEMM (``grouped_gemm(..., bias=[E, N])``): the pieces that are
not the Triton epilogue.

* :func:`add_expert_bias_`: ``y[rows of e] += bias[e]`` after a backend that has no bias epilogue
  (CUTLASS, ``torch.grouped_mm``, the loops); rows past ``sum(counts)`` stay zero.
* :func:`expert_bias_grad`: ``dbias[e] = sum over the rows of e of dy`` in fp32, deterministic:
  on the ``triton`` backend the grouped weight-gradient kernel with a column of ones as the left
  operand (``1_e^T dy_e``: one launch, fp32 accumulation, exact zeros for empty experts, no copy
  of ``dy``); elsewhere ``torch.segment_reduce`` over the experts' row counts.
"""

from __future__ import annotations

import torch

from mtp.kernels import grouped_gemm as _kernels

__all__ = ["add_expert_bias_", "expert_bias_grad"]


def _expert_of_rows(counts: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """Expert of each grouped row; ``E`` for the rows past ``sum(counts)``."""
    ends = torch.cumsum(counts.to(device=device, dtype=torch.int64).clamp_min(0), 0)
    return torch.searchsorted(ends, torch.arange(rows, device=device), right=True)


def add_expert_bias_(y: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of e] += bias[e]`` in place (``y`` ``[M, N]``, ``bias`` ``[E, N]``)."""
    padded = torch.cat([bias.to(y.dtype), bias.new_zeros(1, bias.shape[1], dtype=y.dtype)])
    return y.add_(padded.index_select(0, _expert_of_rows(counts, y.shape[0], y.device)))


def expert_bias_grad(dy: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
    """fp32 ``[E, N]``: the sum of ``dy``'s rows of each expert (rows past ``sum(counts)``
    ignored). A custom op (``mtp::expert_bias_grad``), so compiled backwards trace it."""
    return torch.ops.mtp.expert_bias_grad(dy, counts, backend)


@torch.library.custom_op("mtp::expert_bias_grad", mutates_args=())
def _expert_bias_grad_op(dy: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
    E, (M, N) = counts.shape[0], dy.shape
    if backend == "triton":
        ones = torch.ones((1, 1), dtype=dy.dtype, device=dy.device).expand(M, 1)
        out = torch.empty((E, 1, N), dtype=torch.float32, device=dy.device)
        return _kernels.grouped_wgrad(ones, dy, counts.to(dy.device), out).view(E, N)
    lengths = counts.to(device=dy.device, dtype=torch.int64).clamp_min(0)
    lengths = torch.cat([lengths, (M - lengths.sum()).clamp_min(0).view(1)])
    sums = torch.segment_reduce(dy.float(), "sum", lengths=lengths, axis=0, unsafe=True)
    return sums[:E]


@_expert_bias_grad_op.register_fake
def _(dy, counts, backend):
    return dy.new_empty((counts.shape[0], dy.shape[1]), dtype=torch.float32)
