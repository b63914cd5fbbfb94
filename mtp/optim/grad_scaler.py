"""Dynamic loss scaling for fp16 training: :class:`DynamicLossScaler` (Megatron's
``DynamicGradScaler``).

The loss is multiplied by ``scale`` before backward so that small fp16 gradients do not flush to
zero; the optimizer divides the gradients by it again. When any gradient anywhere in the job is
inf or NaN (the found-inf flag is all-reduced with ``MAX`` over every rank: tensor, pipeline,
expert and data parallel), the step is skipped and the scale is multiplied by
``backoff_factor`` once ``hysteresis`` overflows have been seen; after ``growth_interval``
clean steps in a row it is multiplied by ``growth_factor``. bf16 and fp32 need no scaler.
"""

from __future__ import annotations

import torch

__all__ = ["DynamicGradScaler", "DynamicLossScaler"]


class DynamicLossScaler:
    """Loss scale that backs off on overflow and grows after clean steps.

    Args:
        initial_scale: first scale (Megatron's default ``2**32``).
        min_scale: the scale never goes below this.
        growth_factor: > 1, applied after ``growth_interval`` clean steps.
        backoff_factor: in (0, 1), applied on overflow (after ``hysteresis`` overflows).
        growth_interval: clean steps between growths.
        hysteresis: overflows tolerated before backing off (reset by a growth).
        device: where :attr:`scale` lives (the model's device).

    Use :meth:`scale_loss` on the loss; the :class:`~mtp.optim.DistributedOptimizer` (given
    ``grad_scaler=``) unscales, checks and calls :meth:`update`.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        if not initial_scale > 0 or not min_scale > 0 or initial_scale < min_scale:
            raise ValueError(
                f"need initial_scale >= min_scale > 0, got initial_scale={initial_scale}, "
                f"min_scale={min_scale}"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}"
            )
        self.min_scale, self.growth_factor = float(min_scale), float(growth_factor)
        self.backoff_factor, self.growth_interval = float(backoff_factor), int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._scale = torch.tensor(float(initial_scale), dtype=torch.float32, device=device)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def scale(self) -> torch.Tensor:
        """The current scale (0-d fp32 tensor)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call ``.backward()`` on the result)."""
        return loss * self._scale.to(loss.device, loss.dtype if loss.is_floating_point() else None)

    def update(self, found_inf: bool) -> None:
        """Account for one step: back off on overflow, grow after clean steps."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def to(self, device: torch.device | str) -> DynamicLossScaler:
        """Keep :attr:`scale` on ``device`` (the model's); returns ``self``."""
        self._scale = self._scale.to(device)
        return self

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.detach().cpu(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self._scale = state["scale"].to(self._scale.device, torch.float32)
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


#: Megatron-Core's name.
DynamicGradScaler = DynamicLossScaler
