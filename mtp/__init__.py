"""mtp: hand-written GPU kernels and thin layers for Megatron-style tensor- and expert-parallel
training.

Subpackages: ``mtp.kernels`` (Triton device code), ``mtp.ops`` (custom ops), ``mtp.parallel``
(rank generator, process groups, communication mappings, RNG), ``mtp.tensor_parallel``,
``mtp.moe``, ``mtp.testing`` (helpers shared by the tests and the benchmarks).
"""

import logging

__version__ = "0.1.0"

logging.getLogger("mtp").addHandler(logging.NullHandler())
