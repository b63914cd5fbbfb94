"""GPU measurements (used only when CUDA is available; nothing here runs on a CPU machine).

For one :class:`~mtp.bench.core.Run`:

- **device time**: ``triton.testing.do_bench`` median (with the 20th and 80th percentiles as the
  spread), warm-up excluded; ``do_bench`` zeroes a 256 MB buffer before every timed call, which
  flushes the L2 cache, so memory-bound ops are timed from HBM, not from the cache;
- **host time per call**: the time to *issue* one call, on a host clock, from an idle device up
  to the return of the Python call, before synchronising (median of many calls): the CPU
  overhead that decides multi-stream against one-launch grouped GEMM;
- **launches per call**: kernels (and memcpy/memset) the profiler sees on the device for one
  call;
- **peak memory**: ``torch.cuda.max_memory_allocated`` during one call, above what was allocated
  before it (the workspace the call needs on top of its inputs).

:func:`measure_ceilings` measures the two rates this device really reaches (METHOD.md): a large
device-to-device copy (bytes read + written) and a large bf16 matmul.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch

from .core import Run

__all__ = ["GpuTimer", "measure_ceilings"]

_QUANTILES = [0.5, 0.2, 0.8]


def _sync() -> None:
    torch.cuda.synchronize()


class GpuTimer:
    """Times :class:`Run` objects on the current CUDA device.

    Args:
        warmup_ms, rep_ms: ``do_bench``'s warm-up and measuring budgets (milliseconds).
        host_calls: calls whose issue time is measured (median reported).
        count_launches: take the profiler pass that counts launches (seconds per record; the
            quick run leaves it out: launches are counted on CPU, ``bench/counting.py``).
    """

    def __init__(
        self,
        warmup_ms: int = 25,
        rep_ms: int = 100,
        host_calls: int = 20,
        host_budget_s: float = 1.0,
        count_launches: bool = True,
    ) -> None:
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.count_launches = count_launches
        self.host_calls, self.host_budget_s = host_calls, host_budget_s

    def device_time(self, run: Run) -> dict[str, float]:
        from triton.testing import do_bench

        median, p20, p80 = do_bench(
            run.fn,
            warmup=self.warmup_ms,
            rep=self.rep_ms,
            grad_to_none=run.grad_to_none or None,
            quantiles=_QUANTILES,
        )
        return {"median_ms": median, "p20_ms": p20, "p80_ms": p80}

    def host_time(self, run: Run) -> float:
        """Median seconds to issue one call (the device idle before each call); up to
        ``host_calls`` calls, fewer (at least 3) when they take longer than ``host_budget_s``."""
        times: list[float] = []
        deadline = time.perf_counter() + self.host_budget_s
        while len(times) < self.host_calls and (len(times) < 3 or time.perf_counter() < deadline):
            _sync()
            start = time.perf_counter()
            run.fn()
            times.append(time.perf_counter() - start)
            _sync()
        return statistics.median(times)

    def launches(self, run: Run) -> dict[str, int]:
        """Device activities of one call: kernels, and memcpy/memset separately."""
        from torch.profiler import ProfilerActivity, profile

        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run.fn()
            _sync()
        kernels = copies = 0
        for event in prof.events():
            if _on_device(event):
                name = event.name.lower()
                if "memcpy" in name or "memset" in name:
                    copies += 1
                else:
                    kernels += 1
        return {"kernels": kernels, "memcpy_memset": copies}

    def peak_memory(self, run: Run) -> int:
        _sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = run.fn()
        _sync()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return int(peak)

    def measure(self, run: Run) -> dict[str, Any]:
        """Every figure of one run (the call has been made once already: compiled, warm).

        Only the device time is required; a secondary figure that cannot be taken here (e.g.
        the profiler without CUPTI) is None, with the reason in ``errors``."""
        figures: dict[str, Any] = self.device_time(run)
        errors = {}
        secondary = [("host_us", lambda: {"host_us": self.host_time(run) * 1e6}),
                     ("peak_mem_bytes", lambda: {"peak_mem_bytes": self.peak_memory(run)})]
        if self.count_launches:
            secondary.insert(1, ("kernels", lambda: self.launches(run)))
        for key, measure in secondary:
            try:
                figures.update(measure())
            except Exception as exc:  # keep the timing; say what is missing
                figures[key] = None
                errors[key] = f"{type(exc).__name__}: {exc}"[:200]
        if errors:
            figures["errors"] = errors
        return figures


def _on_device(event) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and str(device_type).endswith("CUDA")


def measure_ceilings(timer: GpuTimer | None = None) -> dict[str, float]:
    """The copy bandwidth and bf16 matmul rate this device reaches (bytes/s and FLOP/s)."""
    from triton.testing import do_bench

    timer = timer or GpuTimer()

    def median_ms(fn) -> float:
        return do_bench(fn, warmup=timer.warmup_ms, rep=timer.rep_ms, return_mode="median")

    nbytes = 2 << 30  # 2 GiB source: far larger than any L2
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(functools.partial(dst.copy_, src))
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(functools.partial(torch.matmul, a, b))
    src = dst = a = b = None
    torch.cuda.empty_cache()
    return {
        "copy_bytes_per_s": 2 * nbytes / (copy_ms * 1e-3),
        "bf16_matmul_flops_per_s": 2 * n**3 / (mm_ms * 1e-3),
        "copy_bytes": 2 * nbytes,
        "matmul_n": n,
    }
