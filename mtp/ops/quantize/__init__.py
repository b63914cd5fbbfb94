"""FP8 quantisation: :func:`quantize` turns a tensor into an :class:`Fp8Tensor` (e4m3 data and
block scales computed on the device: no host sync, graph-safe), the operand type of
:func:`mtp.ops.grouped_gemm`'s FP8 path (``docs/quantize.md``).

- :mod:`.tensor`: :class:`Fp8Tensor` (data, scales, recipe, layout) and :class:`Fp8Recipe`.
- :mod:`.cache`: :class:`Fp8WeightCache` (quantised weights reused until the weight changes).
- :mod:`.reference`: the plain-PyTorch definition (the kernel is bitwise equal to it).
- :mod:`.ops`: the custom op ``mtp::quantize_fp8`` (with its fake), its bodies and the launch
  plans of the ``triton`` backend (:mod:`mtp.kernels.quantize`).
"""

from __future__ import annotations

import torch

from mtp.kernels.grouped_gemm_details.routing import Routing
from mtp.ops._backend import resolve_backend
from mtp.ops._eager import CheckedKeys, eager
from mtp.ops.quantize.cache import Fp8WeightCache
from mtp.ops.quantize.ops import run_quantize
from mtp.ops.quantize.tensor import BLOCKS, LAYOUTS, RECIPES, Fp8Recipe, Fp8Tensor, as_recipe
from mtp.utils import check_tensor, check_values, data_checks_enabled, validation_mode

__all__ = ["RECIPES", "Fp8Recipe", "Fp8Tensor", "Fp8WeightCache", "dequantize", "quantize",
           "quantize_many"]

_BACKENDS = ("triton", "reference")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CHECKED = CheckedKeys()


def _check(x, recipe: Fp8Recipe, layout: str, counts) -> None:
    check_tensor("x", x, ndim=(2, 3), dtypes=_FLOATS)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "block" and recipe.name != "blockwise":
        raise ValueError(f"layout='block' (128 x 128 blocks) is the 'blockwise' recipe's; "
                         f"{recipe.name!r} scales 1 x {recipe.block} blocks")  # fmt: skip
    if counts is None:
        return
    check_tensor("tokens_per_expert", counts, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=x.device)  # fmt: skip
    if layout != "colwise" or x.dim() != 2:
        raise ValueError("tokens_per_expert groups the rows of a 2-D x for layout='colwise' "
                         f"(blocks along the rows); got layout={layout!r}, x {x.dim()}-D")


def _check_counts(counts, M: int, validate, in_map: bool) -> str | None:
    """The counts' data check: its message when the Triton tile map asserts it (``in_map``,
    ``validate=True``: no reductions of its own), else done here (aten ops on the device, or
    typed errors after a sync with ``"sync"``)."""
    mode = validation_mode(validate)
    message = (f"tokens_per_expert must be non-negative and sum to at most x.shape[0] = {M} "
               "rows (validate='sync' reports the values)")  # fmt: skip
    if mode == "off" or not data_checks_enabled(True, counts) or counts.numel() == 0:
        return None
    if mode == "device" and in_map:
        return message
    ok = (counts.min() >= 0) & (counts.sum() <= M)
    check_values(ok, message, validate=mode, tensors=(counts,))
    return None


def _tensors(outs, recipe: str, layouts: str, grouped: bool) -> list[Fp8Tensor]:
    q, s, qt, st = outs
    if layouts.startswith("block"):
        got = [Fp8Tensor(q, s, recipe, "block")]
        return got + ([Fp8Tensor(qt.mT, s, recipe, "block")] if layouts == "block+t" else [])
    got = []
    if "rowwise" in layouts:
        got.append(Fp8Tensor(q, s, recipe, "rowwise"))
    if "colwise" in layouts:
        got.append(Fp8Tensor(qt.mT, st.mT, recipe, "colwise", grouped))
    return got


def quantize_many(x, counts, recipe: Fp8Recipe, layouts: str, backend: str,
                  routing=None) -> list[Fp8Tensor]:  # fmt: skip
    """``x`` quantised in several layouts from one read (``layouts``: a key of
    :data:`mtp.ops.quantize.ops.LAYOUT_SETS`; ``"block+t"``: two memory layouts of the same
    blocks) on a resolved ``backend``, arguments checked: the body directly on plain tensors
    outside any trace (with ``routing``, the Routing of ``counts`` shared with a grouped GEMM),
    else the custom op."""
    if eager(x, counts):
        outs = run_quantize(x, counts, recipe.block, layouts, recipe.scale_kind, backend, routing)
    else:
        outs = torch.ops.mtp.quantize_fp8(x, counts, recipe.block, layouts, recipe.scale_kind,
                                          backend)  # fmt: skip
    return _tensors(outs, recipe.name, layouts, counts is not None)


def quantize(
    x: torch.Tensor,
    recipe: str | Fp8Recipe = "blockwise",
    layout: str = "rowwise",
    *,
    tokens_per_expert: torch.Tensor | None = None,
    pow2_scales: bool = False,
    backend: str = "auto",
    validate: bool | str = True,
) -> Fp8Tensor:
    """Quantise ``x`` to FP8 e4m3 with block scales computed on the device.

    Args:
        x: ``[R, C]`` or ``[B, R, C]`` float32/float16/bfloat16 (activations ``[M, K]``,
            expert weights ``[E, K, N]``).
        recipe: ``"blockwise"`` (fp32 scales, 128-wide blocks), ``"mxfp8"`` (e8m0 scales,
            32-wide blocks) or an :class:`Fp8Recipe`.
        layout: ``"rowwise"`` (``1 x b`` blocks along the last dim), ``"colwise"`` (``b x 1``
            along dim -2; the data stored with that dim contiguous) or ``"block"`` (128 x 128,
            ``"blockwise"`` only: DeepSeek-V3's weight blocks).
        tokens_per_expert: ``[E]`` counts of a 2-D ``x`` whose rows are grouped by expert, for
            ``layout="colwise"``: every expert starts on a block and its last block is padded
            with zeros (``padded_rows(M, E, b)`` rows; rows past the experts' blocks are left
            unwritten): the operand of an FP8 weight gradient. Read on the device.
        pow2_scales: ``"blockwise"``: round each scale up to a power of two.
        backend: ``"auto"`` (``triton`` on CUDA, ``reference`` on CPU), ``"triton"``,
            ``"reference"``.
        validate: the counts' data check (as :func:`mtp.ops.grouped_gemm`'s).

    Returns:
        An :class:`Fp8Tensor` of ``x``'s shape (or the padded rows). Scale of a block with
        absolute maximum ``amax``: ``max(amax / 448, 2^-126)``, rounded up to a power of two
        for ``pow2_scales`` and ``"mxfp8"``; data ``x / scale`` rounded to nearest even,
        saturated to +-448. ``+-inf`` is read as ``+-FLT_MAX`` (so it becomes +-448 and its
        block's other values are flushed towards 0, as DeepSeek-V3's clamp does); NaN stays
        NaN and does not enter the block's maximum.
    """
    rec = as_recipe(recipe)
    if pow2_scales and not rec.pow2_scales:
        rec = Fp8Recipe(rec.name, True, rec.wgrad)
    counts = tokens_per_expert
    key = None
    if isinstance(x, torch.Tensor) and (counts is None or isinstance(counts, torch.Tensor)):
        key = (x.shape, x.dtype, x.device, rec, layout, backend, None if counts is None else
               (counts.shape, counts.dtype, counts.device))  # fmt: skip
    if key is None or key not in _CHECKED:
        _check(x, rec, layout, counts)
        if key is not None:
            _CHECKED.add(key)
    name = resolve_backend("quantize", backend, x.device, _BACKENDS)
    routing = None
    if counts is not None:
        counts = counts.contiguous()
        in_map = name == "triton" and eager(x, counts)
        message = _check_counts(counts, x.shape[0], validate, in_map)
        if in_map:
            routing = Routing(counts, x.shape[0], counts.shape[0], message)
    return quantize_many(x, counts, rec, layout, name, routing)[0]


def dequantize(t: Fp8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t.data * t.scales`` (each scale over its block) in ``dtype``: the value an FP8 operand
    stands for."""
    return t.dequantize(dtype)
