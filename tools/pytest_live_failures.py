"""pytest plugin (``-p pytest_live_failures``, ``tools/`` on ``PYTHONPATH``): appends each
failing test id to ``$MTP_FAILURES_FILE`` the moment its report arrives (xdist workers' reports
too), so a run killed at its time limit still says which tests failed."""

from __future__ import annotations

import os

_worker = False


def pytest_configure(config) -> None:
    """An xdist worker (``config.workerinput``) writes nothing: its controller sees every
    report and writes each failure once."""
    global _worker
    _worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MTP_FAILURES_FILE")
    if not path or not report.failed or _worker:
        return
    message = str(getattr(report, "longrepr", "") or "").strip().splitlines()
    last = message[-1][:200] if message else ""
    with open(path, "a") as f:
        f.write(f"{report.nodeid} [{report.when}] {last}\n")
