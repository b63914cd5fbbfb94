"""Build script for mtp.

The Triton kernels live in the top-level ``kernels/`` folder and the microbenchmarks in
``bench/``; ``mtp/kernels`` and ``mtp/bench`` are relative symbolic links to them, so they are the
ordinary subpackages ``mtp.kernels`` and ``mtp.bench`` everywhere: a wheel (the files are copied
through the links), an editable install and a checkout on ``PYTHONPATH``. Users only ever
``import mtp``.

An optional CUDA extension (``csrc/``, CUTLASS grouped GEMM) is built here when its sources exist,
nvcc is available and its build inputs (nvidia-cutlass, pybind11, ninja) are importable; set
``MTP_BUILD_CUDA=1`` to require it or ``MTP_BUILD_CUDA=0`` to skip it (csrc/build_ext.py).
This script never imports torch, so ``pip install -e .`` works with a CPU-only torch and cannot
pull a CUDA build of torch into an isolated build environment.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _build_ext_module():
    """csrc/build_ext.py (owns the nvcc/CUTLASS details), loaded without importing torch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mtp_build_ext", ROOT / "csrc" / "build_ext.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _want_cuda_extension() -> bool:
    """False when MTP_BUILD_CUDA=0, when there is no csrc/, or (unforced) when nvcc is absent.

    Unforced (MTP_BUILD_CUDA unset) the build also needs its inputs importable here (CUTLASS
    headers, pybind11, ninja): an isolated ``pip install -e .`` skips it with a message and stays
    fast; ``pip install --no-build-isolation -e .`` in an environment that has them builds it;
    ``make cuda-ext`` builds it in place. MTP_BUILD_CUDA=1 makes a missing input an error.
    """
    flag = os.environ.get("MTP_BUILD_CUDA", "").strip()
    if flag == "0":
        return False
    has_sources = (ROOT / "csrc" / "build_ext.py").is_file()
    if flag == "1":
        if not has_sources:
            raise RuntimeError("MTP_BUILD_CUDA=1 but there is no csrc/ folder to build")
        return True
    nvcc = shutil.which("nvcc") or (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc")
    return has_sources and Path(nvcc).exists()


def _cuda_extensions() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for the CUTLASS grouped GEMM extension ``mtp._cuda_gemm``."""
    if not _want_cuda_extension():
        return [], {}
    module = _build_ext_module()
    extensions = module.extensions(ROOT)
    return extensions, (module.cmdclass() if extensions else {})


_ext_modules, _cmdclass = _cuda_extensions()
packages = find_packages(include=["mtp", "mtp.*"])  # mtp.kernels, mtp.bench: through the links

setup(
    name="mtp",
    version="0.1.0",
    description="Hand-written GPU kernels and thin layers for Megatron-style tensor- and "
    "expert-parallel training",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    install_requires=[
        "torch>=2.4",
        "triton>=3.6",
        "numpy",
    ],
    extras_require={
        # The peers the integrations are tested against, pinned (mtp.integrations); megatron-core
        # and torchtitan pin torch themselves, so the Makefile installs them with --no-deps.
        "test": [
            "pytest>=7", "hypothesis>=6", "pytest-xdist>=3", "transformers==5.24.0",
            "accelerate==1.15.0", "matplotlib>=3.5",
        ],
        "hf": ["transformers>=4.51", "safetensors"],
        "bench": ["matplotlib>=3.5", "tqdm>=4", "pytest-benchmark>=4"],
    },
    entry_points={"console_scripts": ["mtp-bench = mtp.bench.cli:main"]},
    ext_modules=_ext_modules,
    cmdclass=_cmdclass,
)
