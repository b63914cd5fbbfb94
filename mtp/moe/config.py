"""Configuration of the MoE layer as nested frozen dataclasses, each checked in
``__post_init__`` (``TypeError``/``ValueError`` naming the field):

- :class:`RouterConfig`: :class:`~mtp.moe.TopKRouter`'s routing and losses;
- :class:`ExpertsConfig`: :class:`~mtp.moe.GroupedMLP`'s MLP and kernels;
- :class:`DispatcherConfig`: the token dispatcher's;
- :class:`MoEConfig`: the layer: one of each, the shared expert, sequence parallelism and the
  parameters' dtype/device/initialisation, checked against each other.

Field names are the layers' argument names, which follow Megatron-Core (each field's comment
names the ``TransformerConfig`` field it stands for). :meth:`MoEConfig.from_flat` builds the
whole from :class:`~mtp.moe.MoELayer`'s flat keyword form. Process groups are not
configuration: they travel in a :class:`mtp.parallel.dims.ParallelDims`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mtp.moe._checks import check_bool, check_device, check_float_dtype
from mtp.moe.load_balancing import LOAD_BALANCING_TYPES
from mtp.moe.routing import check_routing_config
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS
from mtp.ops.quantize import Fp8Recipe
from mtp.ops.quantize.tensor import as_recipe
from mtp.utils import check_int

__all__ = ["DispatcherConfig", "ExpertsConfig", "MoEConfig", "RouterConfig"]

ACTIVATIONS = ("gelu", "swiglu", "clamped_swiglu", "relu2")
#: Backends of the layer's kernels: the permutation's and the grouped GEMM's names.
LAYER_BACKENDS = tuple(dict.fromkeys(("auto", "reference", *GROUPED_GEMM_BACKENDS)))
DISPATCHERS = ("alltoall", "allgather")
#: the expert backends of FP8 experts (the FP8 grouped GEMM's)
FP8_BACKENDS = ("auto", "triton", "reference")


def check_coeff(name: str, value) -> float:
    """A finite number >= 0, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def load_balancing_coeffs(load_balancing_type, aux_loss_coeff) -> dict[str, float]:
    """``{type: coeff}`` from Megatron's ``moe_router_load_balancing_type`` (a name or a list)
    and ``moe_aux_loss_coeff`` (a number or a list of the same length)."""
    types = [load_balancing_type] if isinstance(load_balancing_type, str) else load_balancing_type
    if not isinstance(types, (list, tuple)) or not types:
        raise TypeError(
            f"load_balancing_type must be a name or a list of names from "
            f"{LOAD_BALANCING_TYPES}, got {load_balancing_type!r}"
        )
    for t in types:
        if t not in LOAD_BALANCING_TYPES + ("none",):
            raise ValueError(
                f"load_balancing_type must be among {LOAD_BALANCING_TYPES} (or 'none'), got {t!r}"
            )
    coeffs = aux_loss_coeff if isinstance(aux_loss_coeff, (list, tuple)) else [aux_loss_coeff]
    if len(coeffs) == 1 and len(types) > 1:
        coeffs = list(coeffs) * len(types)
    if len(coeffs) != len(types):
        raise ValueError(
            f"aux_loss_coeff has {len(coeffs)} values for {len(types)} load_balancing_type "
            "entries (give one coefficient per type)"
        )
    out: dict[str, float] = {}
    for t, c in zip(types, coeffs):
        c = check_coeff("aux_loss_coeff", c)
        if t != "none" and c > 0:
            out[t] = out.get(t, 0.0) + c
    return out


def check_backend(backend) -> str:
    """One of :data:`LAYER_BACKENDS`."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend not in LAYER_BACKENDS:
        raise ValueError(f"backend must be one of {LAYER_BACKENDS}, got {backend!r}")
    return backend


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """What :class:`~mtp.moe.TopKRouter` computes (see its docstring for each field)."""

    num_experts: int  # num_moe_experts
    topk: int  # moe_router_topk
    score_function: str = "softmax"  # moe_router_score_function
    pre_softmax: bool = False  # moe_router_pre_softmax
    norm_topk_prob: bool | None = None
    aux_loss_coeff: float | list[float] = 0.0  # moe_aux_loss_coeff
    load_balancing_type: str | list[str] = "aux_loss"  # moe_router_load_balancing_type
    z_loss_coeff: float = 0.0  # moe_z_loss_coeff
    expert_bias: bool = False  # moe_router_enable_expert_bias
    router_bias: bool = False
    capacity_factor: float | None = None  # moe_expert_capacity_factor
    drop_policy: str = "probs"  # moe_token_drop_policy
    num_groups: int | None = None  # moe_router_num_groups
    group_topk: int | None = None  # moe_router_group_topk
    group_score: str = "topk"
    scaling_factor: float | None = None  # moe_router_topk_scaling_factor
    input_jitter_eps: float | None = None  # moe_input_jitter_eps
    router_dtype: torch.dtype | None = None  # moe_router_dtype
    layer_number: int | None = None
    num_layers: int | None = None
    init_std: float = 0.02  # init_method_std
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_routing_config(
            self.num_experts, self.topk, self.score_function, self.capacity_factor,
            self.drop_policy, self.num_groups, self.group_topk,
            norm_topk_prob=self.norm_topk_prob, group_score=self.group_score,
            pre_softmax=self.pre_softmax, scaling_factor=self.scaling_factor,
        )  # fmt: skip
        if self.router_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(
                "router_dtype must be None, torch.float32 or torch.float64, got "
                f"{self.router_dtype}"
            )
        for name in ("pre_softmax", "expert_bias", "router_bias"):
            check_bool(name, getattr(self, name))
        if self.input_jitter_eps is not None:
            eps = check_coeff("input_jitter_eps", self.input_jitter_eps)
            if not 0 < eps < 1:
                raise ValueError(f"input_jitter_eps must be in (0, 1), got {eps}")
        check_coeff("init_std", self.init_std)
        if (self.layer_number is None) != (self.num_layers is None):
            raise ValueError("layer_number and num_layers must be given together (loss logging)")
        if self.layer_number is not None:
            check_int("num_layers", self.num_layers, 1)
            check_int("layer_number", self.layer_number, 1)
            if self.layer_number > self.num_layers:
                raise ValueError(
                    f"layer_number={self.layer_number} must be <= num_layers={self.num_layers}"
                )
        load_balancing_coeffs(self.load_balancing_type, self.aux_loss_coeff)
        check_coeff("z_loss_coeff", self.z_loss_coeff)
        check_backend(self.backend)

    @property
    def load_balancing(self) -> dict[str, float]:
        """``{load-balancing type: coefficient}`` of the enabled losses."""
        return load_balancing_coeffs(self.load_balancing_type, self.aux_loss_coeff)


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """What :class:`~mtp.moe.GroupedMLP` computes and with which kernels (see its docstring)."""

    ffn_hidden_size: int  # moe_ffn_hidden_size
    activation: str = "gelu"  # activation_func / gated_linear_unit
    activation_limit: float = 7.0
    activation_alpha: float = 1.702
    bias: bool = False  # add_bias_linear
    probs_after_fc2: bool = False  # not moe_apply_probs_on_input
    gradient_accumulation_fusion: bool = False  # gradient_accumulation_fusion
    bias_activation_fusion: bool = True  # bias_activation_fusion
    backend: str = "auto"
    fp8_recipe: str | Fp8Recipe | None = None  # fp8_recipe ("blockwise", "mxfp8")

    def __post_init__(self) -> None:
        check_int("ffn_hidden_size", self.ffn_hidden_size, 1)
        recipe = as_recipe(self.fp8_recipe)  # a bad name raises, naming fp8_recipe
        if recipe is not None and self.bias:
            raise ValueError("fp8_recipe with bias=True: the FP8 grouped GEMM has no bias "
                             "epilogue yet; use bias=False or fp8_recipe=None")  # fmt: skip
        if recipe is not None and self.backend not in FP8_BACKENDS:
            raise ValueError(f"fp8_recipe runs on backend {FP8_BACKENDS}, got "
                             f"{self.backend!r}")  # fmt: skip
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for name in ("activation_limit", "activation_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("bias", "probs_after_fc2", "gradient_accumulation_fusion",
                     "bias_activation_fusion"):  # fmt: skip
            check_bool(name, getattr(self, name))
        check_backend(self.backend)


@dataclasses.dataclass(frozen=True)
class DispatcherConfig:
    """How tokens reach the experts (:class:`~mtp.moe.AllToAllTokenDispatcher`,
    :class:`~mtp.moe.AllGatherTokenDispatcher`).

    Fields:
        num_experts: ``E``, all experts; rank ``r`` of the expert-parallel group holds experts
            ``[r * L, (r + 1) * L)``.
        topk: experts per token.
        token_dispatcher_type: ``"alltoall"`` (Megatron's default) or ``"allgather"`` (every
            rank gathers all tokens and keeps its experts' rows; static shapes; for small EP);
            which class :class:`~mtp.moe.MoELayer` builds.
        capacity_factor: None for dropless; else every expert has
            ``C = min(ceil(T * topk / E * capacity_factor), T)`` slots (padded with empty rows),
            which makes every shape and split static (no host sync, graph-safe). All ranks of
            the group must then see the same token count ``T``.
        backend: for the permute/unpermute kernels: ``"auto"``, ``"triton"`` or
            ``"reference"`` (other names: ``"auto"``).
        check_ranks: check that the ranks agree on the hidden size, the dtypes and (with a
            capacity) the token count before exchanging tokens, raising
            :class:`~mtp.parallel.errors.RankMismatchError` on every rank instead of letting
            the collective fail. Dropless all-to-all folds the check into the count exchange
            and its one host sync (free, every dispatch). With a capacity (no count exchange,
            no host sync) it costs one tiny all-to-all and a device-side assert (no host sync;
            on CPU it raises at once; ``MTP_VALIDATE=sync`` gives the typed error naming the
            values after a sync): ``None`` (default) checks the first dispatch only, or every
            dispatch under ``MTP_CHECK_COLLECTIVES=1``; ``True`` every dispatch; ``False``
            never. Skipped while capturing or compiling.
    """

    num_experts: int  # num_moe_experts
    topk: int  # moe_router_topk
    token_dispatcher_type: str = "alltoall"  # moe_token_dispatcher_type
    capacity_factor: float | None = None  # moe_expert_capacity_factor
    backend: str = "auto"
    check_ranks: bool | None = None

    def __post_init__(self) -> None:
        check_int("num_experts", self.num_experts, 1)
        check_int("topk", self.topk, 1)
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} must be <= num_experts={self.num_experts}")
        if self.token_dispatcher_type not in DISPATCHERS:
            raise ValueError(
                f"token_dispatcher_type must be one of {DISPATCHERS}, got "
                f"{self.token_dispatcher_type!r}"
            )
        if self.check_ranks not in (None, True, False):
            raise TypeError(f"check_ranks must be None, True or False, got {self.check_ranks!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str, got {type(self.backend).__name__}")


_ROUTER_FIELDS = tuple(f.name for f in dataclasses.fields(RouterConfig))
_EXPERT_FIELDS = tuple(f.name for f in dataclasses.fields(ExpertsConfig))
_DISPATCH_FIELDS = tuple(f.name for f in dataclasses.fields(DispatcherConfig))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The whole :class:`~mtp.moe.MoELayer` (see its docstring for each field)."""

    hidden_size: int  # hidden_size
    router: RouterConfig
    experts: ExpertsConfig
    dispatcher: DispatcherConfig
    shared_expert_intermediate_size: int | None = None  # moe_shared_expert_intermediate_size
    shared_expert_gate: bool = False  # moe_shared_expert_gate
    sequence_parallel: bool = False  # sequence_parallel
    params_dtype: torch.dtype = torch.float32  # params_dtype
    device: torch.device | str | None = None
    perform_initialization: bool = True  # perform_initialization

    def __post_init__(self) -> None:
        check_int("hidden_size", self.hidden_size, 1)
        for name, kind in (("router", RouterConfig), ("experts", ExpertsConfig),
                           ("dispatcher", DispatcherConfig)):  # fmt: skip
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        r, d = self.router, self.dispatcher
        for name in ("num_experts", "topk", "capacity_factor"):
            if getattr(r, name) != getattr(d, name):
                raise ValueError(
                    f"router.{name}={getattr(r, name)!r} and dispatcher.{name}="
                    f"{getattr(d, name)!r} must be equal"
                )
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.shared_expert_intermediate_size is None and self.shared_expert_gate:
            raise ValueError("shared_expert_gate=True needs shared_expert_intermediate_size")
        if self.shared_expert_intermediate_size is not None:
            check_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size, 1)
        check_bool("shared_expert_gate", self.shared_expert_gate)
        check_bool("perform_initialization", self.perform_initialization)
        check_float_dtype("params_dtype", self.params_dtype)
        check_device("device", self.device)

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def topk(self) -> int:
        return self.router.topk

    @classmethod
    def from_flat(
        cls, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int, **kwargs
    ) -> MoEConfig:
        """The config of ``MoELayer(hidden_size, ffn_hidden_size, num_experts, topk,
        **kwargs)``: each keyword goes to the sub-config that has a field of its name
        (``capacity_factor`` to two of them, ``backend`` to all three), the rest to the layer's."""
        layer = {f.name for f in dataclasses.fields(cls)} - {"router", "experts", "dispatcher"}
        known = set(_ROUTER_FIELDS) | set(_EXPERT_FIELDS) | set(_DISPATCH_FIELDS) | layer
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"MoELayer got unexpected keyword argument(s) {unknown}")
        common = dict(num_experts=num_experts, topk=topk)

        def pick(names) -> dict:
            return {k: v for k, v in kwargs.items() if k in names}

        return cls(
            hidden_size=hidden_size,
            router=RouterConfig(**common, **pick(_ROUTER_FIELDS)),
            experts=ExpertsConfig(ffn_hidden_size, **pick(_EXPERT_FIELDS)),
            dispatcher=DispatcherConfig(**common, **pick(_DISPATCH_FIELDS)),
            **pick(layer - {"hidden_size"}),
        )
