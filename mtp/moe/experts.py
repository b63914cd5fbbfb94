"""The experts of one rank as two grouped GEMMs: :class:`GroupedMLP`.

``forward(x [M, H], tokens_per_expert [L], permuted_probs [M])``:
``fc1`` grouped GEMM (``x_e @ weight1[e]``, + ``bias1[e]``) -> activation (GeLU, or SwiGLU on
the two halves of ``fc1``'s output) -> multiply each row by its routing probability -> ``fc2``
grouped GEMM (``@ weight2[e]``, + ``bias2[e]``). The probability scales the activation, so
``fc2``'s bias is not scaled (Megatron-Core's order).

Every step reads ``tokens_per_expert`` on the device: with a single-launch grouped GEMM backend
(``"triton"``, ``"torch"``, ``"cutlass"``) the forward dispatches the same number of operations
for any number of experts and never synchronises with the host (graph-safe). The loop backends
(``"sequential"``, ``"multistream"``, ``"reference"``) launch one GEMM per expert and read the
counts on the host once per GEMM call.

``backend="auto"`` is the grouped GEMM's ``auto`` (``MTP_BACKEND``, else ``"triton"`` on CUDA),
except on the CPU, where it is ``"torch"`` (``torch.nn.functional.grouped_mm``, which reads the
counts where they are) instead of the host-reading reference loop, so that the layer keeps its
no-sync, graph-safe structure on the CPU too.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from mtp import ops
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS, torch_grouped_mm, grouped_gemm
from mtp.utils import check_int

__all__ = ["GroupedMLP"]

_ACTIVATIONS = ("gelu", "swiglu")
_ACT_BACKENDS = ("triton", "reference")


def _activation(h: torch.Tensor, activation: str, backend: str) -> torch.Tensor:
    """GeLU (exact, erf) or SwiGLU (``silu(first half) * second half``) of ``h``; the fused
    ``mtp.ops.bias_gelu``/``bias_swiglu`` kernels when present, else plain PyTorch."""
    name = "bias_gelu" if activation == "gelu" else "bias_swiglu"
    fused = getattr(ops, name, None)
    if fused is not None and h.dtype in (torch.float32, torch.float16, torch.bfloat16):
        act_backend = backend if backend in _ACT_BACKENDS else "auto"
        return fused(h, None, backend=act_backend)
    if activation == "gelu":
        return F.gelu(h)
    a, g = torch.chunk(h, 2, dim=-1)
    return F.silu(a) * g


def _expert_of_rows(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Expert index of each of ``num_rows`` grouped rows (rows past the total: the last)."""
    ends = torch.cumsum(tokens_per_expert.to(torch.int64), dim=0)
    rows = torch.arange(num_rows, device=ends.device, dtype=torch.int64)
    return torch.searchsorted(ends, rows, right=True).clamp(max=tokens_per_expert.shape[0] - 1)


class GroupedMLP(nn.Module):
    """``L`` expert MLPs evaluated with grouped GEMMs (Megatron-Core ``GroupedMLP`` names).

    Args:
        num_local_experts: ``L``, experts held by this rank.
        hidden_size: ``H``.
        ffn_hidden_size: ``F``, each expert's intermediate size.
        activation: ``"gelu"`` (exact erf GeLU) or ``"swiglu"`` (``fc1`` produces ``2F``
            features; ``silu`` of the first half gates the second, Megatron's convention).
        bias: add per-expert biases ``bias1 [L, F1]`` and ``bias2 [L, H]``.
        backend: grouped GEMM backend (``"auto"``, ``"triton"``, ``"torch"``, ``"cutlass"``,
            ``"multistream"``, ``"sequential"``, ``"reference"``, see
            :func:`mtp.ops.grouped_gemm`); the activation kernel uses ``"triton"`` or
            ``"reference"`` when named, else ``"auto"``.
        params_dtype, device: of the parameters.
        perform_initialization: initialise the weights (see :meth:`reset_parameters`); False
            leaves them uninitialised (for loading a checkpoint).

    Parameters: ``weight1 [L, H, F1]`` and ``weight2 [L, F, H]`` (``[E, K, N]``, ``F1 = F`` or
    ``2F``), optional ``bias1``/``bias2``. They carry ``allreduce = False`` (Megatron's marker
    for expert parameters: reduce their gradients over the expert-data-parallel group, not the
    data-parallel group).
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "gelu",
        bias: bool = False,
        backend: str = "auto",
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        perform_initialization: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_local_experts", num_local_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            check_int(name, value, 1)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        self.num_local_experts, self.hidden_size = num_local_experts, hidden_size
        self.ffn_hidden_size, self.activation = ffn_hidden_size, activation
        self.backend, self.add_bias = backend, bool(bias)
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.fc1_output_size = fc1_out
        kw = dict(dtype=params_dtype, device=device)
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out, **kw))
        self.weight2 = nn.Parameter(
            torch.empty(num_local_experts, ffn_hidden_size, hidden_size, **kw)
        )
        if self.add_bias:
            self.bias1 = nn.Parameter(torch.empty(num_local_experts, fc1_out, **kw))
            self.bias2 = nn.Parameter(torch.empty(num_local_experts, hidden_size, **kw))
        else:
            self.register_parameter("bias1", None)
            self.register_parameter("bias2", None)
        for p in self.parameters():
            p.allreduce = False
        if perform_initialization:
            self.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, "
            f"bias={self.add_bias}, backend={self.backend!r}"
        )

    @torch.no_grad()
    def reset_parameters(self, expert_offset: int = 0, num_experts: int | None = None) -> None:
        """Initialise expert ``l`` as ``nn.Linear(H, F1)`` / ``nn.Linear(F, H)`` (with this
        layer's ``bias``) would be, drawn in order from the current (CPU) random state.

        ``torch.manual_seed(s)`` followed by ``GroupedMLP(L, ...)`` gives
        ``weight1[l] == fc1_l.weight.T`` and ``weight2[l] == fc2_l.weight.T`` for the pairs
        ``fc1_l, fc2_l`` of ``torch.manual_seed(s); [(nn.Linear(H, F1), nn.Linear(F, H)) for
        l in range(L)]``. With ``expert_offset``/``num_experts``, ``num_experts`` pairs are drawn
        and experts ``[expert_offset, expert_offset + L)`` kept, so expert-parallel ranks get the
        slices of one single-process layer and consume the same random numbers.
        """
        total = self.num_local_experts if num_experts is None else num_experts
        if not 0 <= expert_offset <= total - self.num_local_experts:
            raise ValueError(
                f"expert_offset={expert_offset} does not fit {self.num_local_experts} local "
                f"experts in num_experts={total}"
            )
        for e in range(total):
            fc1 = nn.Linear(self.hidden_size, self.fc1_output_size, bias=self.add_bias)
            fc2 = nn.Linear(self.ffn_hidden_size, self.hidden_size, bias=self.add_bias)
            local = e - expert_offset
            if 0 <= local < self.num_local_experts:
                self._load_pair(local, fc1, fc2)

    @torch.no_grad()
    def _load_pair(self, local: int, fc1: nn.Linear, fc2: nn.Linear) -> None:
        self.weight1[local].copy_(fc1.weight.t())
        self.weight2[local].copy_(fc2.weight.t())
        if self.add_bias:
            self.bias1[local].copy_(fc1.bias)
            self.bias2[local].copy_(fc2.bias)

    @torch.no_grad()
    def load_linears(self, pairs: list[tuple[nn.Linear, nn.Linear]]) -> None:
        """Copy ``L`` ``(fc1, fc2)`` ``nn.Linear`` pairs into the grouped weights (checkpoint
        loading)."""
        if len(pairs) != self.num_local_experts:
            raise ValueError(f"need {self.num_local_experts} (fc1, fc2) pairs, got {len(pairs)}")
        for local, (fc1, fc2) in enumerate(pairs):
            want1 = (self.fc1_output_size, self.hidden_size)
            want2 = (self.hidden_size, self.ffn_hidden_size)
            if tuple(fc1.weight.shape) != want1 or tuple(fc2.weight.shape) != want2:
                raise ValueError(
                    f"pair {local}: fc1.weight must be {want1} and fc2.weight {want2}, got "
                    f"{tuple(fc1.weight.shape)} and {tuple(fc2.weight.shape)}"
                )
            if (fc1.bias is not None) != self.add_bias or (fc2.bias is not None) != self.add_bias:
                raise ValueError(f"pair {local}: bias presence must match bias={self.add_bias}")
            self._load_pair(local, fc1, fc2)

    def gemm_backend(self, device: torch.device) -> str:
        """The grouped GEMM backend used on ``device`` (see the module docstring)."""
        if (
            self.backend == "auto"
            and device.type == "cpu"
            and os.environ.get("MTP_BACKEND", "").strip() not in GROUPED_GEMM_BACKENDS
            and torch_grouped_mm() is not None
        ):
            return "torch"
        return self.backend

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        backend = self.gemm_backend(x.device)
        return grouped_gemm(x, w.to(x.dtype), counts, backend=backend, validate=False)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, H]`` rows grouped by local expert -> ``[M, H]`` expert outputs (each row scaled
        by its probability before ``fc2``). ``tokens_per_expert``: ``[L]`` int32/int64 on the
        device (or CPU). Rows past ``sum(tokens_per_expert)`` produce ``bias2`` of the last
        expert (zero without bias)."""
        x = permuted_local_hidden_states
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(
                f"permuted_local_hidden_states must be [M, {self.hidden_size}], got "
                f"{tuple(x.shape)}"
            )
        if tokens_per_expert.dim() != 1 or tokens_per_expert.shape[0] != self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert must be [{self.num_local_experts}], got "
                f"{tuple(tokens_per_expert.shape)}"
            )
        if permuted_probs is not None and tuple(permuted_probs.shape) != (x.shape[0],):
            raise ValueError(
                f"permuted_probs must be [{x.shape[0]}] (one per row), got "
                f"{tuple(permuted_probs.shape)}"
            )
        experts = None
        if self.add_bias:
            experts = _expert_of_rows(tokens_per_expert.to(x.device), x.shape[0])
        h = self._gemm(x, self.weight1, tokens_per_expert)
        if experts is not None:
            h = h + self.bias1.to(h.dtype).index_select(0, experts)
        h = _activation(h, self.activation, self.backend)
        if permuted_probs is not None:
            h = h * permuted_probs.to(h.dtype).unsqueeze(-1)
        y = self._gemm(h, self.weight2, tokens_per_expert)
        if experts is not None:
            y = y + self.bias2.to(y.dtype).index_select(0, experts)
        return y
