"""CUDA-graph capture in pipeline order.

- :mod:`mtp.graphs.planner`: :func:`plan_static_buffers` (slot per forward, peak = forwards in
  flight; CPU-only bookkeeping).
- :mod:`mtp.graphs.capture`: :func:`make_graphed_callables` (forward and backward graphs per
  layer and microbatch, captured in the order, one pool, static buffers per slot),
  :class:`StandInGraph` (CPU stand-in), :class:`CudaGraph`, :class:`GraphedLayer`.
- :mod:`mtp.graphs.partial`: partial capture of MoE blocks (scopes ``attn``, ``moe_router``,
  ``full``; early-exit signal, tensor store).
"""

from .capture import *  # noqa: F401,F403
from .capture import __all__ as _capture_all
from .partial import *  # noqa: F401,F403
from .partial import __all__ as _partial_all
from .planner import *  # noqa: F401,F403
from .planner import __all__ as _planner_all

__all__ = list(_planner_all) + list(_capture_all) + list(_partial_all)
