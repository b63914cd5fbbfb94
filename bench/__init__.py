"""mtp microbenchmarks: one ``bench_<op>.py`` per op family, run by the ``mtp-bench`` CLI.

Imported as ``mtp.bench`` (``mtp/bench`` links this folder, as ``mtp/kernels`` links
``kernels/``), so ``pip install -e .`` gives the ``mtp-bench`` command; from a checkout
``python -m bench`` runs the same code. Modules here import each other relatively
and nothing in ``mtp`` imports them.

On a CPU-only machine the CLI runs a smoke pass (tiny sizes through the reference and the Triton
interpreter, results checked against a float64 reference) and the structural figures that need
no GPU; on a GPU it times every backend and peer (see ``bench/README.md``).
"""
