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

Initialising and loading the weights (``reset_parameters``, ``load_full_weights``,
``load_hf_weights``, ``hf_weights``, ``load_linears``) and :func:`fc1_shard_columns` live in
:mod:`mtp.moe._grouped_mlp_weights` (``GroupedMLP`` inherits them; the function is importable
from here too).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mtp import ops, settings
from mtp.ops._backend import resolve_backend
from mtp.ops.grouped_mlp import clamped_swiglu
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS, torch_grouped_mm, grouped_gemm
from mtp.moe._grouped_mlp_weights import GroupedMLPWeights, fc1_shard_columns
from mtp.moe.config import ACTIVATIONS, ExpertsConfig
from mtp.ops.grouped_gemm.checks import check_fp8_device
from mtp.ops.grouped_gemm.config import device_arch
from mtp.ops.quantize import Fp8Recipe, Fp8WeightCache
from mtp.ops.quantize.tensor import as_recipe
from mtp.parallel.params import set_expert_parallel_attributes
from mtp.utils import check_int

__all__ = ["GroupedMLP", "fc1_shard_columns"]

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


class GroupedMLP(GroupedMLPWeights, nn.Module):
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
        fp8_recipe: None, ``"blockwise"``, ``"mxfp8"`` or an :class:`~mtp.ops.Fp8Recipe`: both
            GEMMs in FP8 (:func:`mtp.ops.grouped_gemm`'s ``fp8_recipe``): the activations
            quantised on the fly, the output gradient once per GEMM for both of its gradients,
            the weights once per optimizer step (an :class:`~mtp.ops.Fp8WeightCache`: reused
            while a weight's ``_version`` and storage are unchanged and no ``torch.optim``
            step ran). Master weights and their
            gradients stay in ``params_dtype`` (``main_grad`` with
            ``gradient_accumulation_fusion``, any ``params_dtype``); the activation runs
            between the GEMMs. No ``bias`` yet; backend ``"auto"``, ``"triton"`` or
            ``"reference"``; ``"mxfp8"`` needs an sm_100 GPU (or the interpreter on CPU).
            :meth:`set_fp8_recipe` changes it on a built layer.

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
        fp8_recipe: str | Fp8Recipe | None = None,
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
            bias_activation_fusion=bias_activation_fusion, backend=backend, fp8_recipe=fp8_recipe,
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
        self.set_fp8_recipe(fp8_recipe)
        if perform_initialization:
            self.reset_parameters()

    def set_fp8_recipe(self, fp8_recipe: str | Fp8Recipe | None) -> None:
        """Run the two GEMMs with ``fp8_recipe`` (None: in the activation dtype) from now on
        (checked as the constructor's argument; ``"mxfp8"`` refused on a GPU below sm_100)."""
        config = dataclasses.replace(self.config, fp8_recipe=fp8_recipe)
        recipe, device = as_recipe(fp8_recipe), self.weight1.device
        if recipe is not None and device.type == "cuda":
            check_fp8_device(recipe.name, device, device_arch(device)[0])
        self.config, self.fp8_recipe = config, recipe
        self.fp8_weight_cache = None if recipe is None else Fp8WeightCache()

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
            + ("" if self.fp8_recipe is None else f", fp8_recipe={self.fp8_recipe.name!r}")
        )

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
        then be in ``x``'s dtype (FP8 experts: any dtype, the weights are quantised anyway)."""
        on = (self.gradient_accumulation_fusion and torch.is_grad_enabled()
              and any(w.requires_grad for w in weights))  # fmt: skip
        for w in weights if on and self.fp8_recipe is None else ():
            if w.dtype != x.dtype:
                raise ValueError(
                    f"gradient_accumulation_fusion needs the expert weights in the activation "
                    f"dtype: weights are {w.dtype}, activations {x.dtype} (params_dtype)"
                )
        return on

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, bias) -> torch.Tensor:
        """``x_e @ w[e] (+ bias[e])`` (the bias in the GEMM's epilogue on the Triton backend);
        with ``fp8_recipe`` the FP8 grouped GEMM on the master weight (no bias)."""
        if self.fp8_recipe is not None:
            return grouped_gemm(x, w, counts, backend=self.backend, validate=False,
                                fp8_recipe=self.fp8_recipe, fp8_weight_cache=self.fp8_weight_cache,
                                gradient_accumulation_fusion=self._accumulates(x, w))  # fmt: skip
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
        """Whether this call runs :func:`mtp.ops.grouped_mlp` (see ``bias_activation_fusion``;
        FP8 experts too: its FP8 path, tokens quantised once, fc1 writing FP8 activations)."""
        if not self.bias_activation_fusion or self.activation == "relu2":
            return False
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        backend = self.gemm_backend(x.device)
        names = tuple(GROUPED_GEMM_BACKENDS)
        return resolve_backend("grouped_gemm", backend, x.device, names) == "triton"

    def _mlp_weights(self, x: torch.Tensor):
        """``(weight1, weight2, FP8 options)`` of a :func:`mtp.ops.grouped_mlp` call: the
        master weights and the recipe with its cache for FP8 experts (quantised inside, their
        gradients in the master dtype), else the weights in ``x``'s dtype."""
        w1, w2 = self.weight1, self.weight2
        if self.fp8_recipe is None:
            return w1.to(x.dtype), w2.to(x.dtype), {}
        return w1, w2, dict(fp8_recipe=self.fp8_recipe, fp8_weight_cache=self.fp8_weight_cache)

    def _forward_fused(self, x, tokens_per_expert, permuted_probs):
        w1, w2, fp8 = self._mlp_weights(x)
        accumulate = self._accumulates(x, self.weight1, self.weight2)
        after = self.probs_after_fc2 and permuted_probs is not None
        y = ops.grouped_mlp(
            x, w1, w2, tokens_per_expert,
            None if after else permuted_probs, self.bias1,
            self._fc2_bias(),
            activation=self.activation, activation_limit=self.activation_limit,
            activation_alpha=self.activation_alpha, gradient_accumulation_fusion=accumulate,
            backend="triton", validate=False, **fp8,
        )  # fmt: skip
        return y * permuted_probs.to(y.dtype).unsqueeze(-1) if after else y

    def forward_gathered(self, tokens, tokens_per_expert, probs, gather_index, token_map,
                         scatter_index=None):  # fmt: skip
        """The experts on rows read through a row map (the MoE dispatch fused into fc1, see
        :mod:`mtp.moe.gathered`): ``tokens [T, H]``, ``probs [T, E]`` (or ``[T]``),
        ``gather_index [M]`` (the token of each expert-major row, ``-1``: none) and its
        ``token_map``; returns the ``[M, H]`` rows, each scaled by its probability before fc2
        (row ``r`` at ``scatter_index[r]`` when given). Fused Triton experts only
        (:meth:`_fused`)."""
        w1, w2, fp8 = self._mlp_weights(tokens)
        return ops.grouped_mlp(
            tokens, w1, w2, tokens_per_expert, probs,
            self.bias1, self._fc2_bias(), activation=self.activation,
            activation_limit=self.activation_limit, activation_alpha=self.activation_alpha,
            gradient_accumulation_fusion=self._accumulates(tokens, self.weight1, self.weight2),
            backend="triton", validate=False, gather_index=gather_index, token_map=token_map,
            scatter_index=scatter_index, **fp8,
        )  # fmt: skip
