"""Remote ranks: engines started by hand elsewhere (``runtime/remote_rank.py``) that join this front end.

A front end with ``data_parallel_size_local < data_parallel_size`` binds a third socket beside its input and
output ones, the *watch* ROUTER (port + 2, CURVE-protected like them). Each remote rank connects to it and sends
``RankJoin``, which opens with the wire version it speaks; ``RankWatcher`` (a thread that owns the socket)
refuses a rank of another version (and fails the start, naming both versions), answers the others with the
rank's ``EngineProcArgs``, and from then on watches that connection: when it drops — the rank was killed, crashed, or its host went silent
past the heartbeat timeout — the rank is gone, as a local rank is when its pidfd turns readable.

``RemoteRank`` stands where a local rank's ``EngineProcess`` stands, with the same surface: its ``pidfd`` is
the read end of a pipe the watcher writes to when the connection drops, so the receivers, the startup wait and
the death path treat both alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from enginekit.runtime.engine_process import readable
from enginekit.wire.messages import (
    EngineProcArgs,
    JoinAccepted,
    JoinHeader,
    JoinRefused,
    LegacyRankJoin,
    RankExit,
    RankJoin,
)
from enginekit.wire.version import WireVersion, this_version

if TYPE_CHECKING:
    from zmq.utils.monitor import _MonitorMessage

logger = logging.getLogger("enginekit.client")

JOIN_PHASE = (
    "join (start it on its host: python -m enginekit.runtime.remote_rank --keys {keys} --rank {rank})"
)


class RemoteRank:
    """A rank that runs elsewhere, seen through its watch connection (the surface of ``EngineProcess``)."""

    def __init__(self, rank: int, keys_path: str) -> None:
        self.rank = rank
        self.pid = -1
        self.hostname = ""
        self.phase = JOIN_PHASE.format(keys=keys_path, rank=rank)
        self.args: EngineProcArgs | None = None
        self.joined = False
        self.stopping = False  # told to shut down: its hang-up is expected
        self._gone_read, self._gone_write = os.pipe()
        self.pidfd: int | None = self._gone_read  # readable once the rank is gone
        self._exit: str | None = None
        self._lock = threading.Lock()
        self.exit_code: int | None = None
        self._error_tail = ""  # what the rank sent before it hung up, if it failed

    def start(self, args: EngineProcArgs) -> None:
        """Nothing to start here: keep the arguments for when the rank joins."""
        self.args = args

    def mark_joined(self, pid: int, hostname: str) -> None:
        self.pid, self.hostname, self.joined = pid, hostname, True
        self.phase = "startup"

    def mark_failed(self, code: int, error_tail: str) -> None:
        self.exit_code, self._error_tail = code, error_tail

    def mark_gone(self, reason: str) -> None:
        with self._lock:
            if self._exit is not None:
                return
            self._exit = reason
            if self._gone_write >= 0:
                os.write(self._gone_write, b"x")

    def is_alive(self) -> bool:
        return self._exit is None

    def wait_dead(self, timeout: float) -> bool:
        return self._exit is not None or self.pidfd is None or readable(self.pidfd, timeout)

    def describe_exit(self) -> str:
        if self._exit is not None:
            return self._exit
        where = f" (pid {self.pid} on {self.hostname})" if self.joined else ""
        return f"the remote rank{where} is still connected"

    def error_tail(self) -> str:
        return self._error_tail  # the rest of its output is on its own host

    def stop(self, timeout: float) -> None:
        """Give a rank that was told to shut down ``timeout`` seconds to hang up, then forget it."""
        self.stopping = True
        if self.joined:
            self.wait_dead(timeout)
        self.mark_gone("stopped by its front end")
        with self._lock:
            for fd in (self._gone_read, self._gone_write):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._gone_read = self._gone_write = -1
            self.pidfd = None


class RankWatcher:
    """A thread that owns the watch socket: answers joins, and marks a rank gone when its connection drops.

    Hang-ups come from the socket's monitor, which names a connection by its fd; messages name it by the
    routing id the ROUTER gave it. Routing ids are never reused, fds are: a connection that closes frees its
    fd for the next one. Its hang-up was reported before that fd could be reused, so every hang-up reported so
    far is applied before a join maps its fd to a rank: a late-read hang-up of an earlier connection on the
    same fd can then not be taken for the new rank's. A hang-up is applied only once the socket is read empty,
    after what its rank sent last (a ``RankExit``); joins read meanwhile wait until then.
    """

    def __init__(self, socket: zmq.Socket, ranks: list[RemoteRank]) -> None:
        self._socket = socket
        self._ranks = {rank.rank: rank for rank in ranks}
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._by_fd: dict[int, RemoteRank] = {}  # live connections, for hang-ups
        self._by_route: dict[bytes, RemoteRank] = {}  # every accepted join, for messages
        self._wake_read, self._wake_write = os.pipe()
        # The header of a join first: one of another version decodes no further (wire/version.py).
        self._decoder = msgspec.msgpack.Decoder(JoinHeader | LegacyRankJoin | RankExit)
        self._join_decoder = msgspec.msgpack.Decoder(RankJoin)
        self._thread = threading.Thread(target=self._run, name="enginekit-rank-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_read in events:
                return
            if self._socket in events:
                self._on_message(self._socket.recv_multipart(copy=False))
            if self._monitor in events:
                self._on_event(recv_monitor_message(self._monitor))

    def _on_event(self, event: _MonitorMessage) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            for frames, join in self._hang_up([event["value"]]):
                self._on_join(frames, join)

    def _hang_up(self, fds: list[int]) -> list[tuple[list[zmq.Frame], RankJoin]]:
        """Apply these hang-ups after what their ranks sent just before them (a RankExit, with the exit code
        the death message names); returns the joins read meanwhile, to handle after: their fd may be one of
        these."""
        joins: list[tuple[list[zmq.Frame], RankJoin]] = []
        while self._socket.poll(0):
            frames = self._socket.recv_multipart(copy=False)
            message = self._decode(frames)
            if isinstance(message, RankJoin):
                joins.append((frames, message))
            elif isinstance(message, JoinRefused):
                self._reply(frames, message)
            elif message is not None:
                self._on_exit(frames, message)
        for fd in fds:
            self._hung_up(fd)
        return joins

    def _reported_hang_ups(self) -> list[int]:
        fds = []
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fds.append(event["value"])
        return fds

    def _hung_up(self, fd: int) -> None:
        rank = self._by_fd.pop(fd, None)
        if rank is None:
            return
        level = logging.INFO if rank.stopping else logging.WARNING
        logger.log(level, "remote engine rank %d (pid %d on %s) hung up", rank.rank, rank.pid, rank.hostname)
        how = (
            "closed"
            if rank.exit_code is None
            else f"closed after its engine exited with code {rank.exit_code}"
        )
        rank.mark_gone(f"its connection from {rank.hostname} (pid {rank.pid}) {how}")

    def _decode(self, frames: list[zmq.Frame]) -> RankJoin | RankExit | JoinRefused | None:
        """A message, or the refusal of a join of another wire version (``None``: malformed, ignored)."""
        try:
            message = self._decoder.decode(frames[-1].bytes)
            if isinstance(message, RankExit):
                return message
            theirs = (
                WireVersion(message.protocol, message.schema)
                if isinstance(message, JoinHeader)
                else WireVersion(1, "unversioned")
            )
            if theirs != this_version():
                return self._version_refusal(message.rank, theirs)
            return self._join_decoder.decode(frames[-1].bytes)
        except msgspec.MsgspecError as error:
            logger.warning("ignored a malformed message on the watch socket: %s", error)
            return None

    def _version_refusal(self, rank_index: int, theirs: WireVersion) -> JoinRefused:
        """Refuse a rank that speaks another wire version; if it is one of ours still awaited, the start fails
        with the reason (``wait_for_ready`` sees the rank gone)."""
        reason = (
            f"remote rank {rank_index} speaks {theirs}, this front end {this_version()}: run the same "
            f"enginekit release on every host"
        )
        logger.warning("%s", reason)
        rank = self._ranks.get(rank_index)
        if rank is not None and not rank.joined:
            rank.mark_gone(reason)
        return JoinRefused(reason)

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        message = self._decode(frames)
        if isinstance(message, RankJoin):
            self._on_join(frames, message)
        elif isinstance(message, JoinRefused):
            self._reply(frames, message)
        elif message is not None:
            self._on_exit(frames, message)

    def _reply(self, frames: list[zmq.Frame], reply: JoinAccepted | JoinRefused) -> None:
        self._socket.send_multipart([frames[0], msgspec.msgpack.encode(reply)])

    def _on_exit(self, frames: list[zmq.Frame], message: RankExit) -> None:
        failed = self._by_route.get(frames[0].bytes)
        if failed is not None:
            failed.mark_failed(message.code, message.error_tail)

    def _on_join(self, frames: list[zmq.Frame], join: RankJoin) -> None:
        fds = self._reported_hang_ups()  # applied before this join's fd is mapped (see the class docstring)
        later = self._hang_up(fds) if fds else []
        rank = self._ranks.get(join.rank)
        if rank is None:
            reply: JoinAccepted | JoinRefused = JoinRefused(
                f"rank {join.rank} is not a remote rank of this front end (those are {sorted(self._ranks)})"
            )
        elif rank.joined or not rank.is_alive() or rank.args is None:
            state = (
                f"pid {rank.pid} on {rank.hostname} joined already" if rank.joined else "its engine is gone"
            )
            reply = JoinRefused(f"rank {join.rank}: {state}; waiting for the next front end", retry=True)
        else:
            rank.mark_joined(join.pid, join.hostname)
            self._by_fd[frames[-1].get(zmq.SRCFD)] = rank
            self._by_route[frames[0].bytes] = rank
            reply = JoinAccepted(rank.args)
            logger.info("remote engine rank %d joined: pid %d on %s", join.rank, join.pid, join.hostname)
        self._reply(frames, reply)
        for later_frames, later_join in later:  # in the order they came, each after the hang-ups before it
            self._on_join(later_frames, later_join)

    def close(self) -> None:
        """Stop the thread; the socket is its owner's to close."""
        if self._wake_write >= 0:
            os.write(self._wake_write, b"x")
            self._thread.join()
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(linger=0)
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_read = self._wake_write = -1
