"""Test configuration.

Without CUDA the Triton kernels run under the interpreter on CPU tensors: ``TRITON_INTERPRET=1``
is set here, before anything imports triton. ``MTP_POISON_OUTPUTS=1`` makes every op output
start as NaN (or a sentinel), so an element a kernel forgets to write fails the test.

Every test starts and ends with :func:`mtp.settings.reset` (the autouse ``mtp_settings``
fixture): ``MTP_*`` variables read afresh, no :func:`mtp.settings.configure` value left over. A
test changes a setting with ``mtp.settings.override(...)`` or ``mtp.settings.configure(...)``.

Markers: ``gpu`` (skipped without CUDA, with the reason) and ``slow`` (skipped unless
``--runslow`` or ``-m slow``).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    # one xdist worker per core: more intra-op threads only spin against each other
    torch.set_num_threads(1)
os.environ.setdefault("MTP_POISON_OUTPUTS", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402

from mtp import settings  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    selects_slow = "slow" in markexpr and "not slow" not in markexpr
    run_slow = config.getoption("--runslow") or selects_slow
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow (or -m slow)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def mtp_settings():
    """The settings of mtp (:mod:`mtp.settings`), reset before and after each test."""
    settings.reset()
    yield settings
    settings.reset()


@pytest.fixture
def device():
    """The device op tests run on: CUDA when present, else CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
