"""The plain-PyTorch quantiser: the definition the Triton kernel is tested against bit for bit
(and the ``reference`` backend of :func:`mtp.ops.quantize`).

Per block with absolute maximum ``amax`` (``+-inf`` read as ``+-FLT_MAX``; NaN ignored by the
maximum, NaN in the data): ``s = max(amax / 448, 2^-126)``, the scale is ``s`` (``"fp32"``) or
``2^ceil(log2 s)`` (``"pow2"``, and ``"e8m0"`` stored as the biased exponent byte of
``torch.float8_e8m0fnu``), and the data ``(x / scale).clamp(-448, 448).to(float8_e4m3fn)``
(every NaN the byte 0x7F, whatever its sign: what ``cvt.rn.satfinite`` writes).
"""

from __future__ import annotations

import torch

__all__ = ["E4M3_MAX", "SCALE_MIN", "padded_rows", "quantize_blocks", "quantize_layouts",
           "scale_of"]  # fmt: skip

E4M3_MAX = 448.0
SCALE_MIN = 2.0**-126
_FLT_MAX = torch.finfo(torch.float32).max


def scale_of(amax: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale as fp32, stored scale)`` for blocks of absolute maximum ``amax`` (fp32)."""
    s = torch.clamp(amax / E4M3_MAX, min=SCALE_MIN)
    if kind == "fp32":
        return s, s
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    exp = exp - (mant == 0.5).to(exp.dtype)  # the smallest power of two >= s
    p = torch.ldexp(torch.ones_like(s), exp)
    if kind == "pow2":
        return p, p
    return p, (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-_FLT_MAX, _FLT_MAX)  # NaN stays NaN


def quantize_blocks(x: torch.Tensor, br: int, bc: int, kind: str):
    """``(data, scales)`` of ``x [..., R, C]`` in ``br x bc`` blocks over its last two dims
    (data contiguous, scales ``[..., cdiv(R, br), cdiv(C, bc)]``)."""
    *lead, R, C = x.shape
    xf = _finite(x)
    pr, pc = -R % br, -C % bc
    padded = torch.nn.functional.pad(xf, (0, pc, 0, pr))
    nr, nc = (R + pr) // br, (C + pc) // bc
    blocks = padded.reshape(*lead, nr, br, nc, bc)
    amax = blocks.abs().nan_to_num(nan=0.0).amax(dim=(-3, -1))
    scale, stored = scale_of(amax, kind)
    y = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(y.isnan(), 0x7F, q).view(torch.float8_e4m3fn)  # any NaN: 0x7F
    return q.reshape(*lead, R + pr, C + pc)[..., :R, :C].contiguous(), stored


def padded_rows(M: int, E: int, block: int) -> int:
    """Rows of a grouped ``"colwise"`` tensor: the worst case of every expert padded to whole
    blocks, ``(cdiv(M, block) + E) * block``."""
    return (-(-M // block) + E) * block


def _grouped_colwise(x: torch.Tensor, counts, block: int, kind: str):
    """``(data^T, scales^T)`` physical ``[C, R']`` and ``[C, R' / block]``: the rows of each
    expert at its padded position, zeros in its padding (rows past the experts' blocks are
    zeros here; the kernel leaves them unwritten)."""
    M, C = x.shape
    sizes = [max(int(c), 0) for c in counts.tolist()]
    rows = padded_rows(M, len(sizes), block)
    src = x.new_zeros(rows, C)
    start = pos = 0
    for m in sizes:
        m = min(m, M - start)
        src[pos : pos + m] = x[start : start + m]
        start += m
        pos += -(-m // block) * block
    q, s = quantize_blocks(src.mT, 1, block, kind)
    return q, s


def quantize_layouts(x: torch.Tensor, counts, block: int, layouts: str, kind: str):
    """``(q, s, qt, st)`` as the ``mtp::quantize_fp8`` op returns them (physical tensors;
    ``None`` for a layout not asked)."""
    q = s = qt = st = None
    if "block" in layouts:
        q, s = quantize_blocks(x, 128, 128, kind)
        if layouts == "block+t":
            qt = q.mT.contiguous()
        return q, s, qt, st
    if "rowwise" in layouts:
        q, s = quantize_blocks(x, 1, block, kind)
    if "colwise" in layouts:
        if counts is not None:
            qt, st = _grouped_colwise(x, counts, block, kind)
        else:
            qt, st = quantize_blocks(x.mT, 1, block, kind)
    return q, s, qt, st
