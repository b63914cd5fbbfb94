"""pytest configuration for ``pytest bench/ --benchmark-only`` (pytest-benchmark).

Without CUDA the Triton interpreter is turned on before anything imports triton (the timings
are then of the interpreter, useful only to check that the cases run).
"""

from bench.env import prepare_runtime

prepare_runtime("auto")
