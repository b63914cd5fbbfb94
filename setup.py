"""Build script for mtp.

The Triton kernels live in the top-level ``kernels/`` folder and are installed as ``mtp.kernels``
(a ``package_dir`` mapping), so users only ever ``import mtp``.

An optional CUDA extension (``csrc/``, CUTLASS grouped GEMM) is built here when its sources exist
and nvcc is available; set ``MTP_BUILD_CUDA=1`` to require it or ``MTP_BUILD_CUDA=0`` to skip it.
This script never imports torch, so ``pip install -e .`` works with a CPU-only torch and cannot
pull a CUDA build of torch into an isolated build environment.
"""

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _want_cuda_extension() -> bool:
    """True when the CUDA extension should be built (sources present and nvcc found, or forced)."""
    flag = os.environ.get("MTP_BUILD_CUDA", "").strip()
    if flag == "0":
        return False
    has_sources = (ROOT / "csrc").is_dir()
    if flag == "1":
        if not has_sources:
            raise RuntimeError("MTP_BUILD_CUDA=1 but there is no csrc/ folder to build")
        return True
    nvcc = shutil.which("nvcc") or (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc")
    return has_sources and Path(nvcc).exists()


def _cuda_extensions() -> list:
    """Extension modules built from csrc/ (none until the CUTLASS backend lands)."""
    if not _want_cuda_extension():
        return []
    # csrc/build_ext.py (added with the CUTLASS backend) owns the nvcc/CUTLASS details and
    # exposes ``extensions(root) -> list[setuptools.Extension]``.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mtp_build_ext", ROOT / "csrc" / "build_ext.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extensions(ROOT)


packages = find_packages(include=["mtp", "mtp.*"])
packages += ["mtp.kernels"] + ["mtp.kernels." + p for p in find_packages(where="kernels")]
# The microbenchmarks (top-level bench/) install as mtp.bench, for the mtp-bench command; from a
# checkout, `python -m bench` runs the same code.
packages += ["mtp.bench"]

setup(
    name="mtp",
    version="0.1.0",
    description="Hand-written GPU kernels and thin layers for Megatron-style tensor- and "
    "expert-parallel training",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"mtp.kernels": "kernels", "mtp.bench": "bench"},
    install_requires=[
        "torch>=2.4",
        "triton>=3.2",
        "numpy",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "pytest-xdist>=3"],
        "bench": ["matplotlib>=3.5", "tqdm>=4", "pytest-benchmark>=4"],
    },
    entry_points={"console_scripts": ["mtp-bench = mtp.bench.cli:main"]},
    ext_modules=_cuda_extensions(),
)
