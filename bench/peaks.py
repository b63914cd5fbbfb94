"""Peak HBM bandwidth and dense bf16 (and FP8) tensor-core rates of the GPUs mtp targets.

The benchmarks divide the floor time of an op (``bytes / bandwidth`` or ``flops / rate``,
whichever is larger) by the measured time: the fraction of the datasheet floor reached. The
numbers are NVIDIA's published board specifications (dense, i.e. without 2:4 sparsity: the
datasheets print the sparse figure, twice the dense one, and mark it with an asterisk).
A GPU run also measures the two ceilings it can actually reach (a large device-to-device copy
and a large bf16 matmul, :func:`mtp.bench.timing.measure_ceilings`) and reports the fraction of
those as well, because a datasheet rate is a limit, not a promise.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["DevicePeak", "PEAKS", "match_peak"]

TB = 1e12


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """One GPU model's datasheet limits.

    Attributes:
        name: the model as the tables print it (also the results folder name).
        hbm_bytes_per_s: peak device-memory bandwidth, bytes/s.
        bf16_flops_per_s: dense bf16 tensor-core rate, FLOP/s (fp16 is the same on these parts).
        sms: streaming multiprocessors (tells the SXM and PCIe H100 apart when the name does not).
        source: where the numbers come from.
        fp8_flops_per_s: dense FP8 (e4m3) tensor-core rate, FLOP/s: the floor of the FP8
            providers (twice the bf16 rate on these parts; MXFP8 on Blackwell the same).
    """

    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    sms: int | None
    source: str
    fp8_flops_per_s: float | None = None

    def ridge(self) -> float:
        """FLOP per byte above which an op is compute-bound on this device."""
        return self.bf16_flops_per_s / self.hbm_bytes_per_s


_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (2023): "
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024): "
_B200_DS = "NVIDIA HGX B200 / DGX B200 datasheet (2024, 1000 W configuration): "
_GB200_DS = "NVIDIA GB200 NVL72 datasheet (2024, per GPU = rack figure / 72): "

#: Ordered most specific first; :func:`match_peak` takes the first whose pattern matches.
PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    (r"GB200", DevicePeak(
        "GB200", 8.0 * TB, 2500e12, None,
        _GB200_DS + "HBM3e 8 TB/s; FP16/BF16 tensor 5 PFLOPS with sparsity -> 2.5 dense; "
        "FP8 10 PFLOPS with sparsity -> 5 dense", 5000e12)),
    (r"B200", DevicePeak(
        "B200", 8.0 * TB, 2250e12, None,
        _B200_DS + "HBM3e 8 TB/s; FP16/BF16 tensor 4.5 PFLOPS with sparsity -> 2.25 dense; "
        "FP8 9 PFLOPS with sparsity -> 4.5 dense", 4500e12)),
    (r"H200.*NVL", DevicePeak(
        "H200 NVL", 4.8 * TB, 835e12, None,
        _H200_DS + "H200 NVL HBM3e 4.8 TB/s; BF16 tensor 1,671 TFLOPS with sparsity; "
        "FP8 3,341 TFLOPS with sparsity", 1670.5e12)),
    (r"H200", DevicePeak(
        "H200 SXM", 4.8 * TB, 989.4e12, None,
        _H200_DS + "H200 SXM HBM3e 4.8 TB/s; BF16 tensor 1,979 TFLOPS with sparsity; "
        "FP8 3,958 TFLOPS with sparsity", 1978.8e12)),
    (r"H100.*NVL", DevicePeak(
        "H100 NVL", 3.9 * TB, 835e12, None,
        _H100_DS + "H100 NVL HBM3 3.9 TB/s; BF16 tensor 1,671 TFLOPS with sparsity; "
        "FP8 3,341 TFLOPS with sparsity", 1670.5e12)),
    (r"H100.*PCIe", DevicePeak(
        "H100 PCIe", 2.0 * TB, 756e12, 114,
        _H100_DS + "H100 PCIe HBM2e 2.0 TB/s; BF16 tensor 1,513 TFLOPS with sparsity; "
        "FP8 3,026 TFLOPS with sparsity", 1513e12)),
    (r"H100", DevicePeak(
        "H100 SXM", 3.35 * TB, 989.4e12, 132,
        _H100_DS + "H100 SXM HBM3 3.35 TB/s; BF16 tensor 1,979 TFLOPS with sparsity; "
        "FP8 3,958 TFLOPS with sparsity", 1978.8e12)),
)


def match_peak(device_name: str, sm_count: int | None = None) -> DevicePeak | None:
    """The datasheet entry for a ``torch.cuda.get_device_name()`` string, or None.

    ``"NVIDIA H100 80GB HBM3"`` is the SXM part; a plain ``"H100"`` with 114 SMs is the PCIe
    card (some drivers print no form factor), so ``sm_count`` breaks that tie.
    """
    for pattern, peak in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if peak.name == "H100 SXM" and sm_count == 114:
                return next(p for pat, p in PEAKS if p.name == "H100 PCIe")
            return peak
    return None
