"""The FP8 families of the tuning sweep (``gg_fp8_fwd``, ``gg_fp8_wgrad``): operands quantised
once by :mod:`mtp.ops.quantize` in the architecture's recipe (:func:`sweep_space.fp8_recipe`),
each candidate launched through :mod:`mtp.kernels.grouped_gemm_details.launch`'s FP8 plans,
checked against the product of the dequantised operands (fp32 on the device, float64 under the
interpreter: the kernel's own error, the output's bf16 rounding) and timed beside the BF16
``F.grouped_mm`` of the original operands (the figure FP8 must beat). On ``meta`` tensors the
quantisation is its fake (shapes only): the compile-only path of :mod:`sweep_compile`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from bench.core import check_limit, rel_err
from mtp.kernels.grouped_gemm_details import launch
from mtp.ops.grouped_gemm.backends import torch_grouped_mm
from mtp.ops.grouped_gemm.fp8 import weight_operands
from mtp.ops.grouped_gemm.plans import _scales
from mtp.ops.quantize import Fp8Recipe, quantize_many
from sweep_run import GemmRun, counts_for, run_config
from sweep_space import FP8_FAMILIES, Shape, fp8_recipe


def _tensor(shape, device, scale=1.0) -> torch.Tensor:
    if str(device) == "meta":
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    return (torch.randn(shape, device=device) * scale).to(torch.bfloat16)


@dataclasses.dataclass
class Fp8GemmRun:
    """Quantised operands of one FP8 family at shape ``s`` (``arch`` picks the recipe)."""

    family: str
    s: Shape
    device: torch.device | str
    arch: int = 9

    def __post_init__(self) -> None:
        E, M, K, N, dev = self.s.E, self.s.M, self.s.K, self.s.N, self.device
        torch.manual_seed(0)
        self.recipe = Fp8Recipe(fp8_recipe(self.family, self.arch))
        backend = "reference" if str(dev) == "meta" else "triton"
        self.counts = counts_for(self.s, dev)
        self.x = _tensor((M, K), dev)
        if self.family == "gg_fp8_fwd":
            self.w = _tensor((E, K, N), dev, scale=K**-0.5)
            self.a = quantize_many(self.x, None, self.recipe, "rowwise", backend)[0]
            self.b = weight_operands(self.w, self.recipe, False, False, backend)[0]
            self.outs = (torch.empty((M, N), dtype=torch.bfloat16, device=dev),)
        else:  # dw[e] = x_e^T dy_e from expert-padded column-wise operands
            self.dy = _tensor((M, N), dev)
            self.a = quantize_many(self.x, self.counts, self.recipe, "colwise", backend)[0]
            self.b = quantize_many(self.dy, self.counts, self.recipe, "colwise", backend)[0]
            self.outs = (torch.empty((E, K, N), dtype=torch.bfloat16, device=dev),)
        self._expected = None

    @property
    def flops(self) -> int:
        return 2 * self.s.M * self.s.K * self.s.N

    def run(self, cand: dict) -> tuple[torch.Tensor, ...]:
        cfg, a, b, mx = run_config(cand, self.device), self.a, self.b, self.recipe.name == "mxfp8"
        sa, sb = _scales(a.scales), _scales(b.scales)
        if self.family == "gg_fp8_fwd":
            group_k, group_n = b.block
            plan = launch.fp8_forward_plan(a.data, sa, b.data, sb, self.counts, self.outs[0],
                                           cfg, mx=mx, group_k=group_k, group_n=group_n)
        else:
            plan = launch.fp8_wgrad_plan(a.data, sa, b.data, sb, self.counts, self.outs[0], cfg,
                                         mx=mx, group=a.block[0])  # fmt: skip
        plan(a.data, sa, b.data, sb, self.counts, self.outs[0])
        return self.outs

    def checked(self, cand: dict) -> tuple[torch.Tensor, ...]:
        self.outs[0].fill_(float("nan"))
        return self.run(cand)

    def reference(self) -> tuple[torch.Tensor, ...]:
        """The dequantised operands' product per expert (float64 on CPU, fp32 on the GPU)."""
        dtype = torch.float32 if self.x.is_cuda else torch.float64
        da, db = self.a.dequantize(dtype), self.b.dequantize(dtype)
        counts, row = self.counts.tolist(), 0
        if self.family == "gg_fp8_fwd":
            out = torch.zeros(self.outs[0].shape, dtype=dtype, device=da.device)
            for e, m in enumerate(counts):
                out[row:row + m] = da[row:row + m] @ db[e]
                row += m
            return (out,)
        out, block = torch.zeros(self.outs[0].shape, dtype=dtype, device=da.device), self.a.block[0]
        for e, m in enumerate(counts):
            out[e] = da[row:row + m].T @ db[row:row + m]
            row += -(-m // block) * block
        return (out,)

    def check(self, outs) -> dict:
        if self._expected is None:
            self._expected = self.reference()
        err = rel_err(outs, self._expected)
        limit = check_limit(torch.bfloat16)
        return {"rel_err": err, "limit": limit, "ok": err <= limit}

    def peers(self) -> dict[str, Callable[[], object]]:
        """GPU only: the BF16 ``F.grouped_mm`` of the original operands (what FP8 must beat)."""
        mm = torch_grouped_mm()
        if not self.x.is_cuda or mm is None:
            return {}
        offs = torch.cumsum(self.counts, 0, dtype=torch.int32)
        if self.family == "gg_fp8_fwd":
            return {"F.grouped_mm-bf16": lambda: mm(self.x, self.w, offs=offs)}
        return {"F.grouped_mm-bf16": lambda: mm(self.x.t(), self.dy, offs=offs)}


def gemm_run(family: str, s: Shape, device, arch: int = 9):
    """The run of a grouped GEMM family: :class:`sweep_run.GemmRun`, or for the FP8 families
    :class:`Fp8GemmRun` in ``arch``'s recipe."""
    if family in FP8_FAMILIES:
        return Fp8GemmRun(family, s, device, arch)
    return GemmRun(family, s, device)
