"""ClientResources: everything an ``MPClient`` holds that must be released — its engine processes, sockets,
receiver, rank watcher and a Ray cluster it started — and the order that releases them.

It is kept apart from the client so that the client's ``weakref.finalize`` (``runtime/exit_hooks.py``) can release
it without referring to the client: a finalizer that held the client would keep it alive forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from enginekit.client.ray_ranks import RayCluster
from enginekit.client.receiver import LoopReceiver, ThreadReceiver
from enginekit.client.remote import RankWatcher, RemoteRank
from enginekit.client.sockets import EngineSockets
from enginekit.client.startup import EngineRank


@dataclass
class ClientResources:
    """What a client holds: its engine processes, sockets, receiver and rank watcher."""

    engines: list[EngineRank]
    sockets: EngineSockets | None = None
    receiver: ThreadReceiver | LoopReceiver | None = None
    watcher: RankWatcher | None = None
    ray_cluster: RayCluster | None = None
    stop_timeout: float = 0.0  # how long the processes get to exit (shutdown sets it; 0: stop them now)

    def close(self) -> None:
        """Stop receiving, then stop the processes (the receiver watches their pidfds), then close the sockets."""
        for engine in self.engines:  # every remote rank was told to go: none of their hang-ups is a surprise
            if isinstance(engine.process, RemoteRank):
                engine.process.stopping = True
        if self.receiver is not None:
            self.receiver.close()
        for engine in self.engines:  # a remote rank's hang-up is seen by the watcher: stop it after
            engine.process.stop(self.stop_timeout)
        if self.watcher is not None:
            self.watcher.close()
        if self.sockets is not None:
            self.sockets.close()
        if self.ray_cluster is not None:
            self.ray_cluster.close()  # a local cluster this front end started
