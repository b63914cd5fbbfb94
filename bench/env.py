"""Runtime set-up and the environment record of a benchmark run.

:func:`prepare_runtime` must run before anything imports triton: without CUDA it turns on the
Triton interpreter (``TRITON_INTERPRET=1``), so the same kernels run on CPU tensors.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

from mtp import settings

__all__ = ["prepare_runtime", "environment", "device_folder", "git_revision"]

REPO = Path(__file__).resolve().parent.parent


def prepare_runtime(mode: str = "auto") -> str:
    """Pick ``"gpu"`` or ``"cpu"`` (``mode="auto"``: gpu when CUDA is available) and set the
    environment for it. Returns the mode."""
    import torch

    if mode == "auto":
        mode = "gpu" if torch.cuda.is_available() else "cpu"
    if mode == "gpu" and not torch.cuda.is_available():
        raise SystemExit(
            "mtp-bench: --mode gpu needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    if mode == "cpu":
        import sys

        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise SystemExit(
                "mtp-bench: triton was imported before the CPU mode could turn on its interpreter; "
                "set TRITON_INTERPRET=1"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return mode


def git_revision() -> str | None:
    """``<sha>`` of the mtp checkout (``+dirty`` with uncommitted changes); outside git (the
    copy a lent GPU machine gets) ``$MTP_REVISION`` (``tools/gpu_check.py`` sets it to the
    commit the bundle was made at), else None."""
    if settings.current().revision:
        return settings.current().revision
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


def environment(mode: str) -> dict:
    """Device, driver, library versions, mtp revision and date of this run."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    env = {
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "mtp_revision": git_revision(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    }
    if mode == "gpu":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        env.update(device="cpu", driver=None, cuda=None)
    return env


def device_folder(env: dict, peak_name: str | None) -> str:
    """Results folder name: the GPU model (``H100-SXM``), or ``cpu-structural``."""
    if env["mode"] != "gpu":
        return "cpu-structural"
    name = peak_name or env["device"].replace("NVIDIA", "")
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-") or "gpu"
