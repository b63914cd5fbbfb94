"""How the Makefile gets a Python environment on this machine (prints one word):

- ``reuse``: a GPU machine whose ``python3`` is itself a virtual environment (the lent
  machines: ``/opt/torch/.venv``, which holds the CUDA torch). A venv made from it with
  ``--system-site-packages`` would see the *base* interpreter's packages, without torch, so the
  Makefile uses this interpreter directly with the checkout on ``PYTHONPATH``;
- ``system-site``: a GPU machine with a system Python: a venv on top of it
  (``--system-site-packages``) keeps its CUDA torch and triton;
- ``create``: no GPU: a plain venv, the CPU torch installed into it.

``python3 tools/venv_mode.py [--gpu]``; :func:`mode` is unit-tested.
"""

from __future__ import annotations

import sys


def mode(prefix: str, base_prefix: str, has_gpu: bool) -> str:
    if not has_gpu:
        return "create"
    return "reuse" if prefix != base_prefix else "system-site"


if __name__ == "__main__":
    print(mode(sys.prefix, getattr(sys, "base_prefix", sys.prefix), "--gpu" in sys.argv[1:]))
