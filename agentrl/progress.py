"""Plain progress lines for a log file: when stdout is not a terminal (``agentrl train ... > log``), a long phase
(an evaluation, a rollout, SFT data generation) prints one line every ``interval_s`` seconds while it runs::

    eval before: 37/128 episodes, 1 failed, 41 s elapsed, ETA 101 s

On a terminal the rich progress bars show the same, so nothing is printed here. The lines come from a
background thread, so a phase in which no episode finishes for a while still reports (``0/128 episodes``).
Torch-free.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO


class ProgressLines:
    """Prints ``<label>: <done>/<total> <unit>, ... elapsed, ETA ...`` every ``interval_s`` seconds to ``stream``
    (default: stdout) between :meth:`start` and :meth:`stop` (or as a context manager), when the stream is not a
    TTY (``force=True``: whatever the stream) and ``interval_s > 0``. :meth:`update` records progress (any thread).
    """

    def __init__(
        self, label: str, total: int | None = None, *, interval_s: float, unit: str = "episodes",
        stream: TextIO | None = None, force: bool = False,
    ) -> None:
        self.label, self.total, self.unit, self.interval_s = label, total, unit, float(interval_s)
        self.stream = stream or sys.stdout
        self.done = self.failed = 0
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = self.interval_s > 0 and (force or not (isatty is not None and isatty()))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()

    def update(self, done: int, total: int | None = None, failed: int = 0) -> None:
        """``done`` of ``total`` (unchanged when None) finished so far, ``failed`` of them failed."""
        self.done, self.failed = int(done), int(failed)
        if total is not None:
            self.total = int(total)

    def line(self) -> str:
        """The progress line now."""
        elapsed = time.monotonic() - self._t0
        total = "?" if self.total is None else str(self.total)
        parts = [f"{self.label}: {self.done}/{total} {self.unit}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        parts.append(f"{elapsed:.0f} s elapsed")
        if self.total and self.done:
            parts.append(f"ETA {elapsed / self.done * max(self.total - self.done, 0):.0f} s")
        return ", ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                print(self.line(), file=self.stream, flush=True)
            except (OSError, ValueError):  # the stream was closed under us: stop reporting, never fail the run
                return

    def start(self) -> ProgressLines:
        self._t0 = time.monotonic()
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"progress-{self.label}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ProgressLines:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
