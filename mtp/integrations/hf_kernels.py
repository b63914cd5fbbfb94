"""mtp's kernels inside a Hugging Face causal LM in one call: :func:`apply_kernels`.

What changes (in place, on this model instance only; other instances of the class keep HF's
code):

- **Loss**: the ``*ForCausalLM`` forward computes the loss with
  :func:`mtp.ops.linear_cross_entropy` straight from the final hidden states and ``lm_head``'s
  weight (HF's label shift, ``ignore_index``, ``shift_labels`` and ``num_items_in_batch``
  honoured). In training mode with labels no logits are materialised (``output.logits`` is
  None, as Liger-Kernel does); in eval mode or without labels the logits are computed as
  before. At tp > 1 the weight is this rank's vocab shard: only per-row statistics cross the
  ranks, and targets that differ between tensor-parallel ranks fail (the op's agreement check).
- **Dense SwiGLU MLPs** (``gate_proj``/``up_proj``/``down_proj`` with SiLU): both projections
  write into the two halves of one ``[..., 2F]`` buffer (no concatenation of weights or
  activations), then :func:`mtp.ops.bias_swiglu`, then ``down_proj``.
- **MoE blocks** (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): :class:`mtp.moe.MoELayer` with the
  grouped experts (:mod:`mtp.integrations.hf_moe`); ``output_router_logits`` (argument or
  config) returns the router logits of every layer and adds the family's
  ``load_balancing_loss_func`` times ``router_aux_loss_coef`` to the loss, as HF does (an MoE
  family whose blocks are not swapped, such as OLMoE, keeps HF's routers and the same loss;
  DeepSeek-V3, whose HF forward has no such loss, returns the logits only).
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from mtp.ops.bias_act import bias_swiglu
from mtp.ops.linear_cross_entropy import linear_cross_entropy
from mtp.ops.quantize.tensor import as_recipe
from mtp.utils import qualified_name

__all__ = ["apply_kernels", "apply_kernels_to_model", "gate_up_swiglu"]

_STATE = "_mtp_kernels"
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


# --------------------------------------------------------------------------------------------
# SwiGLU on separate gate / up projections
# --------------------------------------------------------------------------------------------


class _GateUpLinear(torch.autograd.Function):
    """``[x @ w_gate^T + b_gate | x @ w_up^T + b_up]`` written into one ``[..., 2F]`` buffer:
    the two GEMMs store into its column halves (strided outputs, no copy)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate, b_up):
        x2 = x.reshape(-1, x.shape[-1])
        f = w_gate.shape[0]
        h = x2.new_empty(x2.shape[0], f + w_up.shape[0])
        for w, b, out in ((w_gate, b_gate, h[:, :f]), (w_up, b_up, h[:, f:])):
            if b is None:
                torch.mm(x2, w.t(), out=out)
            else:
                torch.addmm(b, x2, w.t(), out=out)
        ctx.save_for_backward(x2, w_gate, w_up)
        ctx.x_shape = x.shape
        return h.view(*x.shape[:-1], h.shape[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        x2, w_gate, w_up = ctx.saved_tensors
        f = w_gate.shape[0]
        dh = dh.reshape(-1, dh.shape[-1])
        dg, du = dh[:, :f], dh[:, f:]
        need = ctx.needs_input_grad
        dx = torch.addmm(dg.mm(w_gate), du, w_up).view(ctx.x_shape) if need[0] else None
        dwg = dg.t().mm(x2) if need[1] else None
        dwu = du.t().mm(x2) if need[2] else None
        dbg = dg.sum(0) if need[3] else None
        dbu = du.sum(0) if need[4] else None
        return dx, dwg, dwu, dbg, dbu


def gate_up_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)`` for ``x [..., H]``, ``w_* [F, H]``
    (``nn.Linear`` layout, kept separate): one ``[..., 2F]`` buffer filled by the two GEMMs,
    then :func:`mtp.ops.bias_swiglu` on it. Returns ``[..., F]`` in ``x``'s dtype (the
    autocast dtype under autocast)."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 2 or w_gate.shape[1] != x.shape[-1]:
        raise ValueError(
            f"w_gate and w_up must both be [F, {x.shape[-1]}], got {tuple(w_gate.shape)} and "
            f"{tuple(w_up.shape)}"
        )
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    tensors = [None if t is None else t.to(dtype) for t in (x, w_gate, w_up, b_gate, b_up)]
    return bias_swiglu(_GateUpLinear.apply(*tensors))


def _linear_parts(layer: nn.Module):
    """``(weight, bias)`` of an ``nn.Linear`` or of a column-parallel sibling that is a plain
    local GEMM (the parent module entered the tensor-parallel region); None otherwise."""
    from mtp.tensor_parallel.layers import ColumnParallelLinear

    if isinstance(layer, ColumnParallelLinear):
        if layer.disable_grad_reduce and not layer.gather_output and not layer.skip_bias_add:
            return layer.weight, layer.bias
        return None
    if type(layer) is nn.Linear:
        return layer.weight, layer.bias
    return None


def _swiglu_mlp_forward(self, x):
    (wg, bg), (wu, bu) = _linear_parts(self.gate_proj), _linear_parts(self.up_proj)
    return self.down_proj(gate_up_swiglu(x, wg, wu, bg, bu))


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _patch_mlps(model: nn.Module) -> list[str]:
    names = []
    for name, module in model.named_modules():
        parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None for p in parts) or not _is_silu(getattr(module, "act_fn", None)):
            continue
        if _linear_parts(parts[0]) is None or _linear_parts(parts[1]) is None:
            continue
        module.forward = types.MethodType(_swiglu_mlp_forward, module)
        names.append(name)
    return names


# --------------------------------------------------------------------------------------------
# Load-balancing loss (output_router_logits)
# --------------------------------------------------------------------------------------------


def _aux_loss(model, router_logits, attention_mask):
    """The family's ``load_balancing_loss_func`` on the router logits, as its causal LM forward
    computes it; None for a family whose HF forward has none (DeepSeek-V3)."""
    func = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if func is None:
        return None
    experts = getattr(model, "num_experts", None) or model.config.num_experts
    return func(router_logits, experts, model.num_experts_per_tok, attention_mask)


# --------------------------------------------------------------------------------------------
# The causal LM forward
# --------------------------------------------------------------------------------------------


def _fused_loss(model, hidden, labels, state, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None):  # fmt: skip
    if shift_labels is None:  # HF's shift: position i predicts label i + 1
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(device=hidden.device, dtype=torch.int64)
    head = model.lm_head
    weight = head.weight.to(hidden.dtype)
    bias = None if head.bias is None else head.bias.to(hidden.dtype)
    sp = state["sequence_parallel"]
    if sp:  # mtp's sequence dim is 0; HF's hidden states are [b, s / tp, h]
        hidden, target = hidden.transpose(0, 1), target.transpose(0, 1)
    loss = linear_cross_entropy(
        hidden, weight, target, group=state["group"], bias=bias, ignore_index=int(ignore_index),
        reduction="mean" if num_items_in_batch is None else "sum", sequence_parallel=sp,
    )  # fmt: skip
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _output_class(model, moe: bool):
    from transformers import modeling_outputs

    name = "MoeCausalLMOutputWithPast" if moe else "CausalLMOutputWithPast"
    return getattr(modeling_outputs, name)


def _causal_lm_forward(self, *args, **kwargs):
    state = getattr(self, _STATE)
    bound = state["signature"].bind(*args, **kwargs)
    a = dict(bound.arguments)
    extra = dict(a.pop(state["var_kw"], {}) or {}) if state["var_kw"] else {}
    labels = a.pop("labels", None)
    logits_to_keep = a.pop("logits_to_keep", 0)
    return_dict = extra.pop("return_dict", None)
    want_router = a.pop("output_router_logits", extra.pop("output_router_logits", None))
    if want_router is None:
        want_router = bool(getattr(self.config, "output_router_logits", False))
    if state["moe"]:  # HF's routers, or the swapped blocks, record into outputs.router_logits
        a["output_router_logits"] = want_router
    loss_kwargs = {k: extra.pop(k) for k in _LOSS_KWARGS if k in extra}
    outputs = self.model(**a, **extra)
    hidden = outputs.last_hidden_state
    loss = logits = None
    fused = state["fused_loss"]
    if labels is not None and fused:
        loss = _fused_loss(self, hidden, labels, state, **loss_kwargs)
    if labels is None or not self.training or not fused:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        if labels is not None and not fused:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **loss_kwargs)
    fields = dict(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                  attentions=outputs.attentions)  # fmt: skip
    for name in ("cache", "past_key_values"):
        if hasattr(outputs, name):
            fields[name] = getattr(outputs, name)
    if want_router and state["moe"]:
        router_logits = outputs.router_logits
        aux = _aux_loss(self, router_logits, a.get("attention_mask"))
        fields.update(aux_loss=aux, router_logits=router_logits)
        if loss is not None and aux is not None:
            fields["loss"] = loss + self.router_aux_loss_coef * aux.to(loss.device)
    cls = state["output_class"]
    allowed = set(cls.__dataclass_fields__)
    out = cls(**{k: v for k, v in fields.items() if k in allowed})
    if return_dict is False or (return_dict is None and not self.config.use_return_dict):
        return out.to_tuple()
    return out


def _patch_causal_lm(model: nn.Module, group, sequence_parallel: bool, fused_loss: bool) -> None:
    from .hf_moe import HFMoEBlock

    original = type(model).forward
    signature = inspect.signature(original)
    params = list(signature.parameters.values())[1:]  # without self
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    # an MoE model: swapped blocks, or HF's own (a family mtp does not swap, e.g. OLMoE)
    moe = "output_router_logits" in signature.parameters or any(
        isinstance(m, HFMoEBlock) for m in model.modules()
    )
    state = dict(
        signature=signature.replace(parameters=params), var_kw=var_kw, group=group,
        sequence_parallel=sequence_parallel, fused_loss=fused_loss, moe=moe,
        output_class=_output_class(model, moe),
    )  # fmt: skip
    setattr(model, _STATE, state)

    def forward(self, *args, **kwargs):
        return _causal_lm_forward(self, *args, **kwargs)

    # Trainer and generate() read the forward's parameters (dataset columns, loss kwargs)
    forward.__signature__ = signature
    forward.__doc__ = original.__doc__
    model.forward = types.MethodType(forward, model)


def apply_kernels_to_model(model: nn.Module, group, *, sequence_parallel: bool,
                           fused_loss: bool) -> dict:  # fmt: skip
    """Patch ``model`` (already parallelized over ``group`` when ``group`` is not None): the
    SwiGLU MLPs and the causal LM forward. Returns ``{"mlps": [names]}``."""
    mlps = _patch_mlps(model)
    _patch_causal_lm(model, group, sequence_parallel, fused_loss)
    return {"mlps": mlps}


# --------------------------------------------------------------------------------------------
# apply_kernels
# --------------------------------------------------------------------------------------------


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"apply_kernels: {name} must be a bool, got {value!r}")
    return value


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"apply_kernels: {name} must be a positive int, got {value!r}")
    return value


def apply_kernels(
    model: nn.Module,
    *,
    tp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    fused_loss: bool = True,
    fp8_recipe: str | None = None,
) -> nn.Module:
    """Run a Hugging Face causal LM on mtp's kernels (and layers at ``tp > 1``), in place.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` of a supported family
            (:data:`mtp.integrations.hf.SUPPORTED_FAMILIES`; at ``tp=1`` any Llama-like causal
            LM: what is not recognised keeps HF's code), with the same weights on every rank.
        tp: tensor-parallel size. 1: no ``torch.distributed`` needed. > 1:
            :func:`~mtp.integrations.hf.parallelize_hf` over ``mtp.parallel``'s tensor-parallel
            group first (call :func:`mtp.parallel.initialize_model_parallel` before).
        ep: expert-parallel size of an MoE family. At ``tp=1``: the experts are split over
            ``mtp.parallel``'s expert-parallel group (data-parallel ranks: each routes its own
            batch, tokens travel by all-to-all). At ``tp > 1``: ``tp`` (or 1, the same) splits
            the experts over the tensor-parallel group; a multiple of ``tp`` over
            ``mtp.parallel``'s expert-parallel group of that size (whole tensor-parallel groups
            of several data-parallel replicas; ``expert_tensor_parallel_size=1``).
        sequence_parallel: Megatron sequence parallelism (``tp > 1``, Llama-like families).
        fused_loss: compute the loss with :func:`mtp.ops.linear_cross_entropy` (vocab-parallel
            at ``tp > 1``); False keeps HF's loss on the logits.
        fp8_recipe: None, ``"blockwise"`` or ``"mxfp8"`` (or an :class:`mtp.ops.Fp8Recipe`):
            the swapped MoE blocks' expert GEMMs in FP8 (:class:`mtp.moe.GroupedMLP`'s
            ``fp8_recipe``; the weights stay in the model's dtype). Needs an MoE family that
            is swapped.

    Returns:
        ``model``. Its ``state_dict()`` is the full HF state dict (HF names and layouts;
        collective when the model is split) and ``load_state_dict`` takes one, so
        ``save_pretrained`` / ``from_pretrained`` round-trip
        (:func:`~mtp.integrations.hf_state.attach_hf_state`); train it with
        :class:`mtp.integrations.hf.Trainer`.

    Raises:
        ValueError: bad sizes, ``ep`` or ``fp8_recipe`` without an MoE family (``ep``: or
            without ``mtp.parallel``'s expert group of that size), a model that is already
            patched, ``"mxfp8"`` on a GPU below sm_100.
        TypeError: a model that is not a causal LM, non-bool flags.
    """
    from .hf_moe import MOE_BLOCKS, swap_moe_blocks
    from .hf_parallel import expert_group, parallelize_hf
    from .hf_state import _INFO, _num_experts, attach_hf_state

    tp, ep = _check_size("tp", tp), _check_size("ep", ep)
    as_recipe(fp8_recipe)  # a bad name raises before the model changes
    sequence_parallel = _check_flag("sequence_parallel", sequence_parallel)
    fused_loss = _check_flag("fused_loss", fused_loss)
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or not hasattr(model, "model"):
        raise TypeError(
            f"apply_kernels: model must be a transformers *ForCausalLM (with .model and "
            f".lm_head), got {qualified_name(model)}"
        )
    if hasattr(model, _STATE):
        raise ValueError("apply_kernels: the kernels are already applied to this model")
    family = getattr(getattr(model, "config", None), "model_type", None)
    moe = any(type(m).__name__ in MOE_BLOCKS for m in model.modules())
    for name, value in (("ep", ep), ("fp8_recipe", fp8_recipe)):
        if value not in (1, None) and not moe:
            raise ValueError(
                f"apply_kernels: {name}={value!r} needs a mixture-of-experts model "
                f"({sorted(MOE_BLOCKS)} blocks); {qualified_name(model)} has none"
            )
    if tp > 1:
        if moe and ep != 1 and ep % tp:
            raise ValueError(
                f"apply_kernels: at tp={tp} the experts are split over whole tensor-parallel "
                f"groups, so ep must be 1 (the same as {tp}), {tp} or a multiple of it, got {ep}"
            )
        parallelize_hf(model, tp, sequence_parallel=sequence_parallel,
                       ep=max(ep, tp) if moe else None)  # fmt: skip
        group = getattr(model, _INFO)["group"]
    else:
        if sequence_parallel:
            raise ValueError("apply_kernels: sequence_parallel=True needs tp > 1")
        if hasattr(model, _INFO):
            raise ValueError(
                "apply_kernels: the model is already parallelized; call apply_kernels on the "
                "plain model with tp=... (it runs parallelize_hf itself)"
            )
        ep_group = expert_group(ep, "apply_kernels") if ep > 1 else None
        renames = swap_moe_blocks(model, ep_group, sequence_parallel=False,
                                  split_tokens=False) if moe else {}  # fmt: skip
        group = None
        info = {"group": None, "ep_group": ep_group, "family": family, "conv1d": set(),
                "renames": renames, "num_experts": _num_experts(model.config)}  # fmt: skip
        attach_hf_state(model, info)
    if fp8_recipe is not None:
        _set_fp8_recipe(model, fp8_recipe)
    apply_kernels_to_model(model, group, sequence_parallel=sequence_parallel,
                           fused_loss=fused_loss)  # fmt: skip
    return model


def _set_fp8_recipe(model: nn.Module, fp8_recipe) -> None:
    """``fp8_recipe`` on the experts of every swapped MoE block."""
    from .hf_moe import HFMoEBlock

    for block in model.modules():
        if isinstance(block, HFMoEBlock):
            block.set_fp8_recipe(fp8_recipe)
