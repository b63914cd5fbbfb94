"""Parallel layout and process groups.

- :class:`RankGenerator`, :func:`generate_masked_orthogonal_groups`,
  :func:`make_rank_generators`: which ranks form each group (Megatron-Core compatible).
- :func:`initialize_model_parallel` and the Megatron-Core getters
  (``get_tensor_model_parallel_group()``...): the torch.distributed groups themselves.
- ``python -m mtp.parallel --world-size 16 --tp 4 --pp 2``: print a layout.
"""

from .parallel_state import *  # noqa: F401,F403
from .parallel_state import __all__ as _state_all
from .rank_generator import *  # noqa: F401,F403
from .rank_generator import __all__ as _rank_all

__all__ = list(_rank_all) + list(_state_all)

# Tensor/sequence-parallel communication mappings and the model-parallel RNG.
from .mappings import *  # noqa: F401,F403,E402
from .mappings import __all__ as _mappings_all  # noqa: E402
from .random import *  # noqa: F401,F403,E402
from .random import __all__ as _random_all  # noqa: E402

__all__ += list(_mappings_all) + list(_random_all)
