"""The FP8 value types: :class:`Fp8Tensor` (data, scales, recipe, layout) and
:class:`Fp8Recipe` (what the grouped GEMM's ``fp8_recipe=`` takes).

An :class:`Fp8Tensor` describes a *logical* tensor of the shape of the one it was quantised
from: ``data`` (``float8_e4m3fn``) has that shape, whatever its strides (a ``"colwise"`` tensor
stores its blocked axis contiguously: the layout the tensor cores read an FP8 operand in), and
``scales`` one entry per block, the blocked dims divided by the block (rounded up). Its value is
``data * scales`` with every scale repeated over its block (:meth:`Fp8Tensor.dequantize`).

========== ============================== ================================================
layout     block over the last two dims   scales
========== ============================== ================================================
rowwise    ``1 x b`` (along the last dim)  ``[..., R, cdiv(C, b)]``
colwise    ``b x 1`` (along dim -2)        ``[..., cdiv(R, b), C]``
block      ``128 x 128`` (blockwise only)  ``[..., cdiv(R, 128), cdiv(C, 128)]``
========== ============================== ================================================

``b`` is the recipe's block: 128 for ``"blockwise"`` (DeepSeek-V3: fp32 scales, optionally
powers of two), 32 for ``"mxfp8"`` (OCP MX: e8m0 scales, ``torch.float8_e8m0fnu``, the format
the block-scaled MMA of sm_100 reads). A ``"colwise"`` tensor quantised with
``tokens_per_expert`` is *grouped*: its rows are those of an expert-grouped matrix with every
expert padded to whole blocks (``padded=True``; what the weight gradient reads).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

__all__ = ["BLOCKS", "LAYOUTS", "RECIPES", "Fp8Recipe", "Fp8Tensor", "as_recipe"]

#: recipe -> the block of its activation scales
BLOCKS = {"blockwise": 128, "mxfp8": 32}
RECIPES = tuple(BLOCKS)
LAYOUTS = ("rowwise", "colwise", "block")
WGRADS = ("fp8", "bf16")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How :func:`mtp.ops.grouped_gemm` computes in FP8.

    Attributes:
        name: ``"blockwise"`` (Hopper and later: 1 x 128 activation tiles, 128 x 128 weight
            blocks, fp32 scales applied per 128-deep K block with fp32 promotion) or
            ``"mxfp8"`` (Blackwell, sm_100+: 1 x 32 blocks along K for every operand, e8m0
            scales, ``tl.dot_scaled``).
        pow2_scales: ``"blockwise"`` only: round the scales up to powers of two (the scaling
            is then exact; ``"mxfp8"`` scales always are).
        wgrad: ``"fp8"``: the weight gradient from FP8 operands (the activations and output
            gradients quantised along the rows); ``"bf16"``: from the BF16 ones (Megatron-Core's
            option; the forward then keeps the BF16 input for the backward).
    """

    name: str = "blockwise"
    pow2_scales: bool = False
    wgrad: str = "fp8"

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"fp8_recipe must be one of {RECIPES}, got {self.name!r}")
        if self.wgrad not in WGRADS:
            raise ValueError(f"Fp8Recipe.wgrad must be one of {WGRADS}, got {self.wgrad!r}")

    @property
    def block(self) -> int:
        return BLOCKS[self.name]

    @property
    def scale_kind(self) -> str:
        """``"e8m0"``, ``"pow2"`` or ``"fp32"``: what the quantiser stores."""
        if self.name == "mxfp8":
            return "e8m0"
        return "pow2" if self.pow2_scales else "fp32"


def as_recipe(recipe: str | Fp8Recipe | None) -> Fp8Recipe | None:
    """``fp8_recipe=`` as an :class:`Fp8Recipe` (a name is the recipe with its defaults)."""
    if recipe is None or isinstance(recipe, Fp8Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"fp8_recipe must be None, a str or an Fp8Recipe, got "
                        f"{type(recipe).__name__}")  # fmt: skip
    return Fp8Recipe(recipe)


class Fp8Tensor(NamedTuple):
    """A tensor quantised to FP8 e4m3 with block scales (see the module doc for the layouts).

    Attributes:
        data: ``float8_e4m3fn``, the logical shape (any strides).
        scales: ``float32`` (``"blockwise"``) or ``float8_e8m0fnu`` (``"mxfp8"``), one per block.
        recipe: ``"blockwise"`` or ``"mxfp8"``.
        layout: ``"rowwise"``, ``"colwise"`` or ``"block"``.
        padded: a grouped ``"colwise"`` tensor (rows of each expert padded to whole blocks).
    """

    data: torch.Tensor
    scales: torch.Tensor
    recipe: str
    layout: str
    padded: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block(self) -> tuple[int, int]:
        """The block over the last two dims."""
        if self.layout == "block":
            return 128, 128
        b = BLOCKS[self.recipe]
        return (1, b) if self.layout == "rowwise" else (b, 1)

    @property
    def mT(self) -> "Fp8Tensor":  # noqa: N802 - torch's name
        """The transpose of the last two dims (a view: rowwise <-> colwise)."""
        swap = {"rowwise": "colwise", "colwise": "rowwise", "block": "block"}[self.layout]
        return Fp8Tensor(self.data.mT, self.scales.mT, self.recipe, swap, self.padded)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scales`` with each scale over its block, in ``dtype`` (fp32 math)."""
        br, bc = self.block
        s = self.scales.float()
        s = s.repeat_interleave(br, dim=-2)[..., : self.data.shape[-2], :]
        s = s.repeat_interleave(bc, dim=-1)[..., : self.data.shape[-1]]
        return (self.data.float() * s).to(dtype)
