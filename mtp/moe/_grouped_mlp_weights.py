"""The weights of :class:`~mtp.moe.experts.GroupedMLP` in and out: :class:`GroupedMLPWeights`,
the part of ``GroupedMLP`` that initialises its experts (``reset_parameters``) and copies them
from full (all experts, unsharded) weights, Hugging Face layouts and ``nn.Linear`` pairs and
back, keeping this rank's experts and expert-tensor-parallel shard (:func:`fc1_shard_columns`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GroupedMLPWeights", "fc1_shard_columns"]


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


class GroupedMLPWeights:
    """Weight initialisation and loading of :class:`~mtp.moe.experts.GroupedMLP`, a mixin of it:
    it reads the sizes, ``activation``, ``add_bias``, ``tp_size``/``tp_rank``,
    ``expert_offset`` and the parameters ``weight1``/``weight2``/``bias1``/``bias2`` that
    ``GroupedMLP.__init__`` sets."""

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
