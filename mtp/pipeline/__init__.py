"""Pipeline parallelism: 1F1B and interleaved 1F1B schedules (Megatron-Core's tables and
orders) and a point-to-point runner.

- :mod:`mtp.pipeline.schedules`: :func:`get_schedule_table`, :func:`get_pp_rank_microbatches`,
  :func:`convert_schedule_table_to_order`, :func:`get_pipeline_order`, :func:`order_to_steps`.
- :mod:`mtp.pipeline.runner`: :func:`forward_backward_pipelining`.
"""

from .runner import *  # noqa: F401,F403
from .runner import __all__ as _runner_all
from .schedules import *  # noqa: F401,F403
from .schedules import __all__ as _schedules_all

__all__ = list(_schedules_all) + list(_runner_all)
