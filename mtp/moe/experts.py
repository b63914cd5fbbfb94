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

import torch
import torch.nn.functional as F
from torch import nn

from mtp import ops, settings
from mtp.ops._backend import resolve_backend
from mtp.ops.grouped_mlp import clamped_swiglu
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS, torch_grouped_mm, grouped_gemm
from mtp.moe.config import ACTIVATIONS, ExpertsConfig
from mtp.parallel.params import set_expert_parallel_attributes
from mtp.utils import check_int

__all__ = ["GroupedMLP"]

_ACTIVATIONS = ACTIVATIONS
_GATED = ("swiglu", "clamped_swiglu")
_ACT_BACKENDS = ("triton", "reference")


def activation_function(
    h: torch.Tensor,
    activation: str,
    backend: str = "auto",
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """The experts' activation of the fc1 output ``h [..., F1]`` -> ``[..., F]`` (see
    :class:`GroupedMLP`)."""
    if activation == "relu2":
        return torch.square(F.relu(h))
    if activation == "clamped_swiglu":
        return clamped_swiglu(h, limit, alpha)
    return _activation(h, activation, backend)


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


def fc1_shard_columns(
    ffn_hidden_size: int, activation: str, tp_size: int = 1, tp_rank: int = 0
) -> torch.Tensor:
    """Columns of the full fc1 output ``[F1]`` held by expert-tensor-parallel rank ``tp_rank``
    (int64): a contiguous ``F / tp_size`` slice of the features; for ``"swiglu"`` that slice of
    the gate half and the same slice of the up half; for the interleaved ``"clamped_swiglu"``
    the ``2 F / tp_size`` columns of its gate/up pairs."""
    shard = ffn_hidden_size // tp_size
    start = tp_rank * shard
    cols = torch.arange(start, start + shard)
    if activation == "swiglu":
        return torch.cat([cols, cols + ffn_hidden_size])
    if activation == "clamped_swiglu":
        return torch.arange(2 * start, 2 * (start + shard))
    return cols


class _ZerosWithGrad(torch.autograd.Function):
    """Zeros shaped like ``bias`` whose backward hands ``bias`` the gradient unchanged.

    fc2's bias on expert-tensor-parallel ranks >= 1: the partial outputs are summed over the
    group, so only rank 0 adds the bias, but the output gradient is the same on every rank (the
    reduce-scatter's backward all-gathers it), so each rank's ``bias2`` receives the same complete
    gradient as rank 0's and the replicated copies stay equal under the optimizer."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class GroupedMLP(nn.Module):
    """``L`` expert MLPs evaluated with grouped GEMMs (Megatron-Core ``GroupedMLP`` names).

    Args:
        num_local_experts: ``L``, experts held by this rank.
        hidden_size: ``H``.
        ffn_hidden_size: ``F``, each expert's intermediate size.
        activation: ``"gelu"`` (exact erf GeLU), ``"swiglu"`` (``fc1`` produces ``2F``
            features; ``silu`` of the first half gates the second, Megatron's convention),
            ``"clamped_swiglu"`` (GPT-OSS: ``2F`` interleaved gate/up columns, see
            :func:`clamped_swiglu`) or ``"relu2"`` (``relu(x)**2``, Nemotron-H/Primer).
        activation_limit, activation_alpha: ``limit`` and ``alpha`` of ``"clamped_swiglu"``
            (GPT-OSS's ``swiglu_limit = 7.0``, ``alpha = 1.702``).
        bias: add per-expert biases ``bias1 [L, F1]`` and ``bias2 [L, H]``.
        probs_after_fc2: multiply each row's output by its probability after ``fc2`` and its bias
            (GPT-OSS, Hugging Face's experts) instead of before ``fc2`` (Megatron); the same
            without ``bias``.
        tp_size, tp_rank: expert tensor parallelism: this rank holds ``F / tp_size`` of each
            expert's intermediate features (``fc1`` column-parallel, ``fc2`` row-parallel, see
            :func:`fc1_shard_columns`) and returns partial outputs the caller sums over the
            expert-tensor-parallel group; ``bias2`` is added by rank 0 only, but every rank
            gets its (complete, equal) gradient, so the copies stay equal.
        backend: grouped GEMM backend (``"auto"``, ``"triton"``, ``"torch"``, ``"cutlass"``,
            ``"multistream"``, ``"sequential"``, ``"reference"``, see
            :func:`mtp.ops.grouped_gemm`); the activation kernel uses ``"triton"`` or
            ``"reference"`` when named, else ``"auto"``.
        gradient_accumulation_fusion: the weight gradients of ``weight1``/``weight2`` are added
            to their fp32 ``main_grad`` in the grouped weight-gradient kernel's epilogue
            (Megatron-Core's option of that name; :func:`mtp.ops.grouped_gemm_accumulate_wgrad`):
            the weights must be in the activation dtype (``params_dtype``) and have a
            ``main_grad`` (:class:`mtp.optim.DistributedDataParallel` gives them one).
        bias_activation_fusion: on the ``triton`` backend with ``"gelu"``, ``"swiglu"`` or
            ``"clamped_swiglu"``, run
            the experts as :func:`mtp.ops.grouped_mlp` (Megatron-Core's option of that name,
            extended): fc1's epilogue adds the bias, applies the activation and the probability
            (stores the pre-activation for the backward), fc2's adds its bias, and fc2's
            data-gradient epilogue computes the activation's backward and the probabilities'
            gradient: no elementwise pass over the ``[M, F]`` intermediates. False: the separate
            bias/activation kernel and scaling (also what the other backends and activations
            run).
        params_dtype, device: of the parameters (keep them in the compute dtype, e.g. bf16, with
            an fp32 ``main_grad``: the forward then casts nothing).
        perform_initialization: initialise the weights (see :meth:`reset_parameters`); False
            leaves them uninitialised (for loading a checkpoint).
        expert_offset: the index of this rank's first expert among all experts (set by
            :class:`~mtp.moe.MoELayer`); None: ``ep_rank * num_local_experts`` from
            ``mtp.parallel``'s expert-parallel group. The default of :meth:`load_hf_weights` and
            :meth:`load_full_weights`.

    Parameters: ``weight1 [L, H, F1]`` and ``weight2 [L, F, H]`` (``[E, K, N]``, ``F1 = F`` or
    ``2F``, both divided by ``tp_size``), optional ``bias1``/``bias2``. Hugging Face expert
    weights load with :meth:`load_hf_weights` and come back with :meth:`hf_weights`. They
    carry ``allreduce = False`` (Megatron's marker for expert parameters: reduce their gradients
    over the expert-data-parallel group, not the data-parallel group); with ``tp_size > 1``
    ``weight1``, ``weight2`` and ``bias1`` are marked ``tensor_model_parallel`` (shards over the
    expert-tensor-parallel group, see :mod:`mtp.parallel.params`).
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
        activation_limit: float = 7.0,
        activation_alpha: float = 1.702,
        probs_after_fc2: bool = False,
        gradient_accumulation_fusion: bool = False,
        bias_activation_fusion: bool = True,
        tp_size: int = 1,
        tp_rank: int = 0,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        perform_initialization: bool = True,
        expert_offset: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_local_experts", num_local_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
            ("tp_size", tp_size),
        ):
            check_int(name, value, 1)
        check_int("tp_rank", tp_rank, 0)
        if expert_offset is not None:
            check_int("expert_offset", expert_offset, 0)
        if tp_rank >= tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be < tp_size={tp_size}")
        if ffn_hidden_size % tp_size:
            raise ValueError(
                f"ffn_hidden_size={ffn_hidden_size} must be divisible by the expert tensor "
                f"parallel size tp_size={tp_size}"
            )
        self.config = ExpertsConfig(
            ffn_hidden_size, activation=activation, activation_limit=activation_limit,
            activation_alpha=activation_alpha, bias=bias, probs_after_fc2=probs_after_fc2,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            bias_activation_fusion=bias_activation_fusion, backend=backend,
        )  # fmt: skip
        if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
            raise TypeError(f"params_dtype must be a floating torch.dtype, got {params_dtype!r}")
        self.num_local_experts, self.hidden_size = num_local_experts, hidden_size
        self.ffn_hidden_size, self.activation = ffn_hidden_size, activation
        self.backend, self.add_bias = backend, bool(bias)
        self.activation_limit = float(activation_limit)
        self.activation_alpha = float(activation_alpha)
        self.probs_after_fc2 = probs_after_fc2
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.bias_activation_fusion = bias_activation_fusion
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.expert_offset = expert_offset
        full_fc1 = 2 * ffn_hidden_size if activation in _GATED else ffn_hidden_size
        self.full_fc1_output_size = full_fc1
        fc1_out = full_fc1 // tp_size
        self.fc1_output_size = fc1_out
        local_ffn = ffn_hidden_size // tp_size
        kw = dict(dtype=params_dtype, device=device)
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out, **kw))
        self.weight2 = nn.Parameter(torch.empty(num_local_experts, local_ffn, hidden_size, **kw))
        if self.add_bias:
            self.bias1 = nn.Parameter(torch.empty(num_local_experts, fc1_out, **kw))
            self.bias2 = nn.Parameter(torch.empty(num_local_experts, hidden_size, **kw))
        else:
            self.register_parameter("bias1", None)
            self.register_parameter("bias2", None)
        self._set_parallel_attributes()
        if perform_initialization:
            self.reset_parameters()

    def _set_parallel_attributes(self) -> None:
        """Expert parameters (``allreduce = False``); with ``tp_size > 1`` ``weight1``,
        ``bias1`` (fc1's columns, the two SwiGLU halves sharded alike) and ``weight2`` (fc2's
        rows) are expert-tensor-parallel shards, ``bias2`` is replicated over the group (see
        :mod:`mtp.parallel.params`)."""
        sharded = self.tp_size > 1
        stride = 2 if self.activation == "swiglu" else 1
        set_expert_parallel_attributes(self.weight1, is_parallel=sharded, dim=2, stride=stride)
        set_expert_parallel_attributes(self.weight2, is_parallel=sharded, dim=1)
        if self.add_bias:
            set_expert_parallel_attributes(self.bias1, is_parallel=sharded, dim=1, stride=stride)
            set_expert_parallel_attributes(self.bias2)

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, "
            f"bias={self.add_bias}, backend={self.backend!r}, tp_size={self.tp_size}"
        )

    def _shards(self):
        cols = fc1_shard_columns(self.ffn_hidden_size, self.activation, self.tp_size, self.tp_rank)
        shard = self.ffn_hidden_size // self.tp_size
        rows = slice(self.tp_rank * shard, (self.tp_rank + 1) * shard)
        return cols, rows

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
            fc1 = nn.Linear(self.hidden_size, self.full_fc1_output_size, bias=self.add_bias)
            fc2 = nn.Linear(self.ffn_hidden_size, self.hidden_size, bias=self.add_bias)
            local = e - expert_offset
            if 0 <= local < self.num_local_experts:
                self._load_pair(local, fc1, fc2)

    @torch.no_grad()
    def _load_pair(self, local: int, fc1: nn.Linear, fc2: nn.Linear) -> None:
        cols, rows = self._shards()
        self.weight1[local].copy_(fc1.weight.t()[:, cols])
        self.weight2[local].copy_(fc2.weight.t()[rows])
        if self.add_bias:
            self.bias1[local].copy_(fc1.bias[cols])
            self.bias2[local].copy_(fc2.bias)

    @torch.no_grad()
    def load_full_weights(
        self,
        weight1: torch.Tensor,
        weight2: torch.Tensor,
        bias1: torch.Tensor | None = None,
        bias2: torch.Tensor | None = None,
        expert_offset: int | None = None,
    ) -> None:
        """Copy this rank's experts ``[expert_offset, expert_offset + L)`` and its expert-TP
        shard out of full (all experts, unsharded) ``weight1 [E, H, F1]``, ``weight2 [E, F, H]``
        (and biases ``[E, F1]``, ``[E, H]``) in mtp's layout. ``expert_offset=None``: this
        rank's (see :meth:`default_expert_offset`)."""
        local = self.num_local_experts
        want1 = (self.hidden_size, self.full_fc1_output_size)
        want2 = (self.ffn_hidden_size, self.hidden_size)
        if weight1.dim() != 3 or tuple(weight1.shape[1:]) != want1:
            raise ValueError(f"weight1 must be [E, {want1[0]}, {want1[1]}], got {weight1.shape}")
        if weight2.dim() != 3 or tuple(weight2.shape[1:]) != want2:
            raise ValueError(f"weight2 must be [E, {want2[0]}, {want2[1]}], got {weight2.shape}")
        total = weight1.shape[0]
        if expert_offset is None:
            expert_offset = self.default_expert_offset(total)
        if not 0 <= expert_offset <= total - local or weight2.shape[0] != total:
            raise ValueError(
                f"expert_offset={expert_offset} with {local} local experts does not fit weights of "
                f"{weight1.shape[0]} / {weight2.shape[0]} experts"
            )
        if (bias1 is not None or bias2 is not None) != self.add_bias:
            raise ValueError(f"bias1/bias2 must be given exactly when bias={self.add_bias}")
        cols, rows = self._shards()
        sel = slice(expert_offset, expert_offset + local)
        self.weight1.copy_(weight1[sel][:, :, cols.to(weight1.device)])
        self.weight2.copy_(weight2[sel][:, rows])
        if self.add_bias:
            self.bias1.copy_(bias1[sel][:, cols.to(bias1.device)])
            self.bias2.copy_(bias2[sel])

    def default_expert_offset(self, num_experts: int) -> int:
        """This rank's first expert among ``num_experts``: ``expert_offset`` when set (by
        :class:`~mtp.moe.MoELayer`), else ``ep_rank * num_local_experts`` when ``mtp.parallel``
        is initialised with ``ep_size * num_local_experts == num_experts``, else 0 when this
        layer holds every expert; otherwise ``ValueError`` (pass ``expert_offset``)."""
        if self.expert_offset is not None:
            return self.expert_offset
        local = self.num_local_experts
        from mtp import parallel

        if parallel.model_parallel_is_initialized():
            ep = parallel.get_expert_model_parallel_world_size()
            if ep * local == num_experts:
                return parallel.get_expert_model_parallel_rank() * local
        if num_experts == local:
            return 0
        raise ValueError(
            f"expert_offset: this layer holds {local} of {num_experts} experts and its "
            "expert-parallel rank is not known (no MoELayer, mtp.parallel not initialised or "
            "with another expert-parallel size); pass expert_offset=<index of its first expert>"
        )

    def load_hf_weights(self, expert_offset: int | None = None, **hf) -> None:
        """Load Hugging Face expert weights (all experts; this rank keeps its slice: experts
        ``[expert_offset, expert_offset + L)``, by default this rank's, see
        :meth:`default_expert_offset`), see :func:`mtp.moe.hf_weights.hf_to_grouped` for the
        accepted names and layouts."""
        from mtp.moe.hf_weights import hf_to_grouped

        weights = hf_to_grouped(activation=self.activation, **hf)
        self.load_full_weights(*weights, expert_offset=expert_offset)

    def hf_weights(self, style: str = "stacked_linear") -> dict[str, torch.Tensor]:
        """This rank's experts in a Hugging Face layout (``tp_size == 1`` only), see
        :func:`mtp.moe.hf_weights.grouped_to_hf`."""
        from mtp.moe.hf_weights import grouped_to_hf

        if self.tp_size != 1:
            raise ValueError("hf_weights() needs the unsharded experts (tp_size == 1)")
        return grouped_to_hf(
            self.weight1.detach(), self.weight2.detach(),
            None if self.bias1 is None else self.bias1.detach(),
            None if self.bias2 is None else self.bias2.detach(),
            style=style, activation=self.activation,
        )

    @torch.no_grad()
    def load_linears(self, pairs: list[tuple[nn.Linear, nn.Linear]]) -> None:
        """Copy ``L`` ``(fc1, fc2)`` ``nn.Linear`` pairs into the grouped weights (checkpoint
        loading)."""
        if len(pairs) != self.num_local_experts:
            raise ValueError(f"need {self.num_local_experts} (fc1, fc2) pairs, got {len(pairs)}")
        for local, (fc1, fc2) in enumerate(pairs):
            want1 = (self.full_fc1_output_size, self.hidden_size)
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
            and settings.current().backend not in GROUPED_GEMM_BACKENDS
            and torch_grouped_mm() is not None
        ):
            return "torch"
        return self.backend

    def _accumulates(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether this call adds the gradients of ``weights`` to their ``main_grad`` (gradient-
        accumulation fusion on, autograd recording, one of them trainable); those weights must
        then be in ``x``'s dtype."""
        on = (self.gradient_accumulation_fusion and torch.is_grad_enabled()
              and any(w.requires_grad for w in weights))  # fmt: skip
        for w in weights if on else ():
            if w.dtype != x.dtype:
                raise ValueError(
                    f"gradient_accumulation_fusion needs the expert weights in the activation "
                    f"dtype: weights are {w.dtype}, activations {x.dtype} (params_dtype)"
                )
        return on

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, bias) -> torch.Tensor:
        """``x_e @ w[e] (+ bias[e])`` (the bias in the GEMM's epilogue on the Triton backend)."""
        backend = self.gemm_backend(x.device)
        if self._accumulates(x, w):
            return ops.grouped_gemm_accumulate_wgrad(x, w, counts, backend=backend,
                                                     validate=False, bias=bias)  # fmt: skip
        return grouped_gemm(x, w.to(x.dtype), counts, backend=backend, validate=False, bias=bias)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, H]`` rows grouped by local expert -> ``[M, H]`` expert outputs (each row scaled
        by its probability before ``fc2``). ``tokens_per_expert``: ``[L]`` int32/int64 on the
        device (or CPU). Rows past ``sum(tokens_per_expert)`` produce zeros."""
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
        if self._fused(x):
            return self._forward_fused(x, tokens_per_expert, permuted_probs)
        h = self._gemm(x, self.weight1, tokens_per_expert, self.bias1)
        h = activation_function(
            h, self.activation, self.backend, self.activation_limit, self.activation_alpha
        )
        scale = None if permuted_probs is None else permuted_probs.to(h.dtype).unsqueeze(-1)
        if scale is not None and not self.probs_after_fc2:
            h = h * scale
        y = self._gemm(h, self.weight2, tokens_per_expert, self._fc2_bias())
        if scale is not None and self.probs_after_fc2:
            y = y * scale
        return y

    def _fc2_bias(self) -> torch.Tensor | None:
        """``bias2`` on expert-tensor-parallel rank 0; zeros that pass the gradient to
        ``bias2`` on the others (see :class:`_ZerosWithGrad`)."""
        if self.bias2 is None or self.tp_rank == 0:
            return self.bias2
        return _ZerosWithGrad.apply(self.bias2)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether this call runs :func:`mtp.ops.grouped_mlp` (see ``bias_activation_fusion``)."""
        if not self.bias_activation_fusion or self.activation == "relu2":
            return False
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        backend = self.gemm_backend(x.device)
        names = tuple(GROUPED_GEMM_BACKENDS)
        return resolve_backend("grouped_gemm", backend, x.device, names) == "triton"

    def _forward_fused(self, x, tokens_per_expert, permuted_probs):
        w1, w2 = self.weight1, self.weight2
        accumulate = self._accumulates(x, w1, w2)
        after = self.probs_after_fc2 and permuted_probs is not None
        y = ops.grouped_mlp(
            x, w1.to(x.dtype), w2.to(x.dtype), tokens_per_expert,
            None if after else permuted_probs, self.bias1,
            self._fc2_bias(),
            activation=self.activation, activation_limit=self.activation_limit,
            activation_alpha=self.activation_alpha, gradient_accumulation_fusion=accumulate,
            backend="triton", validate=False,
        )  # fmt: skip
        return y * permuted_probs.to(y.dtype).unsqueeze(-1) if after else y
