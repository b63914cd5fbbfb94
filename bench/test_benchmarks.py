"""The benchmark cases under pytest-benchmark: ``pytest bench/ --benchmark-only``.

The same ``setup_<op>`` factories as ``mtp-bench``: on a GPU the ``--quick`` shapes (``BENCH_SIZE=
full`` for all), every provider that can run; on CPU the tiny smoke shapes through the
reference and the Triton interpreter (interpreter timings: they show that the cases run, not
how fast anything is). Each timed round ends with a device synchronisation.
"""

import os

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from . import runner  # noqa: E402
from .core import DTYPES  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SIZE = os.environ.get("BENCH_SIZE", "quick") if CUDA else "smoke"
DTYPE = DTYPES[os.environ.get("BENCH_DTYPE", "bf16")]


def _params():
    out = []
    for module, case, providers in runner.plan(runner.load_modules(), None, SIZE, DTYPE):
        for provider in providers:
            case_id = f"{case.op}-{case.label}-{case.pass_}-{provider.name}".replace(" ", "_")
            out.append(pytest.param(module, case, provider, id=case_id))
    return out


def _synced(fn):
    if not CUDA:
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


@pytest.mark.parametrize("module, case, provider", _params())
def test_benchmark(benchmark, module, case, provider):
    reason = provider.unavailable(DEVICE)
    if reason:
        pytest.skip(reason)
    if not case.execute:
        pytest.skip("structure-only case (counted by mtp-bench, not timed)")
    run = module.SETUP[case.op](case, provider.name, DEVICE)
    benchmark.extra_info.update(op=case.op, case=case.label, pass_=case.pass_,
                                provider=provider.name, bytes=case.bytes, flops=case.flops)
    rounds = 20 if CUDA else 2
    benchmark.pedantic(_synced(run.fn), rounds=rounds, iterations=1, warmup_rounds=1)
