"""mtp: hand-written GPU kernels and thin layers for Megatron-style tensor- and expert-parallel
training.

Subpackages: ``mtp.kernels`` (Triton device code), ``mtp.ops`` (custom ops), ``mtp.parallel``
(rank generator, process groups, communication mappings, RNG), ``mtp.tensor_parallel``,
``mtp.moe``, ``mtp.optim`` (gradient buffers, distributed optimizer, clipping, checkpoints),
``mtp.pipeline``, ``mtp.graphs``, ``mtp.integrations``, ``mtp.testing`` (helpers shared by the
tests and the benchmarks), ``mtp.bench`` (the microbenchmarks) and ``mtp.settings`` (every
``MTP_*`` environment variable).

``mtp/kernels`` and ``mtp/bench`` are links to the top-level ``kernels/`` and ``bench/`` folders
(see ``setup.py``).
"""

import logging

__version__ = "0.1.0"

logging.getLogger("mtp").addHandler(logging.NullHandler())
