"""Progress bars for the CLI's long runs, drawn by tqdm on stderr (rate and ETA included).

Silent unless the stream is a terminal, so pipes, CI logs and tests see nothing.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar(total, "replay") as bar: bar.update(1)``; draws only on a terminal
    (and when ``enabled``)."""

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = max(total, 0)
        self.done = 0
        self._bar = tqdm(
            total=self.total,
            desc=label,
            file=self.stream,
            disable=not self.enabled,
            unit="",
            dynamic_ncols=True,
            leave=True,
        )

    def update(self, n: int = 1) -> None:
        self.done += n
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
