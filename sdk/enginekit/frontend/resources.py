"""What an ``Engine`` holds that must be released: its client (the engine processes, sockets, threads) and the
router whose waiters must hear why their requests will not finish.

They live in this object rather than on the engine, so that the engine's ``weakref.finalize`` can release them
without referring to the engine: when the engine is collected without ``shutdown()``, or at interpreter exit
(``runtime/exit_hooks.py`` runs it there, before the launcher goes).
"""

from __future__ import annotations

from dataclasses import dataclass

from enginekit.client import EngineCoreClient
from enginekit.errors import EngineShutdownError
from enginekit.frontend.output_router import OutputRouter


@dataclass
class EngineResources:
    client: EngineCoreClient | None = None
    router: OutputRouter | None = None

    def close(self, timeout: float | None = None) -> None:
        """Fail every waiter, then shut the client down; safe to call twice, and from another thread."""
        client, self.client = self.client, None
        if client is None:
            return
        if self.router is not None:
            self.router.fail_all(
                EngineShutdownError("the engine was shut down; call engine.restart() to start it again")
            )
        client.shutdown(timeout)
