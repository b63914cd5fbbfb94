"""Parallel layout and process groups.

- :class:`RankGenerator`, :func:`generate_masked_orthogonal_groups`,
  :func:`make_rank_generators`: which ranks form each group (Megatron-Core compatible).
- :func:`initialize_model_parallel` and the Megatron-Core getters
  (``get_tensor_model_parallel_group()``...), :mod:`~mtp.parallel.parallel_state`: the
  torch.distributed groups themselves; :func:`get_device_mesh` a ``DeviceMesh`` view of them;
  :class:`ParallelDims` one layer's sizes and groups as one validated value.
- ``python -m mtp.parallel --world-size 16 --tp 4 --pp 2``: print a layout.
- :class:`RankMismatchError`, :class:`CollectiveAbortedError`, :mod:`mtp.parallel.agree` (one
  :func:`~mtp.parallel.agree.agree` for rank agreement) and :mod:`mtp.parallel.agreement`:
  ranks that disagree fail fast and clearly (``MTP_CHECK_COLLECTIVES=1`` checks every
  collective), and an error inside a collective region aborts the group instead of leaving its
  peers waiting.
- :mod:`mtp.parallel.params`: the parameter attributes that say how each gradient is reduced
  (tensor-parallel, expert, expert-tensor-parallel, sequence-parallel, already reduced), read by
  DDP, clipping, the optimizer, checkpoints and sequence-parallel marking alike.

Imports: the rank generator and the errors need no torch and are imported here; the names of
the torch-dependent modules listed in ``_TORCH_MODULES`` (process groups, mappings, RNG,
parameter attributes) are the ones under ``TYPE_CHECKING`` below, and are bound from their
module on first use, so that ``python -m mtp.parallel`` answers without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from .errors import CollectiveAbortedError, RankMismatchError
from .rank_generator import *  # noqa: F401,F403
from .rank_generator import __all__ as _rank_all

if TYPE_CHECKING:  # the torch-dependent names, as a reader and a type checker see them
    from .agreement import check_collectives_enabled, set_check_collectives  # noqa: F401
    from .device_mesh import *  # noqa: F401,F403
    from .dims import *  # noqa: F401,F403
    from .mappings import *  # noqa: F401,F403
    from .parallel_state import *  # noqa: F401,F403
    from .params import *  # noqa: F401,F403
    from .random import *  # noqa: F401,F403

#: module -> the names this package takes from it (None: the module's ``__all__``).
_TORCH_MODULES: dict[str, tuple[str, ...] | None] = {
    "parallel_state": None,
    "device_mesh": None,
    "dims": None,
    "mappings": None,
    "random": None,
    "params": None,
    "agreement": ("check_collectives_enabled", "set_check_collectives"),
}

__all__ = [*_rank_all, "CollectiveAbortedError", "RankMismatchError"]


def __getattr__(name: str):
    """Bind a torch-dependent name from its module (see the module docstring)."""
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule itself
        return importlib.import_module(f"{__name__}.{name}")
    for module_name, names in _TORCH_MODULES.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        if name in (names if names is not None else module.__all__):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
