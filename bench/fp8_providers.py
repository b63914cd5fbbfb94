"""The FP8 providers of the ``grouped_gemm`` and ``moe_layer`` families, beside their BF16 ones.

mtp's: ``triton-fp8`` (``fp8_recipe="blockwise"``: 1 x 128 activation and 128 x 128 weight
blocks, Hopper and later) and ``triton-mxfp8`` (``"mxfp8"``: 1 x 32 blocks, e8m0 scales, sm_100
and later; the interpreter runs both on CPU). The grouped GEMM quantises ``x``, ``w`` and, in
the backward, ``dY`` inside every timed call (no weight cache: the op's whole cost); the MoE
layer quantises its weights once and reuses them between optimizer steps (its
:class:`~mtp.ops.Fp8WeightCache`), as in training.

Peers of the grouped GEMM, GPU only, when installed (each quantises its operands inside the timed
call too):

- ``torch._scaled_grouped_mm``: PyTorch's FP8 grouped GEMM (sm_90+), with row-wise scales (one
  per row of ``x``, one per output column of ``w[e]``: the finest scaling it takes), forward
  only (it has no autograd);
- ``te-fp8`` / ``te-mxfp8``: Transformer Engine's ``GroupedLinear`` under ``fp8_autocast`` with
  ``Float8BlockScaling`` (DeepSeek-V3's blocks, the blockwise recipe) / ``MXFP8BlockScaling``,
  forward and backward (``m_splits`` on the host, as for the BF16 ``te`` provider);
- ``deepgemm``: DeepSeek's ``m_grouped_fp8_gemm_nt_contiguous`` (1 x 128 / 128 x 128 blocks),
  forward only, on cases whose groups are multiples of its 128-row alignment (the others are
  skipped).

Every FP8 provider is checked against the float64 GEMM on the original operands with
:data:`TOLERANCE` (the recipes' error on Gaussian data is about 3.7 %, ``docs/grouped_gemm.md``;
the layer's two chained GEMMs :data:`LAYER_TOLERANCE`), and its floor taken at the datasheet
FP8 rate (``rate="fp8"``: TFLOP/s against the FP8 peak).
"""

from __future__ import annotations

import torch

from .core import Provider, Skip, import_peer, needs_cuda, peer_attr

__all__ = ["LAYER_TOLERANCE", "MTP_FP8", "TOLERANCE", "mtp_providers", "peer_fn", "peers"]

#: mtp provider -> fp8_recipe
MTP_FP8 = {"triton-fp8": "blockwise", "triton-mxfp8": "mxfp8"}
TOLERANCE = 0.07
LAYER_TOLERANCE = 0.1
SCALED_MM = "torch._scaled_grouped_mm"
_TE_RECIPES = {"te-fp8": "Float8BlockScaling", "te-mxfp8": "MXFP8BlockScaling"}
_E4M3_MAX = 448.0


def _arch(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0


def recipe_ready(recipe: str, ready):
    """``ready`` (the triton backend's check) and, for ``"mxfp8"`` on a GPU, sm_100+."""

    def needs(device: torch.device) -> str | None:
        if recipe == "mxfp8" and device.type == "cuda" and _arch(device) < 10:
            return "mxfp8 needs an sm_100 (Blackwell) GPU"
        return ready(device)

    return needs


def mtp_providers(ready, tolerance: float = TOLERANCE) -> list[Provider]:
    """``triton-fp8`` and ``triton-mxfp8`` (CPU too: the interpreter)."""
    return [Provider(name, "mtp", needs=recipe_ready(recipe, ready), tolerance=tolerance,
                     rate="fp8")  # fmt: skip
            for name, recipe in MTP_FP8.items()]


def _te_needs(name: str):
    def needs(device: torch.device) -> str | None:
        reason = needs_cuda(device) or import_peer("transformer_engine.pytorch", "GroupedLinear")
        if reason:
            return reason
        if name == "te-mxfp8" and _arch(device) < 10:
            return "MXFP8 needs an sm_100 (Blackwell) GPU"
        return import_peer("transformer_engine.common.recipe", _TE_RECIPES[name])

    return needs


def _deepgemm_needs(device: torch.device) -> str | None:
    reason = needs_cuda(device) or import_peer("deep_gemm", "m_grouped_fp8_gemm_nt_contiguous")
    return reason or (None if _arch(device) == 9 else "DeepGEMM's FP8 kernels are sm_90's")


def peers() -> list[Provider]:
    kw = dict(cpu=False, tolerance=TOLERANCE, rate="fp8")
    out = [Provider(SCALED_MM, "peer", needs=lambda d: needs_cuda(d) or (
        None if hasattr(torch, "_scaled_grouped_mm") else "this torch has no _scaled_grouped_mm"),
        note="row-wise scales; forward only", **kw)]  # fmt: skip
    out += [Provider(name, "peer", needs=_te_needs(name), **kw) for name in _TE_RECIPES]
    out.append(Provider("deepgemm", "peer", needs=_deepgemm_needs,
                        note="groups of multiples of 128 rows only; forward only", **kw))
    return out


# --------------------------------------------------------------------------------------------
# The peers' calls
# --------------------------------------------------------------------------------------------


def _rowwise(t: torch.Tensor, dim: int):
    """``(t / s, s)`` in e4m3 with one fp32 scale per slice along ``dim`` (amax / 448)."""
    s = t.abs().amax(dim, keepdim=True).float().clamp(min=1e-12) / _E4M3_MAX
    return (t.float() / s).to(torch.float8_e4m3fn), s.squeeze(dim)


def _scaled_mm_fn(w: torch.Tensor):
    def f(x, counts):
        xq, sx = _rowwise(x, 1)  # [M, K], [M]
        wq, sw = _rowwise(w.transpose(1, 2).contiguous(), 2)  # [E, N, K] (K contiguous), [E, N]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), sx, sw, offs=offs,
                                        out_dtype=x.dtype)  # fmt: skip

    return f


def _te_fn(name: str, layer):
    recipe = peer_attr("transformer_engine.common.recipe", _TE_RECIPES[name])()
    autocast = peer_attr("transformer_engine.pytorch", "fp8_autocast")

    def f(x, counts):
        with autocast(enabled=True, fp8_recipe=recipe):
            return layer(x, counts.tolist())

    return f


def _deepgemm_fn(w: torch.Tensor):
    from mtp.ops import quantize

    gemm = peer_attr("deep_gemm", "m_grouped_fp8_gemm_nt_contiguous")

    def f(x, counts):
        xq = quantize(x, "blockwise", "rowwise")
        wq = quantize(w.transpose(1, 2).contiguous(), "blockwise", "block")  # [E, N, K]
        groups = torch.repeat_interleave(torch.arange(len(counts), device=x.device,
                                                      dtype=torch.int32), counts)  # fmt: skip
        out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
        gemm((xq.data, xq.scales), (wq.data, wq.scales), out, groups)
        return out

    return f


def peer_fn(provider: str, w: torch.Tensor, te_layer, sizes: list[int]):
    """``(f(x, counts) -> y, the weight tensors to differentiate)`` of an FP8 peer;
    ``te_layer(w)`` builds Transformer Engine's layer; ``sizes``: the rows per expert."""
    if provider == SCALED_MM:
        return _scaled_mm_fn(w), None
    if provider in _TE_RECIPES:
        layer = te_layer(w.detach())
        return _te_fn(provider, layer), [getattr(layer, f"weight{e}") for e in range(w.shape[0])]
    if provider == "deepgemm":
        if any(m % 128 for m in sizes):
            raise Skip("DeepGEMM's contiguous layout needs groups of multiples of 128 rows")
        return _deepgemm_fn(w), None
    raise KeyError(provider)
