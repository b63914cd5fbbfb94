"""Progress of a bench run on stderr: a counter that reaches its total and a heartbeat.

Every unit of work the CLI runs is one counted step (each provider of each case, each
bytes-by-address measurement, each family's structural figures, writing the results), so the
counter ends at ``[total/total]``. Whatever runs longer than ``heartbeat_s`` gets a line (or,
on a terminal, a refresh of the tqdm bar) every ``heartbeat_s`` saying what is still running,
so a log is never silent for long, not even inside one long step (a multi-process check, a
large interpreter run).
"""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress", "HEARTBEAT_S"]

#: Seconds without a line after which the heartbeat says what is still running.
HEARTBEAT_S = 10.0


class Progress:
    """tqdm on a terminal when installed, else one line per step on stderr, written before the
    step starts (a log then names the case and provider a killed or hung run was in), a
    heartbeat line after ``heartbeat_s`` seconds without one (0: none) and, from
    :meth:`close`, ``[done/total] done in N s``."""

    def __init__(self, total: int, enabled: bool = True, heartbeat_s: float = HEARTBEAT_S,
                 stream=None) -> None:  # fmt: skip
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None
        self.enabled = enabled
        self.done, self.total = 0, total
        self.label = "starting"
        self.started = self.since = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._closed = False
        if enabled and self.stream.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="run", file=self.stream, dynamic_ncols=True)
            except ImportError:
                self.bar = None
        if enabled and heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                            name="mtp-bench-heartbeat")  # fmt: skip
            self._thread.start()

    def _write(self, text: str) -> None:
        """One line on the stream (the caller holds the lock)."""
        print(text, file=self.stream, flush=True)
        self.last = time.monotonic()

    def begin(self, label: str) -> None:
        """Step ``done + 1`` starts: ``[i/total] label ...``."""
        with self._lock:
            self.label, self.since = label, time.monotonic()
            if self.bar is None and self.enabled:
                self._write(f"[{self.done + 1}/{self.total}] {label} ...")

    def note(self, label: str) -> None:
        """Work outside the counted steps (set-up): a line without a counter."""
        with self._lock:
            self.label, self.since = label, time.monotonic()
            if self.bar is None and self.enabled:
                self._write(f"{label} ...")

    def step(self, label: str) -> None:
        """The step begun last has ended."""
        with self._lock:
            self.done += 1
            if self.bar is not None:
                self.bar.set_description_str(label[:60])
                self.bar.update(1)

    def _beat(self, period: float) -> None:
        while not self._stop.wait(min(period, 1.0)):
            with self._lock:
                now = time.monotonic()
                if now - self.last < period:
                    continue
                if self.bar is not None:  # tqdm redraws its elapsed time
                    self.bar.refresh()
                    self.last = now
                else:
                    self._write(f"[{min(self.done + 1, self.total)}/{self.total}] {self.label} "
                                f"... still running ({now - self.since:.0f} s)")  # fmt: skip

    def close(self) -> None:
        """Stop the heartbeat; ``[done/total] done in N s`` (once)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.bar is not None:
                self.bar.close()
            elif self.enabled:
                elapsed = time.monotonic() - self.started
                self._write(f"[{self.done}/{self.total}] done in {elapsed:.0f} s")
