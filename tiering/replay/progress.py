"""A minimal progress bar on stderr, for the CLI's long runs (no dependency)."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar(total, "replay") as bar: bar.update(1)``.

    Draws only when the stream is a terminal (and ``enabled``), at most 10 times a second, so it
    costs nothing in pipes, CI logs and tests.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 30,
    ) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.width = width
        self.done = 0
        self._started = time.monotonic()
        self._last_draw = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(self.width * min(fraction, 1.0))
        elapsed = now - self._started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {fraction:4.0%} {rate:7.1f}/s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
