"""FP8 quantisation (``mtp.ops.quantize``): the producers of the FP8 grouped GEMM's operands,
memory-bound, so GB/s against the HBM floor.

What one FP8 expert GEMM quantises, per recipe (``blockwise``: 1 x 128 / 128 x 128 blocks,
fp32 scales; ``mxfp8``: 1 x 32 blocks, e8m0 scales):

- ``x rowwise``: the forward's activations ``[M, K]`` (blocks along K);
- ``x rowwise+colwise``: the same with the weight gradient's copy, column-wise with every expert
  padded to whole blocks (one launch: what the forward does with an FP8 weight gradient, and
  the backward with ``dY``);
- ``w``: the expert weights ``[E, K, N]`` along K and along N (blockwise: one set of 128 x 128
  blocks in two memory layouts, ``block+t``; MXFP8: ``rowwise+colwise``).

Shapes: Qwen3-30B-A3B's fc1 (``M = 4096 * 8`` routed rows, ``K = 2048``, ``E = 128``,
``N = 2 * 768``) and DeepSeek-V3's (``K = 7168``, ``E = 256``, ``N = 2 * 2048``, balanced
routing; the weights of 32 experts). ``triton`` is checked bit for bit (tolerance 0) against
``reference``, the plain PyTorch definition.

Bytes (``s`` = the input's element size, ``ss`` = a scale's: 4 or 1): the input read once, each
layout's e4m3 data (1 byte an element) and scales written once; the padded rows of the
column-wise copy count as written.
"""

from __future__ import annotations

import torch

from mtp.ops.quantize import Fp8Recipe, quantize_many

from .core import FLOAT64, Case, Provider, Run, randn, seeded

FAMILY = "quantize"
OPS = ("quantize_fp8",)
RECIPES = ("blockwise", "mxfp8")
#: name -> (E, k, H, F)
MODELS = {"Qwen3-30B-A3B": (128, 8, 2048, 768), "DeepSeek-like": (256, 8, 7168, 2048)}
_TOKENS = {"quick": 4096, "full": 8192}
_SMOKE = ("tiny", 6, 2, 35, 40, 12)  # name, E, k, T, H, F: counts not multiples of 32
WHAT = ("x rowwise", "x rowwise+colwise", "w")
_WEIGHT_EXPERTS = 32


def _padded_rows(counts: list[int], b: int) -> int:
    return sum(-(-c // b) * b for c in counts)


def _layouts(what: str, recipe: str) -> str:
    if what == "w":
        return "block+t" if recipe == "blockwise" else "rowwise+colwise"
    return what.removeprefix("x ")


def quantize_bytes(what: str, recipe: str, rows: int, cols: int, E: int, s: int,
                   counts: list[int] | None = None) -> int:  # fmt: skip
    """Fewest HBM bytes of one call (see the module doc); ``rows x cols`` per expert for
    ``"w"``, in all for the activations."""
    b = Fp8Recipe(recipe).block
    ss = 4 if recipe == "blockwise" else 1
    if what == "w":
        n = E * rows * cols
        if recipe == "blockwise":  # one set of 128 x 128 scales, two copies of the data
            return n * s + 2 * n + E * -(-rows // 128) * -(-cols // 128) * ss
        return n * s + 2 * n + E * (rows * -(-cols // b) + -(-rows // b) * cols) * ss
    total = rows * cols * s + rows * cols + rows * -(-cols // b) * ss
    if what == "x rowwise+colwise":
        padded = _padded_rows(counts, b)
        total += padded * cols + padded // b * cols * ss
    return total


def _case(name, E, k, T, H, F, what, recipe, dtype, check=True) -> Case:
    s = torch.empty((), dtype=dtype).element_size()
    M = T * k
    counts = [M // E + (1 if e < M % E else 0) for e in range(E)]
    if what == "w":  # a slice of the experts: the reference's fp32 copies fit beside them
        E = min(E, _WEIGHT_EXPERTS)
    rows, cols = (H, 2 * F) if what == "w" else (M, H)
    params = {"model": name, "what": what, "recipe": recipe, "E": E, "rows": rows, "cols": cols,
              "counts": counts}  # fmt: skip
    shape = f"E={E} [{rows}, {cols}]" if what == "w" else f"[{rows}, {cols}]"
    return Case("quantize_fp8", f"{name} {what} {recipe} {shape}", params, dtype, "fwd",
                bytes=quantize_bytes(what, recipe, rows, cols, E, s, counts), group=name,
                check=check)  # fmt: skip


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    if size == "smoke":
        return [_case(*_SMOKE, what, r, dtype) for what in WHAT for r in RECIPES]
    T = _TOKENS[size]
    return [_case(name, E, k, T, H, F, what, r, dtype)
            for name, (E, k, H, F) in MODELS.items() for what in WHAT for r in RECIPES]  # fmt: skip


def providers(op: str = "quantize_fp8") -> list[Provider]:
    return [Provider("triton", "mtp", tolerance=0.0),
            Provider("reference", "baseline", tolerance=0.0)]  # fmt: skip


def setup_quantize(case: Case, provider: str, device: torch.device) -> Run:
    """One launch of the case's layouts; returns the e4m3 data and scales of each (the
    column-wise copy cut to the experts' padded rows: the rest is not written)."""
    p = case.params
    backend = "reference" if provider == FLOAT64 else provider
    recipe = Fp8Recipe(p["recipe"])
    what, gen = p["what"], seeded(case, device)
    if what == "w":
        x = randn((p["E"], p["rows"], p["cols"]), case.dtype, device, gen)
        counts, used = None, None
    else:
        x = randn((p["rows"], p["cols"]), case.dtype, device, gen)
        counts = torch.tensor(p["counts"], dtype=torch.int64, device=device)
        used = _padded_rows(p["counts"], recipe.block)
    grouped = what == "x rowwise+colwise"
    layouts = _layouts(what, p["recipe"])

    def fn():
        got = quantize_many(x, counts if grouped else None, recipe, layouts, backend)
        out = []
        for t in got:
            cut = grouped and t.layout == "colwise"
            out += [t.data[:used] if cut else t.data,
                    t.scales[: used // recipe.block] if cut else t.scales]  # fmt: skip
        return out

    return Run(fn, inputs=[x] if counts is None else [x, counts])


SETUP = {"quantize_fp8": setup_quantize}
