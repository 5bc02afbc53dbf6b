"""A progress bar (tqdm.auto: a widget in Jupyter, text elsewhere) for long batch generation."""

from __future__ import annotations

import math
import time
from typing import Any

_MIN_INTERVAL_S = 0.1  # the generate loop calls update() after every batch; counting that often is waste


class ProgressWatcher:
    def __init__(self, outputs: list[Any]) -> None:
        from tqdm.auto import tqdm

        self._pending = list(outputs)
        self._bar = tqdm(total=len(outputs), desc="generate", unit="req", leave=False)
        self._last_count = -math.inf
        self._closed = False

    def update(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_count < _MIN_INTERVAL_S:
            return
        self._last_count = now
        pending = [output for output in self._pending if not output.finished]
        if len(pending) != len(self._pending):
            self._bar.update(len(self._pending) - len(pending))
            self._pending = pending

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.update(force=True)
            self._bar.close()

    async def aclose(self) -> None:
        self.close()
