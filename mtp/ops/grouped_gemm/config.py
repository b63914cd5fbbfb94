"""How the Triton grouped GEMM runs: one frozen :class:`GroupedGemmConfig` from one
:func:`make_config`, and a scoped :func:`override` for tests and benchmarks.

:func:`make_config` picks, for one launch, the kernel family (TMA descriptors or pointers), the
tiles, the warps and stages, the grid (persistent or not) and the weight gradient's split, from
the architecture, the dtype, the sizes, the epilogue and whether the operands are TMA-aligned.
Every branch says why in the config's ``reason`` (the rule of flash-attention's ``tile_size.h``:
a choice and its reason side by side). The launchers in
:mod:`mtp.kernels.grouped_gemm_details.launch` decide nothing: they run the config.

TMA kernels run only where the operands allow (16-bit, TMA-aligned, an epilogue with a TMA
kernel, ``a`` rows read in order: a GEMM that gathers its rows through a row index takes the
pointer kernels, ``make_config(..., gather=True)``). Among those launches, the kernel family comes from :func:`override` (``kernel="tma"`` or
``"pointer"``), else ``MTP_TRITON_TMA=1/0`` (read by :func:`_tma_setting` only), both of which
act under the interpreter too (descriptors run there), else the default: TMA on sm_90+.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from mtp import settings
from mtp.kernels._common import gpu_like, interpreting, next_power_of_2
from mtp.kernels.grouped_gemm_details.launch import tma_aligned

__all__ = ["FORWARD_TABLE", "GroupedGemmConfig", "TUNED", "TUNED_BACKENDS", "WGRAD_TABLE",
           "choice_state", "device_arch", "fit_block", "make_config", "measured_backend",
           "override", "shape_class", "supports_warp_specialize", "tma_aligned"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """One launch of a grouped GEMM kernel.

    Forward (and data gradient): ``block_m x block_n`` output tiles, ``block_k`` deep. Weight
    gradient (``c[e] = a_e^T b_e`` of shape ``[K, N]``): ``block_m`` tiles K, ``block_n`` tiles N
    and ``block_k`` rows are reduced per step; ``group_m`` row tiles share a column tile (L2).
    ``persistent`` (pointer kernels): ``programs`` programs stride over the tiles instead of one
    program per worst-case tile (TMA kernels are always persistent on ``programs``).
    ``split``: the TMA weight gradient's row chunks per expert (fp32 partials, fixed-order sum).
    """

    kernel: str  # "tma" or "pointer"
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    programs: int = 0
    warp_specialize: bool = False
    flatten: bool = False
    split: int = 1
    reason: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kernel not in ("tma", "pointer"):
            raise ValueError(f"kernel must be 'tma' or 'pointer', got {self.kernel!r}")


def _tma(block_m, block_n, block_k, warps, stages, ws=True, flatten=True, reason=""):
    return GroupedGemmConfig("tma", block_m, block_n, block_k, num_warps=warps,
                             num_stages=stages, warp_specialize=ws, flatten=flatten,
                             reason=reason)  # fmt: skip


# Forward tiles of the TMA kernels by (architecture, regime), shared by fp16 and bf16 (same
# element size, same MMA rates; fp32 keeps the pointer kernels). Regime: average rows per expert
# M / E < 128 ("small": 64-row tiles waste at most 63 rows per expert), < 1024 ("medium") or
# more ("large": 128 x 256 tiles, the widest that fit 3 TMA stages in shared memory). Chosen
# from the wgmma / tcgen05 shapes and the shared-memory budget; the sm_90a rows below were
# checked on an H200 (bench/bench_grouped_gemm.py is the place to tune them).
# Warp specialisation: Triton 3.6 / 3.9 specialise the persistent loop on sm_100a with or without
# flattening. On sm_90a their (separate) Hopper pass only acts on an unflattened loop in a 4-warp
# kernel (one consumer warpgroup) and aborts on reductions in the kernel, hence the tile map
# computed by its own kernel; 128 x 256 tiles need two consumer warpgroups (8 warps), which that
# pass leaves unspecialised, so Hopper's large tiles take the flattened loop instead.
FORWARD_TABLE: dict[tuple[int, str], GroupedGemmConfig] = {
    (9, "small"): _tma(64, 128, 64, 4, 4, flatten=False,
                       reason="sm_90a, < 128 rows per expert: 64-row tiles (the native wgmma M), "
                              "one consumer warpgroup, warp-specialised unflattened loop"),
    # 8 warps: with 4, triton 3.6's warp-specialised loop on sm_90a stores only half of each
    # 128-row tile (the rest stays unwritten; H200, tools/gpu_diag_tma.py). 8 warps were right
    # and fastest there (0.053 / 0.206 ms vs 0.089 / 0.209 without warp specialisation).
    (9, "medium"): _tma(128, 128, 64, 8, 4, flatten=False,
                        reason="sm_90a, < 1024 rows per expert: 128 x 128, 8 warps (4 leave "
                               "half of each warp-specialised 128-row tile unwritten, H200)"),
    (9, "large"): _tma(128, 256, 64, 8, 3, ws=False,
                       reason="sm_90a, >= 1024 rows per expert: 128 x 256 in 3 stages, two "
                              "consumer warpgroups (Hopper's pass leaves them unspecialised: "
                              "flattened loop instead)"),
    (10, "small"): _tma(64, 128, 64, 4, 4, reason="sm_100a, < 128 rows per expert: 64-row tiles"),
    (10, "medium"): _tma(128, 128, 64, 4, 4, reason="sm_100a, < 1024 rows per expert: 128 x 128"),
    (10, "large"): _tma(128, 256, 64, 8, 3,
                        reason="sm_100a, >= 1024 rows per expert: 128 x 256 in 3 stages"),
}
# Weight-gradient tiles of the TMA kernels by architecture (4 warps: the form Hopper's pass
# takes; 8 on sm_100, where the epilogue's TMEM loads then need fewer registers per thread).
WGRAD_TABLE: dict[int, GroupedGemmConfig] = {
    # No warp specialisation on sm_90a: with it (4 warps) half of each 128-row tile stayed
    # unwritten on an H200 under triton 3.6; without it right and as fast or faster
    # (0.113 vs 0.157 ms with 8 warps on the mixed test shape, 0.365 vs 0.370 at Qwen3's).
    9: _tma(128, 128, 64, 4, 3, ws=False, flatten=False,
            reason="sm_90a weight gradient: no warp specialisation (with it half of each "
                   "128-row tile stayed unwritten, H200)"),
    10: _tma(128, 128, 64, 8, 3, flatten=False,
             reason="sm_100a weight gradient: warp-specialised, 8 warps"),
}
# Configs measured by the tuning sweep (tools/gpu_sweep.py on a lent GPU), written by
# tools/sweep_pick.py from the sweep's JSONL: (arch, dtype or "fp8-<recipe>", gemm, epilogue,
# shape class) -> {"config": GroupedGemmConfig fields but programs, "source": the sweep file,
# "commit": its bundle's commit, "ms": the measured median, "default_ms": today's rule's}.
# make_config takes an entry before its rules; none yet (no sweep has run on a GPU).
TUNED: dict[tuple[int, str, str, str, str], dict] = {}
# The fastest measured backend of forward + data gradient + weight gradient per shape class,
# from the same sweeps: (arch, dtype, shape class) -> {"backend": "triton" | "cutlass" |
# "torch", "source", "commit", "ms": {backend: ms}}. backend="auto" follows an entry when the call
# fuses no epilogue; none yet.
TUNED_BACKENDS: dict[tuple[int, str, str], dict] = {}
_MAX_SPLIT = 16
_MIN_ROWS_PER_SPLIT = 256
_SHARED_MEMORY_PER_SM = 228 * 1024  # H100 / H200 / B200
_INTERPRETER_PROGRAMS = 4  # persistent loops under the interpreter: a few programs, so the
#                            stride over the tiles is exercised

# The open override blocks, innermost last. Process-wide, not per thread: the autograd engine
# runs CUDA backwards on its own threads, which a thread- or context-local value would miss.
_OVERRIDES: list[dict] = []
_OVERRIDE_LOCK = threading.Lock()
# Bumped whenever an override block opens or closes: launch plans cached per key include it.
_GENERATION = [0]
_FIELDS = {f.name for f in dataclasses.fields(GroupedGemmConfig)}


# --------------------------------------------------------------------------------------------
# Inputs of the choice: settings, the device, the operands
# --------------------------------------------------------------------------------------------


def _tma_setting() -> bool | None:
    """``MTP_TRITON_TMA`` through :mod:`mtp.settings`: True / False forced, None the default
    choice. The one place this module reads it."""
    return settings.current().triton_tma


def choice_state() -> tuple:
    """What :func:`make_config` reads besides its arguments (the open :func:`override` blocks,
    ``MTP_TRITON_TMA``): part of the key of anything cached from a config."""
    return _GENERATION[0], settings.current().triton_tma  # _tma_setting's read


@contextlib.contextmanager
def override(**fields) -> Iterator[None]:
    """Force fields of every :class:`GroupedGemmConfig` made while the block runs (in any
    thread: the backward of a call made inside runs on autograd's threads; nested blocks add to
    the outer ones), for tests and benchmarks.

    ``override(kernel="pointer")`` takes the pointer kernels; ``override(kernel="tma")`` the TMA
    kernels wherever the operands allow (as ``MTP_TRITON_TMA=1``); any other field (tiles,
    ``split``, ``persistent``, ...) replaces the chosen value.
    """
    unknown = set(fields) - _FIELDS
    if unknown:
        raise ValueError(f"override: unknown GroupedGemmConfig fields {sorted(unknown)}; "
                         f"choose from {sorted(_FIELDS)}")  # fmt: skip
    with _OVERRIDE_LOCK:
        _OVERRIDES.append(fields)
        _GENERATION[0] += 1
    try:
        yield
    finally:
        with _OVERRIDE_LOCK:
            del _OVERRIDES[next(i for i, f in enumerate(_OVERRIDES) if f is fields)]
            _GENERATION[0] += 1


def _forced() -> dict:
    """The fields the open :func:`override` blocks force (inner blocks win)."""
    with _OVERRIDE_LOCK:
        return {k: v for fields in _OVERRIDES for k, v in fields.items()}


@functools.cache
def supports_warp_specialize() -> bool:
    """Whether this Triton's ``tl.range`` takes ``warp_specialize`` and ``flatten`` (3.4+)."""
    params = inspect.signature(tl.range.__init__).parameters
    return "warp_specialize" in params and "flatten" in params


@functools.cache
def _cuda_arch(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def device_arch(device: torch.device) -> tuple[int, int]:
    """``(arch, sms)``: the major compute capability and the SM count of a CUDA device;
    ``(0, 0)`` for tensors the interpreter runs (CPU)."""
    if not gpu_like(device) or interpreting():
        return 0, 0
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def fit_block(block: int, size: int) -> int:
    """``block`` shrunk to the problem (a power of two, at least 16: the MMA K/N granule)."""
    return max(16, min(block, next_power_of_2(size)))


def regime(M: int, E: int) -> str:
    """Group-size regime from the host-known sizes: average rows per expert ``M / E``."""
    avg = M / max(E, 1)
    return "small" if avg < 128 else ("medium" if avg < 1024 else "large")


def shape_class(M: int, N: int, K: int, E: int) -> str:
    """The key of the measured tables: the experts and the GEMM's K and N exactly (a model's
    layer), the rows per expert by :func:`regime` (they vary with the batch)."""
    return f"E{E} K{K} N{N} {regime(M, E)}"


def measured_backend(arch: int, dtype: torch.dtype, M: int, N: int, K: int, E: int) -> str | None:
    """The backend :data:`TUNED_BACKENDS` measured fastest for this shape class, or None."""
    if not TUNED_BACKENDS:
        return None
    entry = TUNED_BACKENDS.get((arch, str(dtype).replace("torch.", ""), shape_class(M, N, K, E)))
    return None if entry is None else entry["backend"]


@functools.lru_cache(maxsize=1024)
def _tuned(arch, dtype, M, N, K, E, gemm, epilogue, use_tma, tma_forced, sms):
    """The :data:`TUNED` entry of the shape class (``dtype``: a torch dtype or the FP8 key
    ``"fp8-<recipe>"``) as a config for ``sms`` SMs, or None."""
    entry = TUNED.get((arch, str(dtype).replace("torch.", ""), gemm, epilogue,
                       shape_class(M, N, K, E)))  # fmt: skip
    if entry is None:
        return None
    fields = dict(entry["config"])
    if (fields["kernel"] == "tma" and not use_tma) or (fields["kernel"] == "pointer"
                                                       and tma_forced):  # fmt: skip
        return None  # the operands (or an override) rule the measured kernel family out
    cfg = GroupedGemmConfig(**fields, reason=f"measured: {entry['source']} at {entry['commit']}")
    if cfg.kernel == "tma":
        return dataclasses.replace(cfg, persistent=True, programs=sms or _INTERPRETER_PROGRAMS)
    gated = 2 if epilogue in ("swiglu", "clamped_swiglu") else 1
    stage = (cfg.block_m + gated * cfg.block_n) * cfg.block_k
    size = 1 if isinstance(dtype, str) else dtype.itemsize  # "fp8-<recipe>": 1-byte operands
    return dataclasses.replace(cfg, programs=_resident(sms, cfg, size, stage))


# --------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------


def _pointer_forward(arch, dtype, M, N, K, E) -> GroupedGemmConfig:
    """Pointer forward tiles. 16-bit: BLOCK_K=64 (128-byte rows, the widest shared-memory
    swizzle for wgmma / tcgen05), 4 stages (128 KiB of shared memory at most); a row tile never
    spans two experts, so each wastes up to BLOCK_M - 1 rows: 64-row tiles (one warpgroup) when
    experts average under 256 rows, else 128 x 128 with 8 warps. fp32 (no tensor cores unless
    TF32 is allowed): 64 x 64 x 32, 4 warps. Narrow N or K shrink their block."""
    if arch == 0:
        return GroupedGemmConfig("pointer", 16, 16, 16, group_m=2, reason="interpreter: tiny "
                                 "tiles, so small test shapes span several tiles per expert")
    if dtype == torch.float32:
        bm, bn, bk, warps, stages, why = 64, 64, 32, 4, 3, "fp32: 64 x 64 x 32"
    elif M < 256 * max(E, 1):
        bm, bn, bk, warps, stages, why = 64, 128, 64, 4, 4, "< 256 rows per expert: 64-row tiles"
    else:
        bm, bn, bk, warps, stages, why = 128, 128, 64, 8, 4, ">= 256 rows per expert: 128 x 128"
    return GroupedGemmConfig("pointer", bm, fit_block(bn, N), fit_block(bk, K), num_warps=warps,
                             num_stages=stages, reason=f"pointer kernel, {why}")  # fmt: skip


def _with_activation(cfg: GroupedGemmConfig, activation: str) -> GroupedGemmConfig:
    """Room for the activation epilogue, which keeps several fp32 tiles alive next to the
    accumulators (backward: the derivative and the loaded ``h`` too): 128-row tiles use 64
    columns (SwiGLU: two accumulators and two ``b`` tiles per stage, so registers and shared
    memory match the plain 128 x 128 tile), 64-row tiles 8 warps. The clamped SwiGLU (stride-2
    gate/up loads, a larger epilogue) takes 32 columns. No spills on sm_90a / sm_100a."""
    if cfg.reason.startswith("interpreter"):
        return cfg
    if activation == "clamped_swiglu" and cfg.block_n > 32:
        return dataclasses.replace(cfg, block_n=32, reason=cfg.reason + "; clamped SwiGLU "
                                   "epilogue: 32 columns")  # fmt: skip
    if cfg.block_m == 128 and cfg.block_n > 64:
        return dataclasses.replace(cfg, block_n=64, reason=cfg.reason + "; activation "
                                   "epilogue: 64 columns")  # fmt: skip
    if cfg.block_m == 64:
        return dataclasses.replace(cfg, num_warps=8, reason=cfg.reason + "; activation "
                                   "epilogue: 8 warps")  # fmt: skip
    return cfg


def _tma_forward(arch, M, N, K, E, bias: bool) -> GroupedGemmConfig:
    if arch == 0:
        return _tma(16, 16, 16, 4, 4, ws=False, flatten=False,
                    reason="interpreter: tiny tiles, descriptors emulated")
    cfg = FORWARD_TABLE[(min(max(arch, 9), 10), regime(M, E))]
    ok = supports_warp_specialize()
    ws = cfg.warp_specialize and ok
    reason = cfg.reason
    if ws and bias and cfg.block_m * cfg.block_n > 128 * 128:
        # a bias epilogue on a tile wider than 128 x 128 would spill registers in the epilogue
        # warps (measured on the large-group sm_100a config)
        ws, reason = False, reason + "; bias epilogue on a > 128 x 128 tile: not specialised"
    return dataclasses.replace(cfg, block_n=fit_block(cfg.block_n, N),
                               block_k=fit_block(cfg.block_k, K), warp_specialize=ws,
                               flatten=cfg.flatten and ok, reason=reason)  # fmt: skip


def _pointer_wgrad(arch, dtype, K, N) -> GroupedGemmConfig:
    """``[K, N]`` tiles of one expert, reducing over its rows (3 stages: 96 KiB of shared
    memory for 16-bit)."""
    if arch == 0:
        return GroupedGemmConfig("pointer", 16, 16, 16, group_m=2, reason="interpreter: tiny "
                                 "tiles")  # fmt: skip
    if dtype == torch.float32:
        return GroupedGemmConfig("pointer", fit_block(64, K), fit_block(64, N), 32,
                                 reason="pointer weight gradient, fp32")  # fmt: skip
    return GroupedGemmConfig("pointer", fit_block(128, K), fit_block(128, N), 64, num_warps=8,
                             reason="pointer weight gradient, 16-bit: 128 x 128, 8 warps")


def _tma_wgrad(arch, M, N, K, E, sms) -> GroupedGemmConfig:
    """The table's tiles, with ``split`` row chunks per expert when ``E`` times the output
    tiles leave SMs idle and experts average at least 2 x 256 rows."""
    if arch == 0:
        return dataclasses.replace(_tma(16, 16, 16, 4, 3, flatten=False), group_m=2,
                                   warp_specialize=supports_warp_specialize(),
                                   reason="interpreter: tiny tiles")  # fmt: skip
    cfg = WGRAD_TABLE[min(max(arch, 9), 10)]
    cfg = dataclasses.replace(cfg, block_m=fit_block(cfg.block_m, K),
                              block_n=fit_block(cfg.block_n, N),
                              warp_specialize=cfg.warp_specialize and supports_warp_specialize())
    tiles = max(E, 1) * triton.cdiv(K, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    split = max(1, min(_MAX_SPLIT, sms // tiles, M // (max(E, 1) * _MIN_ROWS_PER_SPLIT)))
    reason = cfg.reason + (f"; {tiles} output tiles for {sms} SMs: rows split {split} ways"
                           if split > 1 else "")  # fmt: skip
    return dataclasses.replace(cfg, split=split, reason=reason)


def _fp8(arch, recipe, M, N, K, E, gemm) -> GroupedGemmConfig:
    """FP8 pointer kernels (:mod:`mtp.kernels.grouped_gemm_details.fp8`), no spills on sm_90a /
    sm_100a under Triton 3.6 and 3.9. Blockwise: ``block_k`` 128 (one scale block: each step's
    dot is promoted to fp32 and scaled), 64 columns (the promoted dot and the accumulator are
    both fp32 tiles in registers; 128 columns spill), 64-row forward tiles when experts average
    under 128 rows. MXFP8: 128-row tiles (the block-scaled ``tcgen05.mma``'s M; 64 rows fall
    back to an emulation), 128 x 128 x 128 with 4 warps forward, 64-deep steps with 8 warps for
    the weight gradient (its 128-deep steps spill)."""
    mx = recipe == "mxfp8"
    if arch == 0:
        return GroupedGemmConfig("pointer", 16, 16, 32, group_m=2, reason=f"interpreter, "
                                 f"{recipe}: tiny tiles, K steps of 32 (the MX block)")
    fit_k = max(32, fit_block(128, K))
    if mx:
        if gemm == "wgrad":
            return GroupedGemmConfig("pointer", 128, fit_block(128, N), 64, num_warps=8,
                                     reason="mxfp8 weight gradient: 128 x 128 x 64, 8 warps")
        return GroupedGemmConfig("pointer", 128, fit_block(128, N), fit_k, num_warps=4,
                                 reason="mxfp8: 128 x 128 x 128, 4 warps")  # fmt: skip
    if gemm == "wgrad":
        return GroupedGemmConfig("pointer", 128, fit_block(64, N), 128, num_warps=8,
                                 reason="blockwise weight gradient: 128 x 64 x 128, 8 warps")
    if M < 128 * max(E, 1):
        return GroupedGemmConfig("pointer", 64, fit_block(64, N), fit_k, num_warps=4,
                                 num_stages=4, reason="blockwise, < 128 rows per expert: "
                                 "64 x 64 x 128")  # fmt: skip
    return GroupedGemmConfig("pointer", 128, fit_block(64, N), fit_k, num_warps=8,
                             reason="blockwise: 128 x 64 x 128, 8 warps")  # fmt: skip


def _resident(sms: int, cfg: GroupedGemmConfig, elem_size: int, stage_elems: int) -> int:
    """Programs of a pointer kernel that fit on the GPU at once (shared-memory bound)."""
    if sms == 0:
        return _INTERPRETER_PROGRAMS
    per_sm = max(1, _SHARED_MEMORY_PER_SM // (stage_elems * elem_size * cfg.num_stages + 1024))
    return sms * per_sm


def make_config(
    arch: int,
    dtype: torch.dtype,
    M: int,
    N: int,
    K: int,
    E: int,
    *,
    gemm: str = "forward",
    activation: str | None = None,
    bias: bool = False,
    tma_ok: bool = False,
    sms: int = 0,
    recipe: str | None = None,
    gather: bool = False,
    recompute: bool = False,
) -> GroupedGemmConfig:
    """The config of one grouped GEMM launch.

    Args:
        arch: major compute capability (9: sm_90a, 10: sm_100a; older GPUs take the pointer
            kernels), or 0 under the Triton interpreter (tiny tiles).
        dtype: the operands' dtype.
        M, N, K, E: ``gemm="forward"``: ``[M, K] @ [E][K, N]`` (the data gradient is one too);
            ``gemm="wgrad"``: ``c[e] = a_e^T b_e`` of shape ``[K, N]`` over ``M`` rows.
        activation: the forward's activation epilogue (or its backward in the next GEMM's data
            gradient: same tiles), None for none. ``N`` is then the activation's width ``F``.
        bias: a per-expert bias epilogue.
        tma_ok: whether the operands are TMA-aligned (:func:`tma_aligned`) and the epilogue has
            a TMA kernel.
        sms: SMs of the device (0 under the interpreter): persistent grids and the split.
        recipe: ``"blockwise"`` or ``"mxfp8"`` for FP8 operands (the FP8 pointer kernels),
            None otherwise.
        gather: ``a``'s rows are read through a row index (the MoE dispatch's gather fused
            into the GEMM): the pointer kernels, which load any rows (a TMA descriptor reads a
            box of consecutive rows; Blackwell's row-gather TMA is not exposed by Triton 3.6).
        recompute: the activation's data gradient also rewrites the forward's ``act(h) * p``
            (what the next weight gradient reads, so that the forward need not keep it).
    """
    forced = _forced()
    want = {"tma": True, "pointer": False}.get(forced.get("kernel"), _tma_setting())
    # TMA only where the operands allow it; forced (override, MTP_TRITON_TMA=1) under the
    # interpreter too (descriptors run there); by default on sm_90+ only.
    use_tma = tma_ok and not gather and (arch >= 9 if want is None else want)
    extra = tuple(sorted((k, v) for k, v in forced.items() if k != "kernel"))
    cfg = None
    if recipe is not None:  # the FP8 kernels: pointer loads; a measured entry, else their rules
        if TUNED and arch:
            cfg = _tuned(arch, f"fp8-{recipe}", M, N, K, E, gemm, "none", False, False, sms)
        if cfg is None:
            return _choose(arch, dtype, M, N, K, E, gemm, activation, bias, False, sms, extra,
                           recipe)  # fmt: skip
        return dataclasses.replace(cfg, **dict(extra)) if extra else cfg
    if TUNED and arch:  # a measured config for this shape class first
        epilogue = activation or ("bias" if bias else "none")
        cfg = _tuned(arch, dtype, M, N, K, E, gemm, epilogue, use_tma, want is True, sms)
        if cfg is not None and extra:
            cfg = dataclasses.replace(cfg, **dict(extra))
    if cfg is None:
        cfg = _choose(arch, dtype, M, N, K, E, gemm, activation, bias, use_tma, sms, extra)
    if recompute and cfg.kernel == "pointer" and cfg.block_m == 128 and cfg.block_n > 32:
        # the pointer epilogue's extra pass over the tile spilled at 64 columns (sm_90a)
        cfg = dataclasses.replace(cfg, block_n=32, reason=cfg.reason + "; the data gradient "
                                  "rewrites fc1's output: 32 columns")  # fmt: skip
    if recompute and cfg.kernel == "tma" and cfg.block_m == 128 and cfg.num_stages > 3:
        # the TMA epilogue's rewrite spilled 4 B at 255 registers with 4 stages (sm_90a,
        # triton 3.6, the GPU machines'); 3 stages: none
        cfg = dataclasses.replace(cfg, num_stages=3, reason=cfg.reason + "; the data gradient "
                                  "rewrites fc1's output: 3 stages")  # fmt: skip
    if gather:
        cfg = dataclasses.replace(cfg, reason=cfg.reason + "; a rows gathered through a row "
                                  "index: pointer loads (TMA reads consecutive rows)")
    return cfg


@functools.lru_cache(maxsize=4096)
def _choose(arch, dtype, M, N, K, E, gemm, activation, bias, use_tma, sms, extra, recipe=None):
    """:func:`make_config` once the kernel family is known (cached: a call's host time)."""
    if recipe is not None:
        cfg = _fp8(arch, recipe, M, N, K, E, gemm)
    elif gemm == "wgrad":
        cfg = _tma_wgrad(arch, M, N, K, E, sms) if use_tma else _pointer_wgrad(arch, dtype, K, N)
    elif gemm != "forward":
        raise ValueError(f"gemm must be 'forward' or 'wgrad', got {gemm!r}")
    elif activation is not None:  # the TMA activation kernels take the pointer kernel's tiles
        cfg = _with_activation(_pointer_forward(arch, dtype, M, N, K, E), activation)
        if use_tma:
            cfg = dataclasses.replace(cfg, kernel="tma", flatten=supports_warp_specialize(),
                                      reason=cfg.reason + "; TMA loads")  # fmt: skip
    elif use_tma:
        cfg = _tma_forward(arch, M, N, K, E, bias)
    else:
        cfg = _pointer_forward(arch, dtype, M, N, K, E)
    if cfg.kernel == "tma":
        cfg = dataclasses.replace(cfg, persistent=True, programs=sms or _INTERPRETER_PROGRAMS)
    elif gemm == "forward":
        gated = 2 if activation in ("swiglu", "clamped_swiglu") else 1
        stage = (cfg.block_m + gated * cfg.block_n) * cfg.block_k
        resident = _resident(sms, cfg, dtype.itemsize, stage)
        # The worst-case grid holds up to E * cdiv(N, BN) programs without work; each holds an
        # SM's shared memory while it starts and exits. When they are more than one wave,
        # stride over the tiles from one wave of programs instead.
        persistent = sms > 0 and E * triton.cdiv(N, cfg.block_n) > resident
        cfg = dataclasses.replace(cfg, persistent=persistent, programs=resident)
    return dataclasses.replace(cfg, **dict(extra)) if extra else cfg
