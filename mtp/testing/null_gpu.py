"""The null-GPU stand-in: mtp's whole host path on CPU, with kernels compiled but never run.

What an eager call costs the host (argument checks, autograd, allocation, launch plans, Triton's
launch path) is measured here without a GPU. :func:`install` makes Triton's CUDA driver a stub
for an sm_90a device (H100-like properties): kernels are really compiled for sm_90a (PTX and
cubin, cached in Triton's cache directory), Triton's Python launch path runs as on a GPU, and
only the compiled C launcher is replaced by :func:`_null_launch`, which counts the launch and
returns. Tensors stay on the CPU; :func:`mtp.kernels._common.gpu_like` reports them as a GPU's,
so the ops take their GPU paths (configs, persistent grids, plans) rather than the
interpreter's. Aten ops that do device work still run, for real, on the CPU, except
``torch._assert_async`` (the device-side data checks read outputs no kernel wrote): a no-op.

The process must not have ``TRITON_INTERPRET`` set (the kernels must be ``JITFunction`` s).
The stand-in is process-wide; :func:`uninstall` restores the driver and the patched
``torch.cuda`` functions. Used by the host benchmark (``mtp-bench --host``) and the host-path
budget tests.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import types
from collections.abc import Iterator

import torch

__all__ = ["NullGpu", "install", "launches", "null_gpu", "uninstall"]

#: Properties of the stand-in device (an H100 SXM): what launchers and configs read.
_PROPS = dict(
    name="NVIDIA H100 80GB HBM3 (null-GPU stand-in)",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=80 * 2**30,
    max_threads_per_multi_processor=2048,
    regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232448,
    L2_cache_size=50 * 2**20,
    warp_size=32,
)
_TRITON_PROPS = {
    "max_shared_mem": 232448,
    "max_num_regs": 65536,
    "multiprocessor_count": 132,
    "warpSize": 32,
    "sm_clock_rate": 1980000,
    "mem_clock_rate": 2619000,
    "mem_bus_width": 5120,
}


@dataclasses.dataclass
class NullGpu:
    """The installed stand-in: ``launches`` counts kernel launches since install (or reset)."""

    launches: int = 0
    driver: object = None
    allocator_token: object = None
    saved: dict = dataclasses.field(default_factory=dict)


_STATE: NullGpu | None = None


_INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _null_launch(*args) -> None:
    """Count the launch and read each tensor argument's address, as the C launcher does (the
    kernel arguments are the last argument, a tuple, on newer Tritons; trailing on older).
    Integer tensors are zeroed: aten ops that index with a kernel's integer output (maps,
    offsets) stay in range. Values are lost; host costs do not depend on them."""
    _STATE.launches += 1
    kernel_args = args[-1] if type(args[-1]) is tuple else args
    for a in kernel_args:
        if type(a) is torch.Tensor:
            a.data_ptr()
            if a.dtype in _INDEX_DTYPES:
                a.data.zero_()  # .data: autograd's version counter untouched


class _Utils:
    """What Triton's launch path asks of ``driver.active.utils``: no CUDA call reaches a device."""

    launch = staticmethod(_null_launch)

    @staticmethod
    def load_binary(name, kernel, shared, device):
        # (module, function, n_regs, n_spills, n_max_threads)
        return (1, 1, 0, 0, 1024)

    @staticmethod
    def get_device_properties(device):
        return dict(_TRITON_PROPS)

    @staticmethod
    def fill_tma_descriptor(*args):
        return bytes(128)

    fill_tma_descriptor_tiled = fill_tma_descriptor

    @staticmethod
    def set_printf_fifo_size(size):
        return None

    @staticmethod
    def unload_module(module):
        return None

    @staticmethod
    def is_stream_capturing(stream):
        return False

    @staticmethod
    def build_signature_metadata(signature):
        return tuple(signature)


def _launcher_cls():
    """Triton's own ``CudaLauncher`` where it takes ``utils.launch`` (triton >= 3.7); for older
    Tritons, which build a C launcher per kernel, the same class with that build replaced."""
    from triton.backends.nvidia import driver as nv

    if "utils.launch" in _source(nv.CudaLauncher.__init__):
        # The argument annotations its C utils module would define.
        if getattr(nv, "PyKernelArg", None) is None:
            nv.PyKernelArg = collections.namedtuple("PyKernelArg", "nested_tuple type")
            nv.ARG_CONSTEXPR, nv.ARG_KERNEL, nv.ARG_TUPLE = 0, 1, 2
        return nv.CudaLauncher

    class NullLauncher(nv.CudaLauncher):
        def __init__(self, src, metadata):
            saved = nv.compile_module_from_src, nv.library_dirs
            nv.compile_module_from_src = lambda **kw: types.SimpleNamespace(launch=_null_launch)
            nv.library_dirs = list
            try:
                super().__init__(src, metadata)
            finally:
                nv.compile_module_from_src, nv.library_dirs = saved

    return NullLauncher


def _source(fn) -> str:
    import inspect

    return inspect.getsource(fn)


def _driver():
    from triton.backends.nvidia.driver import CudaDriver

    class NullDriver(CudaDriver):
        def __init__(self):  # no CudaUtils (it would build against libcuda)
            self.utils = _Utils()
            self.launcher_cls = _launcher_cls()
            # C builtins, as cheap as torch's: device 0, stream 0, capability (9, 0).
            self.get_current_device = int
            self.get_current_stream = abs
            self.set_current_device = abs
            self.get_device_capability = lambda device=None: (_PROPS["major"], _PROPS["minor"])

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

    return NullDriver()


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8)


def _no_assert(cond, message=None) -> None:
    return None


def _props(device=None):
    return types.SimpleNamespace(**_PROPS)


def install() -> NullGpu:
    """Make Triton launch on the stand-in and mtp treat CPU tensors as a GPU's (idempotent)."""
    global _STATE
    if _STATE is not None:
        return _STATE
    from triton.runtime import _allocation, driver

    from mtp.kernels import _common

    if _common.interpreting():
        raise RuntimeError(
            "the null-GPU stand-in needs compiled kernels: run it in a process without "
            "TRITON_INTERPRET (the kernels were decorated for the interpreter)"
        )
    state = NullGpu(driver=_driver())
    saved = state.saved
    saved["driver"] = driver._active  # None: Triton creates its default when asked
    for name, fn in (
        ("get_device_properties", _props),
        ("get_device_capability", lambda device=None: (_PROPS["major"], _PROPS["minor"])),
        ("current_device", int),
        ("get_device_name", lambda device=None: _PROPS["name"]),
    ):
        saved[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, fn)
    # Device-side asserts read what the kernels would have written: never run, never fail.
    saved["_assert_async"] = torch._assert_async
    torch._assert_async = _no_assert
    # Kernels that build tensor descriptors on the device take scratch from Triton's allocator.
    state.allocator_token = _allocation._allocator.set(_scratch)
    driver.set_active(state.driver)
    _common.set_null_gpu(True)
    _STATE = state
    return state


def uninstall() -> None:
    """Undo :func:`install`."""
    global _STATE
    if _STATE is None:
        return
    from triton.runtime import _allocation, driver

    from mtp.kernels import _common

    saved = _STATE.saved
    driver._active = saved.pop("driver")
    _allocation._allocator.reset(_STATE.allocator_token)
    torch._assert_async = saved.pop("_assert_async")
    for name, fn in saved.items():
        setattr(torch.cuda, name, fn)
    _common.set_null_gpu(False)
    _STATE = None


def launches() -> int:
    """Kernel launches since :func:`install` (0 when not installed)."""
    return 0 if _STATE is None else _STATE.launches


@contextlib.contextmanager
def null_gpu() -> Iterator[NullGpu]:
    """:func:`install` for the block, then :func:`uninstall` (unless it was installed before)."""
    was = _STATE is not None
    state = install()
    try:
        yield state
    finally:
        if not was:
            uninstall()
