"""mtp: hand-written GPU kernels and thin layers for Megatron-style tensor- and expert-parallel
training.

Subpackages: ``mtp.kernels`` (Triton device code), ``mtp.ops`` (custom ops), ``mtp.parallel``
(rank generator, process groups, communication mappings, RNG), ``mtp.tensor_parallel``,
``mtp.moe``, ``mtp.optim`` (gradient buffers, distributed optimizer, clipping, checkpoints),
``mtp.testing`` (helpers shared by the tests and the benchmarks).
"""

import importlib.abc
import importlib.util
import logging
import os
import sys

__version__ = "0.1.0"

logging.getLogger("mtp").addHandler(logging.NullHandler())


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``mtp.kernels`` / ``mtp.bench`` in a source checkout that is not installed.

    ``setup.py`` maps the top-level ``kernels/`` and ``bench/`` folders to these names; with the
    checkout only on ``PYTHONPATH`` no installer did that mapping, so this finder (last on
    ``sys.meta_path``, after any installed mapping) does it.
    """

    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _FOLDERS = {__name__ + ".kernels": "kernels", __name__ + ".bench": "bench"}

    def find_spec(self, fullname, path=None, target=None):
        folder = self._FOLDERS.get(fullname)
        if folder is None:
            return None
        directory = os.path.join(self._ROOT, folder)
        init = os.path.join(directory, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[directory]
        )


if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutFinder())
