"""What the tuning sweep (``tools/gpu_sweep.py``) tries: its families, their bench shapes and
the candidate configs of each, the current default first (the baseline of the same run).

Grouped GEMM families (bf16, the shapes of ``bench/bench_grouped_gemm.py``'s quick run: 4096
tokens, fc1, balanced routing), each a config of :class:`mtp.ops.grouped_gemm.config.
GroupedGemmConfig` run through the launchers of :mod:`mtp.kernels.grouped_gemm_details.launch`:

- ``gg_fwd``: ``y = x @ w[e]``; ``gg_dgrad``: ``dx = dy @ w[e]^T`` (the forward with the weight
  read transposed); ``gg_wgrad``: ``dw[e] = x_e^T dy_e`` (split over rows as a candidate field);
- ``gg_act`` / ``gg_dact``: Mixtral's fc1 with the SwiGLU and probability epilogue, and fc2's
  data gradient with the activation's backward (:func:`mtp.ops.grouped_mlp`'s kernels).

Memory-bound families (the bench's quick shapes, forward+backward through the op): ``ce``,
``bias_act``, ``permute``; a candidate there is a set of the kernel module's launch constants
(:data:`PATCHES`), applied for the call by :func:`tools.sweep_run.patched`.

A candidate is a dict: the config's fields (GEMMs) or the constants (the others), plus
``"baseline": True`` on the default. Candidates are pruned here by rules that need no compile
(shared memory of the pipeline stages, accumulator registers per thread, a warp-specialised
loop over 128-row tiles with 4 warps on sm_90a, which left half of each tile unwritten on an
H200 under triton 3.6); the dry run's sm_90a compile drops the rest (spills, shared memory).

FP8 families (``gg_fp8_fwd``: the forward and data-gradient kernel, ``gg_fp8_wgrad``: the
ragged-K weight gradient, :mod:`mtp.kernels.grouped_gemm_details.fp8`) at the same shapes, in the
recipe of the architecture (:func:`fp8_recipe`: blockwise on sm_90, MXFP8 on sm_100), operands
quantised by :func:`mtp.ops.quantize` and checked against the dequantised operands; their
entries take the key ``fp8-<recipe>`` in place of the dtype.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from mtp.ops.grouped_gemm import config as gc

#: name -> (E, top-k, H, F): bench/bench_grouped_gemm.py's MODELS, in its (decisive-first) order
MODELS = {
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "DeepSeek-like": (256, 8, 7168, 2048),
    "OLMoE-like": (64, 8, 2048, 1024),
    "Mixtral-like": (8, 2, 4096, 14336),
}
TOKENS = 4096
FP8_FAMILIES = ("gg_fp8_fwd", "gg_fp8_wgrad")
GEMM_FAMILIES = ("gg_fwd", "gg_wgrad", "gg_dgrad", "gg_act", "gg_dact", *FP8_FAMILIES)
MEMORY_FAMILIES = ("ce", "bias_act", "permute")
#: in run order: what the issue's targets rest on first
FAMILIES = GEMM_FAMILIES + MEMORY_FAMILIES
#: the make_config ``gemm`` and epilogue of each GEMM family (the TUNED table's key parts)
GEMM_KIND = {"gg_fwd": ("forward", "none"), "gg_dgrad": ("forward", "none"),
             "gg_wgrad": ("wgrad", "none"), "gg_act": ("forward", "swiglu"),
             "gg_dact": ("forward", "swiglu"), "gg_fp8_fwd": ("forward", "none"),
             "gg_fp8_wgrad": ("wgrad", "none")}  # fmt: skip
ACT_MODEL = "Mixtral-like"  # the fused epilogue's case (35 % slower than unfused on the H200)
SMEM_BUDGET = 200 * 1024  # pipeline stages' bytes; the compile checks the real 227 KiB
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread (of 255)
_FIELDS = [f.name for f in dataclasses.fields(gc.GroupedGemmConfig) if f.name != "reason"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One GEMM of a family: ``[M, K] x [K, N]`` per expert over ``E`` experts (``wgrad``:
    ``[K, N]`` per expert reduced over ``M`` rows); ``N`` is the activation's width ``F``."""

    model: str
    E: int
    M: int
    K: int
    N: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def gemm_shape(family: str, model: str, tokens: int = TOKENS) -> Shape:
    """The GEMM of ``family`` at ``model``'s fc1 (``gg_dgrad``: K and N swapped; ``gg_dact``:
    fc2's data gradient, K = H, N = F)."""
    E, k, H, F = MODELS[model]
    M = tokens * k
    if family == "gg_dgrad":
        return Shape(model, E, M, F, H)
    return Shape(model, E, M, H, F)


def gemm_cases(family: str) -> list[Shape]:
    if family in ("gg_act", "gg_dact"):
        return [gemm_shape(family, ACT_MODEL)]
    return [gemm_shape(family, m) for m in MODELS]


def tiny_shape(family: str) -> Shape:
    """The interpreter's shape: a few tiles, an empty expert and a zero tail (TMA-aligned)."""
    return Shape("tiny", 4, 96, 80, 40 if family in ("gg_act", "gg_dact") else 72)


def fp8_recipe(family: str, arch: int) -> str | None:
    """The FP8 recipe a family runs on ``arch`` (None: not an FP8 family): the one its users
    train with there (blockwise on Hopper; MXFP8, the block-scaled MMA, on Blackwell)."""
    if family not in FP8_FAMILIES:
        return None
    return "mxfp8" if arch >= 10 else "blockwise"


def table_dtype(family: str, arch: int) -> str:
    """The dtype part of the family's ``TUNED`` key: ``bfloat16`` or ``fp8-<recipe>``."""
    recipe = fp8_recipe(family, arch)
    return "bfloat16" if recipe is None else f"fp8-{recipe}"


def default_config(family: str, s: Shape, arch: int, sms: int) -> gc.GroupedGemmConfig:
    """What make_config picks today for the family at shape ``s`` (TMA-aligned bf16)."""
    gemm, epilogue = GEMM_KIND[family]
    act = None if epilogue == "none" else epilogue
    return gc.make_config(arch, torch.bfloat16, s.M, s.N, s.K, s.E, gemm=gemm, activation=act,
                          tma_ok=True, sms=sms, recipe=fp8_recipe(family, arch))  # fmt: skip


def as_candidate(cfg: gc.GroupedGemmConfig, **extra) -> dict:
    return {**{f: getattr(cfg, f) for f in _FIELDS}, **extra}


def to_config(cand: dict) -> gc.GroupedGemmConfig:
    return gc.GroupedGemmConfig(**{f: cand[f] for f in _FIELDS if f in cand})


def _stage_bytes(bm: int, bn: int, bk: int, gated: bool) -> int:
    return (bm * bk + (2 if gated else 1) * bk * bn) * 2


def _fits(bm, bn, bk, warps, stages, gated=False) -> bool:
    acc = bm * bn * (2 if gated else 1) // (32 * warps)
    return stages * _stage_bytes(bm, bn, bk, gated) <= SMEM_BUDGET and acc <= MAX_ACC_REGS


def _warps(bm: int, bn: int) -> tuple[int, ...]:
    if bm * bn >= 128 * 256:
        return (8,)
    return (4,) if bm == 64 and bn <= 128 else (4, 8)


def _known_bad(arch: int, bm: int, warps: int, ws: bool) -> bool:
    """sm_90a, triton 3.6: a warp-specialised loop over 128-row tiles with 4 warps stores half
    of each tile (H200, tools/gpu_diag_tma.py)."""
    return arch == 9 and ws and bm >= 128 and warps == 4


FWD_TILES = ((64, 128, 64), (64, 256, 64), (128, 128, 64), (128, 256, 64), (128, 128, 128),
             (64, 128, 128), (128, 64, 64), (256, 128, 64))  # fmt: skip
WGRAD_TILES = ((128, 128, 64), (128, 256, 64), (256, 128, 64), (64, 128, 64), (128, 128, 32),
               (128, 64, 64))  # fmt: skip
ACT_TILES = ((128, 64, 64), (64, 128, 64), (128, 128, 64), (64, 64, 64), (128, 32, 64),
             (64, 64, 128))  # fmt: skip


def _tma_forward(arch: int, sms: int, s: Shape) -> list[dict]:
    out = []
    ws_ok = gc.supports_warp_specialize()
    for (bm, bn, bk), stages in itertools.product(FWD_TILES, (3, 4, 5)):
        bn, bk = gc.fit_block(bn, s.N), gc.fit_block(bk, s.K)
        for warps in _warps(bm, bn):
            if not _fits(bm, bn, bk, warps, stages) or (stages == 5 and bm * bn > 64 * 128):
                continue
            for ws, flatten in ((False, True), (True, False), (False, False)):
                if (ws and not ws_ok) or _known_bad(arch, bm, warps, ws):
                    continue
                if not ws and not flatten and (bm, bn) != (128, 128):
                    continue  # the plain loop only at the middle tile
                out.append(dict(kernel="tma", block_m=bm, block_n=bn, block_k=bk, group_m=8,
                                num_warps=warps, num_stages=stages, persistent=True,
                                programs=sms, warp_specialize=ws, flatten=flatten and ws_ok,
                                split=1))  # fmt: skip
    return out


def _pointer_forward(arch: int, sms: int, s: Shape, gated: bool) -> list[dict]:
    out = []
    for (bm, bn, bk, warps), persistent in itertools.product(
            ((64, 128, 64, 4), (128, 128, 64, 8), (128, 64, 64, 4), (64, 64, 64, 4)), (False, True)):
        bn = gc.fit_block(bn, s.N)
        if not _fits(bm, bn, bk, warps, 4, gated):
            continue
        per_sm = max(1, 228 * 1024 // (4 * _stage_bytes(bm, bn, bk, gated) + 1024))
        out.append(dict(kernel="pointer", block_m=bm, block_n=bn, block_k=gc.fit_block(bk, s.K),
                        group_m=8, num_warps=warps, num_stages=4, persistent=persistent,
                        programs=sms * per_sm, warp_specialize=False, flatten=False, split=1))
    return out


def _wgrad(arch: int, sms: int, s: Shape, default: gc.GroupedGemmConfig) -> list[dict]:
    out = []
    ws_ok = gc.supports_warp_specialize()
    splits = sorted({1, default.split, 2 * default.split} if s.E <= 16 or default.split > 1
                    else {1})  # fmt: skip
    for (bm, bn, bk), stages, split in itertools.product(WGRAD_TILES, (3, 4), splits):
        bm, bn = gc.fit_block(bm, s.K), gc.fit_block(bn, s.N)
        for warps in _warps(bm, bn):
            if not _fits(bm, bn, bk, warps, stages):
                continue
            for ws in (False, True):
                if (ws and not ws_ok) or _known_bad(arch, bm, warps, ws):
                    continue
                out.append(dict(kernel="tma", block_m=bm, block_n=bn, block_k=bk, group_m=8,
                                num_warps=warps, num_stages=stages, persistent=True,
                                programs=sms, warp_specialize=ws, flatten=False, split=split))
    out += [dict(kernel="pointer", block_m=gc.fit_block(bm, s.K), block_n=gc.fit_block(bn, s.N),
                 block_k=64, group_m=8, num_warps=w, num_stages=3, persistent=False, programs=0,
                 warp_specialize=False, flatten=False, split=1)
            for bm, bn, w in ((128, 128, 8), (64, 128, 4))]  # fmt: skip
    return out


def _act(arch: int, sms: int, s: Shape) -> list[dict]:
    out = []
    flat = gc.supports_warp_specialize()
    for (bm, bn, bk), stages, warps in itertools.product(ACT_TILES, (3, 4), (4, 8)):
        bn = gc.fit_block(bn, s.N)
        if not _fits(bm, bn, bk, warps, stages, gated=True):
            continue
        for flatten in sorted({False, flat}):
            out.append(dict(kernel="tma", block_m=bm, block_n=bn, block_k=bk, group_m=8,
                            num_warps=warps, num_stages=stages, persistent=True, programs=sms,
                            warp_specialize=False, flatten=flatten, split=1))
    return out + _pointer_forward(arch, sms, s, gated=True)


FP8_TILES = ((128, 64, 128), (64, 64, 128), (128, 128, 128), (64, 128, 128), (128, 64, 64),
             (128, 128, 64), (256, 64, 128), (64, 64, 64))  # fmt: skip
FP8_WGRAD_TILES = ((128, 64, 128), (128, 128, 128), (64, 64, 128), (64, 128, 128), (128, 64, 64),
                   (128, 128, 64))  # fmt: skip


def _fp8_fits(bm: int, bn: int, bk: int, warps: int, stages: int, mx: bool) -> bool:
    """Pipeline stages in shared memory (1-byte operands) and the registers of the fp32
    accumulator plus, blockwise, the promoted dot of each step (two fp32 tiles)."""
    tiles = 1 if mx else 2
    return (stages * (bm + bn) * bk <= SMEM_BUDGET
            and tiles * bm * bn // (32 * warps) <= MAX_ACC_REGS)  # fmt: skip


def _fp8(family: str, arch: int, sms: int, s: Shape) -> list[dict]:
    """FP8 pointer kernels: tiles, warps, stages and (forward) a persistent grid; ``block_k``
    divides the 128-wide scale block (blockwise) or is a multiple of 32 (MXFP8, whose
    block-scaled MMA takes 128-row tiles)."""
    mx, wgrad = fp8_recipe(family, arch) == "mxfp8", family == "gg_fp8_wgrad"
    out = []
    for (bm, bn, bk), stages in itertools.product(FP8_WGRAD_TILES if wgrad else FP8_TILES,
                                                  (3, 4)):  # fmt: skip
        bm = gc.fit_block(bm, s.K) if wgrad else bm
        bn, bk = gc.fit_block(bn, s.N), bk if wgrad else max(32, gc.fit_block(bk, s.K))
        for warps, persistent in itertools.product((4, 8), (False,) if wgrad else (False, True)):
            if (mx and bm < 128) or not _fp8_fits(bm, bn, bk, warps, stages, mx):
                continue
            per_sm = max(1, 228 * 1024 // (stages * (bm + bn) * bk + 1024))
            out.append(dict(kernel="pointer", block_m=bm, block_n=bn, block_k=bk,
                            group_m=8, num_warps=warps, num_stages=stages,
                            persistent=persistent, programs=sms * per_sm if persistent else 0,
                            warp_specialize=False, flatten=False, split=1))  # fmt: skip
    return out


def gemm_candidates(family: str, s: Shape, arch: int, sms: int) -> list[dict]:
    """The default (``baseline``) first, then every other candidate once."""
    default = default_config(family, s, arch, sms)
    if family in FP8_FAMILIES:
        found = _fp8(family, arch, sms, s)
    elif family == "gg_wgrad":
        found = _wgrad(arch, sms, s, default)
    elif family in ("gg_act", "gg_dact"):
        found = _act(arch, sms, s)
    else:
        found = _tma_forward(arch, sms, s) + _pointer_forward(arch, sms, s, gated=False)
    base = as_candidate(default, baseline=True)
    seen = {cand_key(base)}  # programs aside: the device's
    out = [base]
    for cand in found:
        key = cand_key(cand)
        if key not in seen:
            seen.add(key)
            out.append(cand)
    return out


# --------------------------------------------------------------------------------------------
# Memory-bound families: a candidate is a set of the kernel module's launch constants
# --------------------------------------------------------------------------------------------

#: family -> (the kernels modules whose constants a candidate sets, the bench module and ops)
PATCHES = {
    "ce": (("mtp.kernels.cross_entropy",), "bench.bench_cross_entropy", ("cross_entropy",)),
    "bias_act": (("mtp.kernels.bias_act",), "bench.bench_bias_act", ("bias_gelu", "bias_swiglu")),
    "permute": (("mtp.kernels.moe_permute", "mtp.kernels.moe_token_major"), "bench.bench_permute",
                ("permute", "unpermute")),
}


def memory_candidates(family: str) -> list[dict]:
    """Launch constants of the family's kernels module; the first is today's (baseline)."""
    if family == "ce":
        base = dict(LANES=512, NUM_WARPS=8, GRAD_MAX_REGISTERS=128, MAX_PROGRAMS=1024)
        grid = [dict(LANES=lanes, NUM_WARPS=w, GRAD_MAX_REGISTERS=reg, MAX_PROGRAMS=p)
                for lanes, w, reg, p in itertools.product((256, 512, 1024), (4, 8, 16),
                                                          (128, 168), (1024, 2048))
                if lanes >= 32 * w and reg * 32 * w <= 65536]  # fmt: skip
    elif family == "bias_act":
        base = dict(TILE_ELEMENTS=4096, BWD_TILE_ELEMENTS=2048, NUM_WARPS=8, MAX_BLOCK_N=1024)
        grid = [dict(TILE_ELEMENTS=t, BWD_TILE_ELEMENTS=b, NUM_WARPS=w, MAX_BLOCK_N=n)
                for t, b, w, n in itertools.product((2048, 4096, 8192), (1024, 2048, 4096),
                                                    (4, 8), (512, 1024))
                if b <= t]  # fmt: skip
    elif family == "permute":
        base = dict(MAX_BLOCK_H=1024, TOKEN_TILE=8192, MAX_S_BLOCK=8, ZERO_ROWS=16)
        grid = [dict(MAX_BLOCK_H=h, TOKEN_TILE=t, MAX_S_BLOCK=s, ZERO_ROWS=16)
                for h, t, s in itertools.product((512, 1024, 2048), (4096, 8192, 16384), (4, 8))]
    else:
        raise ValueError(f"unknown memory-bound family {family!r}")
    return [dict(base, baseline=True)] + [g for g in grid if g != base]


def cand_key(cand: dict) -> str:
    """A candidate's stable name (its JSONL id and the dry run's drop list): the config fields
    but ``programs`` (the device's), or the constants."""
    if "kernel" not in cand:
        return " ".join(f"{k}={v}" for k, v in sorted(cand.items()) if k != "baseline")
    return (f"{cand['kernel']} {cand['block_m']}x{cand['block_n']}x{cand['block_k']} "
            f"w{cand['num_warps']} s{cand['num_stages']} g{cand['group_m']} "
            f"ws{int(cand['warp_specialize'])} fl{int(cand['flatten'])} "
            f"p{int(cand['persistent'])} split{cand['split']}")
