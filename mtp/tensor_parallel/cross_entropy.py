"""Vocab-parallel cross-entropy with Megatron-Core's names.

``vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None)``
and the module :class:`VocabParallelCrossEntropy` are drop-in replacements for
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``: same arguments, per-token fp32
loss, the gradient of this rank's vocab shard. They run the fused op
:func:`mtp.ops.vocab_parallel_cross_entropy` (one all-gather of ``O(rows)`` bytes forward, no
communication backward). Two deliberate differences from Megatron-Core: label smoothing is
spread over the global vocab (identical to ``F.cross_entropy`` on the gathered logits; Megatron
smooths over the local shard), and out-of-range targets (or targets / shard sizes that differ
between the ranks) fail instead of being silently treated as belonging to no shard: by default
on the device, without a host sync (``validate="sync"`` raises typed errors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtp.ops.cross_entropy import vocab_parallel_cross_entropy as _fused_cross_entropy

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]


def _default_group() -> dist.ProcessGroup | None:
    """The tensor-model-parallel group when mtp.parallel is initialized, else None (no split)."""
    from mtp import parallel

    if parallel.model_parallel_is_initialized():
        return parallel.get_tensor_model_parallel_group()
    return None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "none",
    z_loss_weight: float = 0.0,
    inplace_backward: bool = False,
    validate: bool | str = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy when the logits are split over the vocab across tensor-parallel ranks.

    Args:
        vocab_parallel_logits: ``[sequence_length, batch_size, vocab_size / tp]`` (any leading
            dims), fp32 / fp16 / bf16: this rank's shard.
        target: ``[sequence_length, batch_size]`` global token ids (int64 / int32).
        label_smoothing: in ``[0, 1)``; spread over the global vocab as in ``F.cross_entropy``.
        tp_group: the group the vocab is split over; default: mtp.parallel's tensor-model-
            parallel group when it is initialized, else none (the logits are the full vocab).
        ignore_index, reduction, z_loss_weight, inplace_backward, validate, backend: see
            :func:`mtp.ops.vocab_parallel_cross_entropy` (defaults give Megatron's behaviour:
            per-token loss, no reduction).

    Returns:
        fp32 loss of shape ``target.shape`` (``reduction="none"``), or a scalar.
    """
    if tp_group is None:
        tp_group = _default_group()
    return _fused_cross_entropy(
        vocab_parallel_logits,
        target,
        group=tp_group,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
        z_loss_weight=z_loss_weight,
        inplace_backward=inplace_backward,
        validate=validate,
        backend=backend,
    )


class VocabParallelCrossEntropy(nn.Module):
    """Module form of :func:`vocab_parallel_cross_entropy`.

    ``VocabParallelCrossEntropy(label_smoothing=0.1)(vocab_parallel_logits, target)`` returns the
    per-token fp32 loss (``reduction="none"``, as Megatron-Core) or its sum / mean.
    The group is looked up at each call when ``tp_group`` is None, so the module can be built
    before :func:`mtp.parallel.initialize_model_parallel`.
    """

    def __init__(
        self,
        label_smoothing: float = 0.0,
        tp_group: dist.ProcessGroup | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "none",
        z_loss_weight: float = 0.0,
        inplace_backward: bool = False,
        validate: bool | str = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing
        self.tp_group = tp_group
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.z_loss_weight = z_loss_weight
        self.inplace_backward = inplace_backward
        self.validate = validate
        self.backend = backend

    def forward(self, vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            vocab_parallel_logits,
            target,
            self.label_smoothing,
            self.tp_group,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            z_loss_weight=self.z_loss_weight,
            inplace_backward=self.inplace_backward,
            validate=self.validate,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (
            f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}, z_loss_weight={self.z_loss_weight}"
        )
