"""pytest plugin (``-p pytest_live_failures``, ``tools/`` on ``PYTHONPATH``): appends each
failing test id to ``$MTP_FAILURES_FILE`` the moment its report arrives (xdist workers' reports
too), so a run killed at its time limit still says which tests failed."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MTP_FAILURES_FILE")
    # xdist: the controller sees every worker's reports; a worker writing too would double them
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    message = str(getattr(report, "longrepr", "") or "").strip().splitlines()
    last = message[-1][:200] if message else ""
    with open(path, "a") as f:
        f.write(f"{report.nodeid} [{report.when}] {last}\n")
