"""Parallel layout and process groups.

- :class:`RankGenerator`, :func:`generate_masked_orthogonal_groups`,
  :func:`make_rank_generators`: which ranks form each group (Megatron-Core compatible).
- :func:`initialize_model_parallel` and the Megatron-Core getters
  (``get_tensor_model_parallel_group()``...), :mod:`~mtp.parallel.parallel_state`: the
  torch.distributed groups themselves; :func:`get_device_mesh` a ``DeviceMesh`` view of them;
  :class:`ParallelDims` one layer's sizes and groups as one validated value.
- ``python -m mtp.parallel --world-size 16 --tp 4 --pp 2``: print a layout.
- :class:`RankMismatchError`, :class:`CollectiveAbortedError`, :mod:`mtp.parallel.agree` (one
  :func:`~mtp.parallel.agree.agree` for rank agreement), :mod:`mtp.parallel.collective_check`
  (the agreement row each tensor-parallel collective exchanges first) and
  :mod:`mtp.parallel.agreement`: ranks that disagree fail fast and clearly, and an error inside
  a collective region aborts the group instead of leaving its peers waiting.
- :mod:`mtp.parallel.params`: the parameter attributes that say how each gradient is reduced
  (tensor-parallel, expert, expert-tensor-parallel, sequence-parallel, already reduced), read by
  DDP, clipping, the optimizer, checkpoints and sequence-parallel marking alike.

Imports are plain. The rank generator and the errors need no torch; the other modules do. The
one exception is the layout tool: while ``python -m mtp.parallel`` locates its ``__main__``,
this package is imported with ``sys.argv[0] == "-m"`` (Python's documented behaviour of ``-m``)
and the target named in ``sys.orig_argv``; then only the torch-free modules are imported, so the
tool answers on a machine without torch.
"""

from __future__ import annotations

import sys

from .errors import CollectiveAbortedError, RankMismatchError
from .rank_generator import *  # noqa: F401,F403
from .rank_generator import __all__ as _rank_all

#: The module names ``python -m`` takes for the layout tool.
_LAYOUT_TOOL = ("mtp.parallel", "mtp.parallel.__main__")


def _run_as_layout_tool() -> bool:
    """Whether this import is ``python -m mtp.parallel`` locating its ``__main__``."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] in _LAYOUT_TOOL
        if arg.startswith("-m"):  # python -mmtp.parallel
            return arg[2:] in _LAYOUT_TOOL
    return False


__all__ = [*_rank_all, "CollectiveAbortedError", "RankMismatchError"]

if not _run_as_layout_tool():
    from . import agree, agreement, collective_check, device_mesh, dims, mappings
    from . import parallel_state, params, random
    from .agreement import check_collectives_enabled, set_check_collectives
    from .device_mesh import *  # noqa: F401,F403
    from .dims import *  # noqa: F401,F403
    from .mappings import *  # noqa: F401,F403
    from .parallel_state import *  # noqa: F401,F403
    from .params import *  # noqa: F401,F403
    from .random import *  # noqa: F401,F403

    __all__ += ["check_collectives_enabled", "set_check_collectives"]
    __all__ += device_mesh.__all__ + dims.__all__ + mappings.__all__
    __all__ += parallel_state.__all__ + params.__all__ + random.__all__
