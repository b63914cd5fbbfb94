"""Hugging Face expert weights <-> :class:`mtp.moe.GroupedMLP`'s layout.

mtp's layout (all ``E`` experts): ``weight1 [E, H, F1]``, ``weight2 [E, F, H]`` (``x @ w``),
``bias1 [E, F1]``, ``bias2 [E, H]``; ``F1 = 2F`` for the gated activations: ``"swiglu"`` holds
the gate in the first half and the up projection in the second, ``"clamped_swiglu"`` (GPT-OSS)
interleaves them (gate in even columns, up in odd ones).

Hugging Face layouts (``layout`` argument):

- ``"linear"`` (``nn.Linear`` orientation ``[E, out, in]``): transformers 5 stacked experts of
  Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3: ``gate_up_proj [E, 2F, H]`` (``chunk(2)``: gate
  first), ``down_proj [E, H, F]``; or per-expert ``gate_proj``/``up_proj`` ``[F, H]`` and
  ``down_proj [H, F]`` (older checkpoints' ``w1``/``w3``/``w2``), given stacked ``[E, ...]`` or
  as lists.
- ``"matmul"`` (``[E, in, out]``): GPT-OSS: ``gate_up_proj [E, H, 2F]`` (interleaved),
  ``gate_up_proj_bias [E, 2F]``, ``down_proj [E, F, H]``, ``down_proj_bias [E, H]``.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_to_hf", "hf_to_grouped"]

_LAYOUTS = ("linear", "matmul")
_STYLES = ("stacked_linear", "stacked_matmul", "per_expert")


def _stack(name: str, value) -> torch.Tensor:
    if isinstance(value, (list, tuple)):
        value = torch.stack(list(value))
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        raise ValueError(f"{name} must be a [E, ., .] tensor or a list of 2-D tensors")
    return value


def _join(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``[E, H, F]`` gate and up -> ``[E, H, 2F]`` in ``activation``'s column order."""
    if activation == "clamped_swiglu":
        return torch.stack([gate, up], dim=-1).flatten(-2)
    return torch.cat([gate, up], dim=-1)


def _split(w1: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    if activation == "clamped_swiglu":
        return w1[..., 0::2], w1[..., 1::2]
    return w1.chunk(2, dim=-1)


def hf_to_grouped(
    *,
    activation: str = "swiglu",
    layout: str = "linear",
    gate_up_proj=None,
    down_proj=None,
    gate_proj=None,
    up_proj=None,
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
):
    """Hugging Face expert weights -> ``(weight1, weight2, bias1, bias2)`` in mtp's layout
    (see the module docstring). Give ``gate_up_proj`` (stacked, already in ``activation``'s
    column order: halves for Mixtral/Qwen/DeepSeek, interleaved for GPT-OSS) or
    ``gate_proj`` + ``up_proj`` (a gated ``activation``) or ``up_proj`` alone (``"gelu"``,
    ``"relu2"``), and ``down_proj``."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    if down_proj is None:
        raise ValueError("down_proj is required")
    gated = activation in ("swiglu", "clamped_swiglu")

    def orient(t):  # -> [E, in, out]
        return t.transpose(1, 2) if layout == "linear" else t

    if gate_up_proj is not None:
        if gate_proj is not None or up_proj is not None:
            raise ValueError("give gate_up_proj or gate_proj/up_proj, not both")
        w1 = orient(_stack("gate_up_proj", gate_up_proj))
    elif gated:
        if gate_proj is None or up_proj is None:
            raise ValueError(
                f"activation={activation!r} needs gate_up_proj or gate_proj and up_proj"
            )
        gate = orient(_stack("gate_proj", gate_proj))
        w1 = _join(gate, orient(_stack("up_proj", up_proj)), activation)
    else:
        if up_proj is None or gate_proj is not None:
            raise ValueError(f"activation={activation!r} (not gated) needs up_proj only")
        w1 = orient(_stack("up_proj", up_proj))
    w2 = orient(_stack("down_proj", down_proj))
    if w1.shape[0] != w2.shape[0] or w1.shape[1] != w2.shape[2]:
        raise ValueError(
            f"fc1 {tuple(w1.shape)} and down_proj {tuple(w2.shape)} (as [E, in, out]) disagree on "
            "the number of experts or the hidden size"
        )
    want = 2 * w2.shape[1] if gated else w2.shape[1]
    if w1.shape[2] != want:
        raise ValueError(
            f"fc1 has {w1.shape[2]} output features, expected {want} for activation="
            f"{activation!r} and down_proj's {w2.shape[1]} intermediate features"
        )
    return w1.contiguous(), w2.contiguous(), gate_up_proj_bias, down_proj_bias


def grouped_to_hf(
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    bias1: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    *,
    style: str = "stacked_linear",
    activation: str = "swiglu",
) -> dict[str, torch.Tensor]:
    """mtp's ``weight1 [E, H, F1]``/``weight2 [E, F, H]`` -> Hugging Face tensors:
    ``"stacked_linear"`` (``gate_up_proj [E, F1, H]``, ``down_proj [E, H, F]``),
    ``"stacked_matmul"`` (GPT-OSS: ``gate_up_proj [E, H, F1]``, ``down_proj [E, F, H]``, biases
    ``gate_up_proj_bias``/``down_proj_bias``) or ``"per_expert"`` (``gate_proj``/``up_proj``
    ``[E, F, H]``, ``down_proj [E, H, F]``; ``up_proj`` alone when not gated)."""
    if style not in _STYLES:
        raise ValueError(f"style must be one of {_STYLES}, got {style!r}")
    out: dict[str, torch.Tensor] = {}
    if style == "stacked_matmul":
        out["gate_up_proj"], out["down_proj"] = weight1.clone(), weight2.clone()
    elif style == "stacked_linear":
        out["gate_up_proj"] = weight1.transpose(1, 2).contiguous()
        out["down_proj"] = weight2.transpose(1, 2).contiguous()
    else:
        if activation in ("swiglu", "clamped_swiglu"):
            gate, up = _split(weight1, activation)
            out["gate_proj"] = gate.transpose(1, 2).contiguous()
            out["up_proj"] = up.transpose(1, 2).contiguous()
        else:
            out["up_proj"] = weight1.transpose(1, 2).contiguous()
        out["down_proj"] = weight2.transpose(1, 2).contiguous()
    if bias1 is not None:
        out["gate_up_proj_bias"] = bias1.clone()
    if bias2 is not None:
        out["down_proj_bias"] = bias2.clone()
    return out
