"""What ``tools/gpu_check.py`` reads off the machine: versions and the GPU (in a child process,
so a broken torch or CUDA cannot take the checker down) and nvidia-smi's fields; and how it ends
a child's whole process group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import textwrap

__all__ = ["SMI_FIELDS", "TORCH_PROBE", "first_line", "kill_group", "nvidia_smi", "smi",
           "which_nvcc"]

SMI_FIELDS = ("name", "driver_version", "pci.bus_id", "memory.total", "power.limit",
              "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "clocks.applications.graphics", "temperature.gpu", "persistence_mode",
              "compute_mode")  # fmt: skip
# Versions, the GPU and the bench's folder name for it (printed as one JSON line).
TORCH_PROBE = textwrap.dedent("""\
    import json, torch, triton
    d = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
             cuda_available=torch.cuda.is_available())
    if d["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        d.update(device=p.name, capability=f"{p.major}.{p.minor}",
                 sm_count=p.multi_processor_count, memory_bytes=p.total_memory)
        try:
            from bench.env import device_folder
            from bench.peaks import match_peak

            peak = match_peak(p.name, p.multi_processor_count)
            d["folder"] = device_folder(dict(mode="gpu", device=p.name),
                                        peak.name if peak else None)
        except Exception as exc:
            d["folder_error"] = repr(exc)
    print(json.dumps(d))
    """)


def which_nvcc() -> str:
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def smi(args: list[str]) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def nvidia_smi() -> dict | None:
    """GPU 0's nvidia-smi fields (clocks as read now, MHz); None without nvidia-smi. A field
    this driver does not know is asked alone, so one bad name costs only itself."""
    fmt = "--format=csv,noheader"
    text = smi([f"--query-gpu={','.join(SMI_FIELDS)}", fmt])
    if text is not None:
        return dict(zip(SMI_FIELDS, (v.strip() for v in text.splitlines()[0].split(","))))
    if smi(["-L"]) is None:
        return None
    fields = {}
    for field in SMI_FIELDS:
        one = smi([f"--query-gpu={field}", fmt])
        fields[field] = one.splitlines()[0].strip() if one else None
    return fields


def first_line(cmd: list[str], pick: str = "") -> str | None:
    """The first line of ``cmd``'s output that contains ``pick`` (None when it fails)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if pick in ln]
    return lines[0] if out.returncode == 0 and lines else None


def kill_group(proc: subprocess.Popen) -> None:
    """Terminate ``proc``'s whole process group, then kill it if it does not end in 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
