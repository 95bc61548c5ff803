"""A dependency-free progress bar on stderr (tqdm is optional, not required)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    """``label [#####.....] 37/128 12.3 tok/s``, redrawn in place at most every 0.1 s."""

    def __init__(
        self, total: int, label: str = "tokens", enabled: bool = True, stream: Optional[TextIO] = None, width: int = 30
    ):
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self.started = time.perf_counter()
        self._last_draw = 0.0

    def update(self, count: int) -> None:
        self.done = min(self.total, self.done + count)
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw > 0.1 or self.done == self.total):
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = self.width * self.done // self.total
        rate = self.done / max(now - self.started, 1e-9)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {rate:.1f} tok/s")
        self.stream.flush()
        self._last_draw = now

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
