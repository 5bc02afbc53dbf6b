"""The body of a data-parallel rank placed by Ray (``data_parallel_backend="ray"``): a remote rank in an actor.

The front end (``client/ray_ranks.py``) creates one actor per rank in that rank's placement group and calls
``serve`` with the keys a remote rank would read from its keys file. The actor then joins the front end exactly
as ``python -m enginekit.runtime.remote_rank`` does (``RemoteRankServer``): the watch connection, the engine's
arguments in ``JoinAccepted``, the same engine process over the same CURVE-protected sockets. It serves one
front end (``once``): a restart places new actors. This module does not import Ray: the front end wraps the
class with ``ray.remote``, and Ray imports it by name in its worker process.
"""

from __future__ import annotations

import logging
import os
import socket

import msgspec

from enginekit.runtime.engine_main import LOG_FORMAT
from enginekit.runtime.remote_rank import RemoteRankServer
from enginekit.wire.messages import RemoteRankKeys


class RayRankActor:
    """One rank's engine, run in the Ray worker process that hosts the actor."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def where(self) -> tuple[int, str]:
        """The worker's pid and host name (the rank's process, as the front end's diagnostics name it)."""
        return os.getpid(), socket.gethostname()

    def serve(self, keys: bytes, num_threads: int | None, log_level: str) -> int:
        """Join the front end the keys (``RemoteRankKeys`` as JSON) point to, run its engine until it ends;
        the exit code."""
        logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
        server = RemoteRankServer(
            "",
            self.rank,
            num_threads=num_threads,
            once=True,
            keys=msgspec.json.decode(keys, type=RemoteRankKeys),
        )
        return server.serve()
