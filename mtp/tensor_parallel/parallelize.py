"""Tensor-parallelise an existing model: swap its ``nn.Linear`` / ``nn.Embedding`` submodules
for parallel layers holding this rank's shard of the same weights.

::

    plan = {
        "transformer.wte": "vocab",
        "*.attn.c_attn": {"style": "column", "stride": 3},   # fused [q; k; v]
        "*.attn.c_proj": "row",
        "*.mlp.c_fc": "column",
        "*.mlp.c_proj": "row",
        "lm_head": {"style": "column", "gather_output": True},
    }
    parallelize(model, plan)          # after mtp.parallel.initialize_model_parallel(...)

The model's own code keeps running; between a column layer and the following row layer it
sees this rank's part of the features, so it must take per-rank sizes from the tensors
(``q.view(B, T, -1, head_dim)``), not from the full ``n_head`` / ``n_embd``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .siblings import scatter_module_input, share_module_input
from .utils import group_rank_and_size, mark_sequence_parallel_parameters, shard

__all__ = ["STYLES", "from_embedding", "from_linear", "parallelize"]

STYLES = ("column", "row", "vocab", "shared_input", "scatter_sequence")
_HOOK_STYLES = ("shared_input", "scatter_sequence")

_LINEAR_OPTIONS = {
    "column": {
        "gather_output",
        "skip_bias_add",
        "sequence_parallel",
        "seq_dim",
        "stride",
        "disable_grad_reduce",
    },
    "row": {"input_is_parallel", "skip_bias_add", "sequence_parallel", "seq_dim", "stride"},
}
_EMBEDDING_OPTIONS = {"sequence_parallel", "seq_dim", "validate"}
_HOOK_OPTIONS = {
    "shared_input": {"sequence_parallel", "seq_dim", "arg"},
    "scatter_sequence": {"sequence_parallel", "seq_dim", "arg"},
}


def _check_options(what: str, given: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise TypeError(f"{what}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")


def _shard_param(
    source: torch.Tensor, dim: int, blocks: list[int], rank: int, world: int, memo: dict | None
) -> nn.Parameter:
    """A Parameter holding this rank's shard of ``source`` (shared when ``source`` was tied)."""
    key = (id(source), dim, tuple(blocks))
    if memo is not None and key in memo:
        return memo[key]
    with torch.no_grad():
        data = shard(source.detach(), dim, blocks, rank, world) if world > 1 else source.detach()
        param = nn.Parameter(data.clone(), requires_grad=source.requires_grad)
    if memo is not None:
        memo[key] = param
    return param


def from_linear(
    linear: nn.Linear,
    style: str = "column",
    group: dist.ProcessGroup | None = None,
    *,
    _memo: dict | None = None,
    **options: Any,
) -> ColumnParallelLinear | RowParallelLinear:
    """The parallel layer holding this rank's shard of ``linear``'s weight and bias.

    Args:
        linear: an ``nn.Linear`` (same weights on every rank of the group).
        style: ``"column"`` (split output features; :class:`ColumnParallelLinear`) or
            ``"row"`` (split input features; :class:`RowParallelLinear`).
        group: the tensor-parallel group (default: ``mtp.parallel``'s).
        options: passed to the layer: ``gather_output``, ``input_is_parallel``,
            ``skip_bias_add``, ``sequence_parallel``, ``seq_dim``, ``stride`` (for a fused
            weight: 3 for ``[q; k; v]``, or the block sizes).

    The result has ``linear``'s dtype, device and ``requires_grad``; its forward equals
    ``linear``'s (column: on this rank's output features unless ``gather_output``).
    """
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
    if style not in _LINEAR_OPTIONS:
        raise ValueError(f"from_linear: style must be 'column' or 'row', got {style!r}")
    _check_options(f"from_linear(style={style!r})", options, _LINEAR_OPTIONS[style])
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    weight = linear.weight
    layer = cls(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        perform_initialization=False,
        group=group,
        dtype=weight.dtype,
        device=weight.device,
        **options,
    )
    dim = layer.partition_dim
    layer.weight = _shard_param(weight, dim, layer._blocks, layer.tp_rank, layer.tp_size, _memo)
    layer.weight.tensor_model_parallel, layer.weight.partition_dim = True, dim
    layer.weight.partition_stride = layer.stride
    if linear.bias is not None:
        if style == "column":
            bias = _shard_param(linear.bias, 0, layer._blocks, layer.tp_rank, layer.tp_size, _memo)
            bias.tensor_model_parallel, bias.partition_dim = True, 0
            bias.partition_stride = layer.stride
        else:
            bias = _shard_param(linear.bias, 0, [linear.out_features], 0, 1, _memo)
            bias.tensor_model_parallel, bias.partition_dim, bias.partition_stride = False, 0, 1
            bias.sequence_parallel = layer.sequence_parallel
        layer.bias = bias
    layer.train(linear.training)
    return layer


def from_embedding(
    embedding: nn.Embedding,
    group: dist.ProcessGroup | None = None,
    *,
    _memo: dict | None = None,
    **options: Any,
) -> VocabParallelEmbedding:
    """The :class:`VocabParallelEmbedding` holding this rank's rows of ``embedding``.

    ``options``: ``sequence_parallel``, ``seq_dim``, ``validate``. ``padding_idx`` is kept;
    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not supported (``ValueError``).
    The vocabulary size must divide by the group size (pad it: :func:`pad_vocab_size`).
    """
    if not isinstance(embedding, nn.Embedding):
        raise TypeError(f"from_embedding expects an nn.Embedding, got {type(embedding).__name__}")
    _check_options("from_embedding", options, _EMBEDDING_OPTIONS)
    for name in ("max_norm", "scale_grad_by_freq", "sparse"):
        if getattr(embedding, name):
            raise ValueError(f"from_embedding: nn.Embedding({name}=...) is not supported")
    weight = embedding.weight
    layer = VocabParallelEmbedding(
        embedding.num_embeddings,
        embedding.embedding_dim,
        padding_idx=embedding.padding_idx,
        perform_initialization=False,
        group=group,
        dtype=weight.dtype,
        device=weight.device,
        **options,
    )
    layer.weight = _shard_param(
        weight, 0, [embedding.num_embeddings], layer.tp_rank, layer.tp_size, _memo
    )
    layer.weight.tensor_model_parallel, layer.weight.partition_dim = True, 0
    layer.weight.partition_stride = 1
    layer.train(embedding.training)
    return layer


def _from_dtensor_style(spec: Any) -> tuple[str, dict] | None:
    """``ColwiseParallel()`` / ``RowwiseParallel()`` (torch.distributed.tensor.parallel) as an
    mtp style, or None when ``spec`` is not one of them."""
    try:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    except ImportError:  # pragma: no cover
        return None
    if isinstance(spec, ColwiseParallel):
        layouts = getattr(spec, "output_layouts", None)
        layouts = layouts if isinstance(layouts, tuple) else (layouts,)
        return "column", {"gather_output": any(isinstance(x, Replicate) for x in layouts)}
    if isinstance(spec, RowwiseParallel):
        layouts = getattr(spec, "input_layouts", None)
        layouts = layouts if isinstance(layouts, tuple) else (layouts,)
        return "row", {"input_is_parallel": not any(isinstance(x, Replicate) for x in layouts)}
    return None


def _normalize_style(pattern: str, spec: str | Mapping[str, Any]) -> tuple[str, dict]:
    converted = _from_dtensor_style(spec)
    if converted is not None:
        return converted
    if isinstance(spec, str):
        style, options = spec, {}
    elif isinstance(spec, Mapping) and "style" in spec:
        options = dict(spec)
        style = options.pop("style")
    else:
        raise TypeError(
            f"parallelize: plan[{pattern!r}] must be a style name {STYLES} or a dict with a "
            f"'style' key and layer options, got {spec!r}"
        )
    if style not in STYLES:
        raise ValueError(
            f"parallelize: plan[{pattern!r}] style must be one of {STYLES}, got {style!r}"
        )
    return style, options


def _matches(model: nn.Module, plan: Mapping[str, Any]) -> tuple[dict, dict]:
    """``({module name: (style, options, pattern)} for layer swaps, {name: (style, options)} for
    input hooks)``; every pattern must match something."""
    names = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
    chosen: dict[str, tuple[str, dict, str]] = {}
    hooks: dict[str, tuple[str, dict]] = {}
    entries = [
        (pattern, one)
        for pattern, spec in plan.items()
        for one in (spec if isinstance(spec, (list, tuple)) else [spec])
    ]
    for pattern, spec in entries:
        style, options = _normalize_style(pattern, spec)
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if style in _HOOK_STYLES:
            _check_options(f"parallelize: plan[{pattern!r}]", options, _HOOK_OPTIONS[style])
            if not hits:
                raise ValueError(
                    f"parallelize: plan pattern {pattern!r} matches no submodule of "
                    f"{type(model).__name__}"
                )
            for name in hits:
                if name in hooks and hooks[name][0] != style:
                    raise ValueError(f"parallelize: {name!r} gets two input styles")
                hooks[name] = (style, options)
            continue
        if not hits:
            raise ValueError(
                f"parallelize: plan pattern {pattern!r} matches no submodule of "
                f"{type(model).__name__}"
            )
        for name in hits:
            if name in chosen and chosen[name][:2] != (style, options):
                raise ValueError(
                    f"parallelize: {name!r} is matched by {chosen[name][2]!r} and {pattern!r} "
                    "with different styles"
                )
            chosen.setdefault(name, (style, options, pattern))
    return chosen, hooks


def _under(name: str, parents) -> bool:
    """True when ``name`` is one of ``parents`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in parents)


def _register_hooks(model, hooks, group, sequence_parallel: bool, seq_dim: int) -> None:
    for name, (style, options) in hooks.items():
        module = model.get_submodule(name)
        sp = options.get("sequence_parallel", sequence_parallel)
        dim = options.get("seq_dim", seq_dim)
        arg = options.get("arg", "hidden_states")
        if style == "shared_input":
            share_module_input(module, group, sequence_parallel=sp, seq_dim=dim, arg=arg)
        else:
            scatter_module_input(module, group, seq_dim=dim, arg=arg)


def _swap(module: nn.Module, where: str, style: str, group, memo: dict, options) -> nn.Module:
    """The parallel layer for ``module``; errors name ``where`` (the module and its plan
    entry)."""
    needs = nn.Embedding if style == "vocab" else nn.Linear
    if not isinstance(module, needs):
        raise TypeError(
            f"parallelize: {where} is a {type(module).__name__}; style {style!r} needs an "
            f"nn.{needs.__name__}"
        )
    try:
        if style == "vocab":
            return from_embedding(module, group, _memo=memo, **options)
        return from_linear(module, style, group, _memo=memo, **options)
    except ValueError as exc:
        if type(exc) is not ValueError:  # a typed error keeps its type and message
            raise
        raise ValueError(f"parallelize: {where}: {exc}") from exc


def parallelize(
    model: nn.Module,
    plan: Mapping[str, str | Mapping[str, Any]],
    group: dist.ProcessGroup | None = None,
    *,
    sequence_parallel: bool = False,
    seq_dim: int = 0,
) -> nn.Module:
    """Swap ``model``'s submodules for tensor-parallel ones, in place, and return ``model``.

    Args:
        model: any module, with the same weights on every rank of the group (build it from the
            same seed, or load the same checkpoint, before calling this).
        plan: ``{pattern: style}``. Patterns are ``fnmatch`` patterns over the qualified
            submodule names (``"*.mlp.c_fc"`` matches ``"transformer.h.0.mlp.c_fc"``; ``*``
            crosses dots). Styles: ``"column"`` / ``"row"`` for ``nn.Linear``, ``"vocab"`` for
            ``nn.Embedding``, or a dict ``{"style": ..., **options}`` with the options of
            :func:`from_linear` / :func:`from_embedding` (``stride``, ``gather_output``,
            ``disable_grad_reduce``,
            ``input_is_parallel``, ``skip_bias_add``, ...). ``ColwiseParallel()`` /
            ``RowwiseParallel()`` objects of ``torch.distributed.tensor.parallel`` are accepted
            too (``output_layouts=Replicate()`` means ``gather_output``). Two input styles go
            on parent modules: ``"shared_input"`` makes the module's input (first positional
            argument or keyword ``arg``, default ``"hidden_states"``) enter the
            tensor-parallel region once, and every column layer inside it (or the module
            itself) is built with ``disable_grad_reduce=True``: q/k/v or gate/up siblings then
            cost one backward all-reduce (or one all-gather forward + reduce-scatter backward
            under sequence parallel) for the group, see :mod:`mtp.tensor_parallel.siblings`;
            ``"scatter_sequence"`` splits the module's input into this rank's sequence chunk
            (where a model enters the sequence-parallel region). A pattern that matches
            nothing, a module matched with two different styles, or a style on the wrong
            module type raises. A list of specs gives one module a layer style and an input
            style (``"lm_head": [{"style": "column", "gather_output": True},
            "shared_input"]``).
        group: the tensor-parallel group (default: ``mtp.parallel``'s), or a 1-D
            ``DeviceMesh`` (``mesh["tp"]``).
        sequence_parallel: build every swapped layer with ``sequence_parallel=True`` (the
            activations between the row layer and the next column layer are sequence chunks
            along ``seq_dim``) and mark every parameter that stays replicated
            (LayerNorms, ...) ``sequence_parallel=True``: call
            :func:`allreduce_sequence_parallel_grads` after each backward. A replicated
            parameter that sees the full sequence (e.g. added before the sequence is split)
            must be unmarked by hand (``p.sequence_parallel = False``).
        seq_dim: the sequence dimension for ``sequence_parallel`` (1 for ``[b, s, h]`` models).

    Weights tied between swapped modules (an embedding and an output layer sharing one
    Parameter) stay tied when both are split the same way (``"vocab"`` and ``"column"``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    group, _, _ = group_rank_and_size(group)
    chosen, hooks = _matches(model, plan)
    shared = [name for name, (style, _) in hooks.items() if style == "shared_input"]
    memo: dict = {}
    for name, (style, options, pattern) in chosen.items():
        module = model.get_submodule(name)
        if sequence_parallel:
            options = {"sequence_parallel": True, "seq_dim": seq_dim, **options}
        if style == "column" and _under(name, shared):
            options = {"disable_grad_reduce": True, **options}
        new = _swap(module, f"{name!r} (plan entry {pattern!r}: {style!r})", style, group, memo,
                    options)  # fmt: skip
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    _register_hooks(model, hooks, group, sequence_parallel, seq_dim)
    if sequence_parallel:
        mark_sequence_parallel_parameters(
            p for p in model.parameters() if getattr(p, "sequence_parallel", None) is None
        )
    return model
