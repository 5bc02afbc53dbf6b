"""A data-parallel rank started by hand, on another host: ``python -m enginekit.runtime.remote_rank``.

The front end (``Engine(..., data_parallel_size=N, data_parallel_size_local=L, address="tcp://HOST:PORT",
data_parallel_keys=FILE)``) starts ranks ``0 .. L-1`` itself and writes ``FILE``: its ports and the CURVE keys
that protect them. Copy the file to the other host and start each remaining rank there::

    python -m enginekit.runtime.remote_rank --keys FILE --rank 1 [--host FRONT_END_HOST] [--threads N]

The rank loads the model the front end names; where that path does not exist on its host, ``--model PATH``
names the same model's copy there. Its READY carries the model's config, and the front end fails the start
if it is not the one it tokenizes for.

The rank connects a *watch* socket to the front end and sends ``RankJoin``, which opens with the wire version
it speaks (``wire/version.py``): a front end of another version refuses it, naming both versions, and fails its
start; the rank then exits with code 2. (A front end from before the wire had a version ignores the join: the
rank waits, and the front end's start times out.) Otherwise the front end answers with the engine's arguments (its config, the addresses, this rank's index), and the rank runs the same engine process
a local rank runs (``run_engine_core``). The watch connection is the rank's liveness, both ways: the front end
marks the engine dead when it drops (a kill, a crash, a lost host: ZeroMQ heartbeats catch a silent peer),
and the rank shuts its engine down when the front end goes. Then, and after the front end shut it down (a
``restart()``), the rank joins again and waits for the next front end on the same ports; ``--once`` exits
instead. Ctrl-C or SIGTERM stops it for good.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import logging
import os
import signal
import socket as socket_module
import sys
import threading
import time
from types import FrameType

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from enginekit.core.engine_core_proc import EngineCoreProc
from enginekit.runtime.engine_main import LOG_FORMAT, default_num_threads, run_engine_core
from enginekit.runtime.launcher import engine_environ
from enginekit.wire.keys import curve_client, read_keys, set_heartbeats
from enginekit.wire.messages import (
    EngineProcArgs,
    JoinRefused,
    JoinReply,
    RankExit,
    RankJoin,
    RemoteRankKeys,
    ShutdownRequest,
)
from enginekit.wire.version import this_version

logger = logging.getLogger("enginekit.remote_rank")

JOIN_RETRY_S = 1.0  # after a refusal that says to ask again
EXIT_REFUSED = 2
ERROR_TAIL_LINES = 40


class TailHandler(logging.Handler):
    """Keeps the last lines of this process's log, to send to the front end when an engine fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(self.format(record).splitlines())


# ---- the rank ----------------------------------------------------------------------------------------------


class RemoteRankServer:
    """Join the front end, run its engine, repeat: one engine per front-end incarnation."""

    def __init__(
        self,
        keys_path: str,
        rank: int,
        *,
        host: str | None = None,
        num_threads: int | None = None,
        device: str | None = None,
        model: str | None = None,
        once: bool = False,
        keys: RemoteRankKeys | None = None,
    ) -> None:
        # ``keys`` in hand (a rank placed by Ray is handed them) stand for the file at ``keys_path``.
        self.keys_path, self.rank, self.host, self.keys = keys_path, rank, host, keys
        self.num_threads, self.device, self.model, self.once = num_threads, device, model, once
        self.stopped = False  # a signal asked this process to stop for good
        self._engine: EngineCoreProc | None = None
        self._front_end_lost = threading.Event()
        self._tail = TailHandler()

    def serve(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop)
        self._tail.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(self._tail)
        code = 0
        while not self.stopped:
            keys = self._wait_for_keys()
            if keys is None:
                break
            context = zmq.Context(io_threads=1)
            try:
                reply, watch, monitor = self._join(context, keys)
                if isinstance(reply, JoinRefused):
                    logger.warning("rank %d: the front end refused it: %s", self.rank, reply.reason)
                    if not reply.retry:
                        return EXIT_REFUSED
                    time.sleep(JOIN_RETRY_S)
                    continue
                if reply is None:
                    break  # stopped while waiting
                code = self._run(reply.args, keys, watch, monitor)
            finally:
                context.destroy(linger=0)
            if self.once:
                break
        return code

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        # NOTE: while the engine loads, its own startup handler stops the load instead (see ``_run``).
        self.stopped = True
        if self._engine is not None:
            self._engine.signal_shutdown(signum, frame)

    def _wait_for_keys(self) -> RemoteRankKeys | None:
        if self.keys is not None:
            return None if self.stopped else self.keys
        announced = False
        while not self.stopped:
            if os.path.exists(self.keys_path):
                return read_keys(self.keys_path)
            if not announced:
                logger.warning("rank %d: waiting for the keys file %s", self.rank, self.keys_path)
                announced = True
            time.sleep(0.2)
        return None

    def _join(
        self, context: zmq.Context, keys: RemoteRankKeys
    ) -> tuple[JoinReply | None, zmq.Socket, zmq.Socket]:
        """Send ``RankJoin`` over each connection that comes up, until the front end answers.

        Returns the reply, the watch socket and its monitor (connections up and down: one per socket's life,
        since a monitor's address stays taken for a while after it is closed)."""
        watch = context.socket(zmq.DEALER)
        watch.setsockopt(zmq.LINGER, 0)
        # NOTE: only over a connection that is up: a join queued for a front end that is closing (a restart)
        # would be lost with it. So the join goes out when each CURVE handshake succeeds (a reconnection to
        # the next front end included); a repeat on a connection that was answered is refused, unread.
        watch.setsockopt(zmq.IMMEDIATE, 1)
        curve_client(watch, keys)
        set_heartbeats(watch)
        monitor = watch.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        watch.connect(f"tcp://{self._host(keys)}:{keys.watch_port}")
        version = this_version()
        join = msgspec.msgpack.encode(
            RankJoin(version.protocol, version.schema, self.rank, os.getpid(), socket_module.gethostname())
        )
        logger.info("rank %d: joining the front end at %s:%d", self.rank, self._host(keys), keys.watch_port)
        decoder = msgspec.msgpack.Decoder(JoinReply)
        poller = zmq.Poller()
        poller.register(watch, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self.stopped:
            events = dict(poller.poll(200))
            if monitor in events and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                with contextlib.suppress(zmq.Again):
                    watch.send(join, zmq.NOBLOCK)
            if watch in events:
                try:
                    return decoder.decode(watch.recv()), watch, monitor
                except msgspec.MsgspecError as error:
                    logger.warning("rank %d: dropped a malformed reply: %s", self.rank, error)
        return None, watch, monitor

    def _host(self, keys: RemoteRankKeys) -> str:
        return self.host or keys.host

    def _run(self, args: EngineProcArgs, keys: RemoteRankKeys, watch: zmq.Socket, monitor: zmq.Socket) -> int:
        args = self._localise(args, keys)
        torch.set_num_threads(self.num_threads or args.config.num_threads or default_num_threads())
        self._front_end_lost.clear()
        done = threading.Event()
        watcher = threading.Thread(
            target=self._watch_front_end, args=(monitor, done), name="enginekit-front-end-watch", daemon=True
        )
        watcher.start()
        logger.warning(
            "rank %d: joined; starting its engine (%s)", self.rank, args.config.model or "default model"
        )
        try:
            code = run_engine_core(args, on_started=self._started)
        except SystemExit as exit_request:  # a signal, or the front end gone, during the model load
            code = exit_request.code if isinstance(exit_request.code, int) else 1
            if not self._front_end_lost.is_set():
                self.stopped = True  # the user's signal
        finally:
            self._engine = None
            done.set()
            watcher.join()
        ended = "the front end went away" if self._front_end_lost.is_set() else "shut down by its front end"
        if code and not self._front_end_lost.is_set():
            ended = "failed"
            with contextlib.suppress(zmq.Again):  # the front end may be gone already
                watch.send(msgspec.msgpack.encode(RankExit(code, "\n".join(self._tail.lines))), zmq.NOBLOCK)
            watch.close(linger=2000)  # delivered before the hang-up tells the front end the rank is gone
        logger.warning("rank %d: engine ended (%s, exit code %s)", self.rank, ended, code)
        return code

    def _started(self, engine: EngineCoreProc) -> None:
        """The engine exists and its signal handlers are in place: route ours to it."""
        self._engine = engine
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop)
        if self._front_end_lost.is_set() or self.stopped:
            engine.input_queue.put_nowait(ShutdownRequest(0.0))

    def _localise(self, args: EngineProcArgs, keys: RemoteRankKeys) -> EngineProcArgs:
        """This host's view: the front end's addresses under the host we reached it by; our device and model
        path (the front end checks the model is the same when the engine is ready)."""
        host = self._host(keys)
        changes = {name: value for name, value in (("device", self.device), ("model", self.model)) if value}
        config = args.config.replace(**changes) if changes else args.config
        return msgspec.structs.replace(
            args,
            config=config,
            input_address=f"tcp://{host}:{keys.input_port}",
            output_address=f"tcp://{host}:{keys.output_port}",
        )

    def _watch_front_end(self, monitor: zmq.Socket, done: threading.Event) -> None:
        """The front end's connection dropped: shut the engine down (it may be loading still)."""
        while not done.is_set():
            if not monitor.poll(100):
                continue
            event = recv_monitor_message(monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            logger.warning("rank %d: lost the front end; stopping the engine", self.rank)
            self._front_end_lost.set()
            engine = self._engine
            if engine is not None:
                engine.input_queue.put_nowait(ShutdownRequest(0.0))
            else:
                os.kill(os.getpid(), signal.SIGTERM)  # still loading: the startup handler stops it
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])  # None under -OO
    parser.add_argument("--keys", required=True, help="the keys file the front end wrote (copied here)")
    parser.add_argument("--rank", required=True, type=int, help="this engine's data-parallel rank")
    parser.add_argument(
        "--host", help="the front end's host as seen from here (default: the one in the file)"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: every usable core)")
    parser.add_argument("--device", help="'cpu', 'cuda' or 'cuda:N' (default: the front end's setting)")
    parser.add_argument(
        "--model",
        help="the same model at its path on this host, a folder or .gguf file (default: the front end's path)",
    )
    parser.add_argument("--once", action="store_true", help="exit when the first engine ends")
    parser.add_argument("--log-level", default="warning", choices=("warning", "info", "debug"))
    args = parser.parse_args(argv)
    environ = engine_environ(dict(os.environ))
    if environ != os.environ:  # the OpenMP defaults of a local engine must be set before torch starts
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], environ)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    faulthandler.enable(all_threads=False)
    server = RemoteRankServer(
        args.keys,
        args.rank,
        host=args.host,
        num_threads=args.threads,
        device=args.device,
        model=args.model,
        once=args.once,
    )
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
