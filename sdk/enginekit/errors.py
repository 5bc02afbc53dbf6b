"""The exceptions enginekit raises at its public boundary."""

from __future__ import annotations

import logging
import sys

__all__ = [
    "EngineDeadError",
    "EngineError",
    "EngineShutdownError",
    "EngineStartupError",
    "UtilityCallError",
]


class EngineError(RuntimeError):
    """Base class of every error enginekit raises about the engine itself."""


class EngineStartupError(EngineError):
    """The engine could not start.

    The message names the phase that failed (spawn, handshake, model load), the exit code or signal of the
    engine process when it died, and the tail of its error output.
    """

    def __init__(self, message: str, *, phase: str = "startup", error_tail: str = "") -> None:
        super().__init__(message)
        self.phase = phase
        self.error_tail = error_tail


class EngineDeadError(EngineError):
    """The engine died (crash, ``kill -9``, out of memory, a fatal error in a step).

    Every blocked and later call raises this. ``engine.restart()`` starts a fresh engine.
    """


class EngineShutdownError(EngineError):
    """The engine was shut down on purpose; call ``engine.restart()`` to use it again."""


class UtilityCallError(EngineError):
    """A utility call reached the engine and failed there; the engine keeps running."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where exceptions take notes (3.11+); before, the note is logged."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        logging.getLogger("enginekit").warning("%s: %s", error, note)
