"""A progress bar (tqdm.auto: a widget in Jupyter, text elsewhere) for long batch generation."""

from __future__ import annotations

from typing import Any


class ProgressWatcher:
    def __init__(self, states: list[Any]) -> None:
        from tqdm.auto import tqdm

        self._states = states
        self._bar = tqdm(total=len(states), desc="generate", unit="req", leave=False)
        self._done = 0

    def update(self) -> None:
        done = sum(1 for s in self._states if s.finished)
        if done != self._done:
            self._bar.update(done - self._done)
            self._done = done

    def close(self) -> None:
        self.update()
        self._bar.close()
