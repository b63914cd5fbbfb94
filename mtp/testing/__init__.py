"""Test and benchmark helpers (public: the test suite and ``bench/`` both use them).

- :mod:`~mtp.testing.numerics`: :func:`assert_close` against a float64 reference, the tolerance
  tables and :func:`own_error_atol` (k x PyTorch's own low-precision error).
- :mod:`~mtp.testing.distributed`: :func:`run_distributed` runs ``fn(rank, world_size, *args)``
  in real processes joined in a process group (gloo on CPU).
- :mod:`~mtp.testing.aot`: :func:`compile_for_targets` / :func:`ptxas_info` compile a Triton
  kernel ahead of time for sm_90 and sm_100 without a GPU, and read registers and spills.
- :mod:`~mtp.testing.counters`: :func:`count_host_syncs` / :func:`count_collectives` count how
  often a block waits for the device and what it sends over the wire.
- :mod:`~mtp.testing.graph_safety`: :func:`assert_graph_safe`, the CPU-side proxy for "a CUDA
  graph can capture this".
- :mod:`~mtp.testing.traffic` (:func:`~mtp.testing.traffic.count_traffic`): bytes each Triton
  program reads and writes, counted by address under the interpreter, plus aten bytes, launches
  and host syncs: ``bytes / floor`` of an op.

Every name below is importable from ``mtp.testing`` itself.
"""

from mtp.testing.aot import (
    SHARED_MEMORY_LIMIT,
    KernelBuild,
    KernelCompileError,
    PtxasInfo,
    _find_ptxas,  # noqa: F401 - used by the AOT tests
    compile_for_targets,
    ptxas_info,
)
from mtp.testing.counters import (
    CollectiveCall,
    count_collectives,
    count_host_syncs,
    saved_activation_bytes,
)
from mtp.testing.distributed import RankFailedError, free_port, run_distributed
from mtp.testing.graph_safety import GraphSafetyError, assert_graph_safe
from mtp.testing.numerics import (
    OP_TOLERANCES,
    RELATIVE_ERROR_LIMITS,
    TOLERANCES,
    assert_close,
    own_error_atol,
    relative_error_limit,
    tolerance,
)

__all__ = [
    "TOLERANCES",
    "OP_TOLERANCES",
    "RELATIVE_ERROR_LIMITS",
    "tolerance",
    "assert_close",
    "own_error_atol",
    "relative_error_limit",
    "RankFailedError",
    "run_distributed",
    "free_port",
    "KernelBuild",
    "KernelCompileError",
    "PtxasInfo",
    "SHARED_MEMORY_LIMIT",
    "compile_for_targets",
    "ptxas_info",
    "assert_graph_safe",
    "GraphSafetyError",
    "CollectiveCall",
    "count_collectives",
    "count_host_syncs",
    "saved_activation_bytes",
]
