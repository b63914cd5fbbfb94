"""Parallel layout and process groups.

- :class:`RankGenerator`, :func:`generate_masked_orthogonal_groups`,
  :func:`make_rank_generators`: which ranks form each group (Megatron-Core compatible).
- :func:`initialize_model_parallel` and the Megatron-Core getters
  (``get_tensor_model_parallel_group()``...): the torch.distributed groups themselves.
- ``python -m mtp.parallel --world-size 16 --tp 4 --pp 2``: print a layout.
- :class:`RankMismatchError`, :class:`CollectiveAbortedError` and :mod:`mtp.parallel.agreement`:
  ranks that disagree fail fast and clearly (``MTP_CHECK_COLLECTIVES=1`` checks every
  collective), and an error inside a collective region aborts the group instead of leaving
  its peers waiting.
- :mod:`mtp.parallel.params`: the parameter attributes that say how each gradient is reduced
  (tensor-parallel, expert, expert-tensor-parallel, sequence-parallel, already reduced), read by
  DDP, clipping, the optimizer, checkpoints and sequence-parallel marking alike.

The rank generator and the errors import without torch; the torch-dependent modules (process
groups, mappings, RNG, agreement checks) load on first use of one of their names, so that
``python -m mtp.parallel`` answers without importing torch.
"""

import importlib

from .errors import CollectiveAbortedError, RankMismatchError
from .rank_generator import *  # noqa: F401,F403
from .rank_generator import __all__ as _rank_all

# Modules whose names this package re-exports, loaded together on first use.
_LAZY_MODULES = ("parallel_state", "mappings", "random", "agreement", "params")
_AGREEMENT_NAMES = ("check_collectives_enabled", "set_check_collectives")
_loaded = False


def _load() -> list[str]:
    """Import the torch-dependent modules and bind their public names here."""
    global _loaded, __all__
    names = list(_rank_all) + ["CollectiveAbortedError", "RankMismatchError"]
    for module_name in _LAZY_MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        public = _AGREEMENT_NAMES if module_name == "agreement" else module.__all__
        for name in public:
            globals()[name] = getattr(module, name)
            if name not in names:
                names.append(name)
    __all__ = names
    _loaded = True
    return names


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if not _loaded:
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_load() if not _loaded else __all__))
