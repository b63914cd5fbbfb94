"""Load-balancing loss variants and Megatron-Core's per-layer auxiliary-loss logging helpers.

- :func:`sequence_load_balancing_loss_func`: the ``"seq_aux_loss"`` type (DeepSeek-V2/V3's
  per-sequence balance): the Switch loss computed for each sequence of a ``[s, b]`` token layout
  and averaged over the ``b`` sequences.
- The ``"global_aux_loss"`` type is the Switch loss with the token counts averaged over the
  micro-batches seen since :meth:`mtp.moe.TopKRouter.reset_global_aux_loss_tracker` (summed over
  the router's ``aux_loss_group`` when one is given); see :class:`mtp.moe.TopKRouter`.
- The tracker (Megatron-Core's ``save_to_aux_losses_tracker`` / ``track_moe_metrics`` names):
  each router with a ``layer_number`` records its losses (divided by their coefficient, detached,
  on the device) into a ``[num_layers]`` tensor per loss name; :func:`track_moe_metrics` reduces
  them (optionally over a process group) and returns host floats for logging, once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "LOAD_BALANCING_TYPES",
    "clear_aux_losses_tracker",
    "get_moe_layer_wise_logging_tracker",
    "save_to_aux_losses_tracker",
    "sequence_load_balancing_loss_func",
    "track_moe_metrics",
]

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")

_TRACKER: dict[str, dict] = {}


def sequence_load_balancing_loss_func(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    seq_length: int,
    topk: int,
    moe_aux_loss_coeff: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-sequence Switch loss, averaged over the sequences (Megatron's ``seq_aux_loss``).

    Args:
        probs: ``[s * b, E]`` scores over all experts, tokens in ``[s, b]`` order (sequence
            position major, as a ``[s, b, h]`` activation flattens).
        routing_map: ``[s * b, E]`` bool, the unbiased top-k of each token.
        seq_length: ``s``.
        topk, moe_aux_loss_coeff: ``k`` and the coefficient.
        group: the ranks holding the other chunks of the same sequences (sequence parallel):
            the counts are summed over it and ``s`` is the full length, so that the ranks'
            losses add up to the loss of the whole sequences.

    Returns ``coeff * E / (k * s**2) * sum_b sum_e P[b, e] * n[b, e] / b`` as a 0-D tensor, where
    ``P[b, e]`` sums sequence ``b``'s scores and ``n[b, e]`` counts its tokens routed to ``e``.
    """
    tokens, num_experts = probs.shape
    if seq_length < 1 or tokens % seq_length:
        raise ValueError(
            f"seq_aux_loss: the token count {tokens} must be a multiple of seq_length={seq_length}"
        )
    bsz = tokens // seq_length
    per_seq_probs = probs.reshape(seq_length, bsz, num_experts).sum(dim=0)
    per_seq_counts = routing_map.reshape(seq_length, bsz, num_experts).sum(dim=0)
    full_length = seq_length
    if group is not None and dist.get_world_size(group) > 1:
        per_seq_counts = per_seq_counts.to(torch.int64)
        dist.all_reduce(per_seq_counts, group=group)
        full_length = seq_length * dist.get_world_size(group)
    scale = num_experts * moe_aux_loss_coeff / (topk * full_length**2)
    return torch.sum(per_seq_probs * per_seq_counts.to(per_seq_probs.dtype)) * scale / bsz


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: dist.ProcessGroup | None = None,
) -> None:
    """Add ``loss`` (detached, on its device) to layer ``layer_number`` (1-based) of the
    ``[num_layers]`` tracker ``name``; ``reduce_group``: where :func:`track_moe_metrics` sums it
    (e.g. the tensor-parallel group when each rank holds a partial loss)."""
    if not 1 <= layer_number <= num_layers:
        raise ValueError(f"layer_number={layer_number} must be in [1, num_layers={num_layers}]")
    entry = _TRACKER.get(name)
    if entry is None or entry["values"].numel() != num_layers:
        entry = {
            "values": torch.zeros(num_layers, dtype=torch.float32, device=loss.device),
            "reduce_group": reduce_group,
        }
        _TRACKER[name] = entry
    entry["values"][layer_number - 1] += loss.detach().float()
    entry["reduce_group"] = reduce_group


def get_moe_layer_wise_logging_tracker() -> dict[str, dict]:
    """The tracker: ``{name: {"values": [num_layers] tensor, "reduce_group": group}}``."""
    return _TRACKER


def clear_aux_losses_tracker() -> None:
    """Zero every tracked value (call once per step, after logging)."""
    for entry in _TRACKER.values():
        entry["values"].zero_()


def track_moe_metrics(
    loss_scale: float = 1.0, per_layer: bool = False, avg_group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Reduce the tracker and return host floats for logging, then clear it.

    Each value is summed over its ``reduce_group``, averaged over ``avg_group`` (e.g. data
    parallel) when given, multiplied by ``loss_scale`` (``1 / num_micro_batches`` when several
    micro-batches were accumulated). Returns ``{name: mean over layers}`` and, with
    ``per_layer``, ``{f"moe/{name}_layer_{i}": value}`` too. One host sync per call.
    """
    out: dict[str, float] = {}
    for name, entry in _TRACKER.items():
        values = entry["values"].clone()
        if entry["reduce_group"] is not None:
            dist.all_reduce(values, group=entry["reduce_group"])
        if avg_group is not None:
            dist.all_reduce(values, group=avg_group)
            values /= dist.get_world_size(avg_group)
        values = (values * loss_scale).tolist()
        out[name] = sum(values) / len(values)
        if per_layer:
            for i, v in enumerate(values):
                out[f"moe/{name}_layer_{i}"] = v
    clear_aux_losses_tracker()
    return out
