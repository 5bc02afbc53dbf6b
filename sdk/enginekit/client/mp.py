"""MPClient: the front end of its engine processes — sockets, sending, liveness, death, shutdown.

Front end ``ROUTER`` (bound) → each engine's ``DEALER`` carries requests (and, during startup, the engines' phase
reports and READY the other way); every engine's ``PUSH`` → the front end's one ``PULL`` (bound) carries outputs.
Every message is ``[msgpack body, *tensor frames]`` (the ROUTER adds the engine's identity). With data
parallelism there is one engine per rank behind the same two sockets, and a ``LoadBalancer`` picks each new
request's rank. Who reads the output socket is the receiver's business: a thread (``SyncMPClient``) or a task on
the caller's loop (``AsyncMPClient``). What the client holds, and releasing it, is ``ClientResources``
(``client/resources.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec
import zmq

from enginekit.client.balancer import LoadBalancer
from enginekit.client.base import EngineCoreClient
from enginekit.client.pending import PendingCalls, answers
from enginekit.client.ray_ranks import RayCluster, RayRank
from enginekit.client.receiver import EXIT_DRAIN_S, LoopReceiver, ThreadReceiver, WatchedProcess
from enginekit.client.remote import RankWatcher, RemoteRank
from enginekit.client.resources import ClientResources
from enginekit.client.sockets import EngineSockets
from enginekit.client.startup import EngineRank, check_placement, spawn_engines, wait_for_ready
from enginekit.config import EngineConfig
from enginekit.errors import EngineDeadError, EngineShutdownError
from enginekit.interrupts import awaiting_with_signal_checks, running_loop
from enginekit.model.loader import ModelSpec
from enginekit.runtime import exit_hooks
from enginekit.runtime.engine_process import EngineProcess
from enginekit.wire.messages import (
    LAST_WORDS,
    AbortRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineOutput,
    ShutdownRequest,
    UtilityRequest,
    last_words,
)
from enginekit.wire.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("enginekit.client")

SHUTDOWN_GRACE_S = 5.0
UNREACHABLE_GRACE_S = 1.0  # how long a peer whose socket is gone may take to finish exiting
REPORT_GRACE_S = EXIT_DRAIN_S + 2.0  # how long a send that found it gone waits for its receiver's report


class MPClient(EngineCoreClient):
    """Starts the engine processes (one per data-parallel rank), owns their sockets; its receiver decides how
    outputs are awaited."""

    receiver_type: ClassVar[type[ThreadReceiver] | type[LoopReceiver]]

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None) -> None:
        # Each engine process reads the model itself; ``spec`` (the front end's) is what they must have loaded.
        check_placement(config)
        self.config = config
        self._closed = False
        self._dead_error: EngineDeadError | None = None
        self._dead_lock = threading.Lock()
        self._last_words: dict[int, str] = {}  # by rank: why its engine said it died (EngineDead)
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineOutput, copy_tensors=True)  # they reach the user
        self._pending = PendingCalls()
        ranks = config.data_parallel_ranks
        self.engines: list[EngineRank] = []
        self.balancer = LoadBalancer(ranks) if len(ranks) > 1 else None
        # Released by shutdown, or by the finalizer when this client is collected or at exit.
        self.resources = ClientResources(self.engines)
        self._finalizer = exit_hooks.register(self, self.resources.close)
        try:
            if config.data_parallel_backend == "ray":
                self.resources.ray_cluster = cluster = RayCluster(config)
                self.resources.sockets = sockets = EngineSockets(config, ray_host=cluster.front_end_host)
            else:
                self.resources.sockets = sockets = EngineSockets(config)
            self.engines.extend(EngineRank(rank, self._rank_process(rank)) for rank in ranks)
            spawn_engines(config, sockets, self.engines)
            if sockets.watch is not None:
                remote_ranks = [e.process for e in self.engines if isinstance(e.process, RemoteRank)]
                self.resources.watcher = RankWatcher(sockets.watch, remote_ranks)
            wait_for_ready(config, sockets, self.engines, spec.config if spec is not None else None)
            processes = [engine.process for engine in self.engines]
            self.resources.receiver = self.receiver_type(
                sockets.output, sockets.output_hang_ups, processes, self._handle_frames, self._on_process_exit
            )
        except BaseException:
            self._closed = True
            self._finalizer()
            raise
        ready = self.engines[0].ready
        assert ready is not None
        self.max_model_len, self.num_kv_blocks, self.engine_device = (
            ready.max_model_len,
            ready.num_gpu_blocks,
            ready.device,
        )
        # NOTE: every rank's cache, as get_stats() sums them.
        self.kv_cache_bytes = sum(engine.ready.kv_cache_bytes for engine in self.engines if engine.ready)
        self.kv_cache_tokens = sum(
            engine.ready.kv_cache_size_tokens for engine in self.engines if engine.ready
        )
        self.engine_pids = [engine.ready.pid for engine in self.engines if engine.ready is not None]
        self.engine_pid = self.engine_pids[0]

    def _rank_process(self, rank: int) -> EngineProcess | RemoteRank:
        """A rank's process: started here, placed by Ray, or started by hand elsewhere."""
        if self.resources.ray_cluster is not None:
            assert self.sockets is not None and self.sockets.remote_keys is not None
            return RayRank(rank, self.resources.ray_cluster, self.sockets.remote_keys)
        if rank in self.config.data_parallel_remote_ranks:
            return RemoteRank(rank, self.config.data_parallel_keys or "")
        return EngineProcess(self.config.start_method)

    @property
    def process(self) -> EngineProcess | RemoteRank:
        """The (first) engine process."""
        return self.engines[0].process

    @property
    def sockets(self) -> EngineSockets | None:
        return self.resources.sockets

    @property
    def receiver(self) -> ThreadReceiver | LoopReceiver | None:
        return self.resources.receiver

    @property
    def ranks(self) -> list[int]:
        return [engine.rank for engine in self.engines]

    @property
    def num_ranks(self) -> int:
        return len(self.engines)

    # ---- sending ------------------------------------------------------------------------------------
    def _send(self, message: Any, rank: int | None = None) -> None:
        self._check_usable()
        self._send_unchecked(message, rank)

    def _send_unchecked(self, message: Any, rank: int | None) -> None:
        assert self.sockets is not None
        identity = self._engine(rank).identity
        with self._send_lock:  # NOTE: encoding too: the encoder collects one message's tensor frames
            frames = [identity, *self._encoder.encode(message)]
            try:
                self.sockets.input.send_multipart(frames, copy=False)
            except zmq.ZMQError as error:
                self._check_usable()
                # An unreachable peer has closed its socket: it is exiting, and its threads may take a moment
                # more to finish (the main one is a zombie before the others are gone).
                gone = next(
                    (engine for engine in self.engines if engine.process.wait_dead(UNREACHABLE_GRACE_S)), None
                )
                if gone is not None:
                    # NOTE: the receiver names the death once it has read what the engine sent before it (its
                    # EngineDead): marking it here first would race that. Nobody may be reading meanwhile (an
                    # "async" engine with no loop running): this thread then reads. Past the grace, say how
                    # it ended, as the receiver would have.
                    if self.receiver is not None:
                        self.receiver.wait_reported(REPORT_GRACE_S)
                    self._mark_dead(self._exit_reason(gone), gone)
                    self._check_usable()
                raise EngineDeadError(f"cannot reach the engine process: {error}") from error

    def _engine(self, rank: int | None) -> EngineRank:
        if rank is None:
            return self.engines[0]
        for engine in self.engines:
            if engine.rank == rank:
                return engine
        raise ValueError(f"rank must be one of {self.ranks}, got {rank!r}")

    def _check_usable(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._closed:
            raise EngineShutdownError("the engine has been shut down; call engine.restart()")

    def add_request(self, request: EngineCoreRequest) -> None:
        # NOTE: the samples of one prompt go to one rank: they share its prompt's KV blocks there.
        balancer = self.balancer
        rank = (
            balancer.choose(request.request_id, request.parent_request_id) if balancer is not None else None
        )
        try:
            self._send(request, rank)
        except BaseException:
            if self.balancer is not None:
                self.balancer.finished(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.balancer is None:
            self._send(AbortRequest(list(request_ids)))
            return
        for rank, ids in self.balancer.by_rank(request_ids).items():  # an abort follows its request
            self._send(AbortRequest(ids), rank)

    def _targets(self, rank: int | None) -> list[int]:
        return [self._engine(rank).rank] if rank is not None or len(self.engines) == 1 else self.ranks

    def _utility_request(self, call_id: int, method_name: str, args: tuple[Any, ...]) -> UtilityRequest:
        try:
            msgspec.msgpack.encode(list(args))
        except TypeError as error:
            self._pending.discard(call_id)
            raise TypeError(f"utility arguments must be msgpack-able: {error}") from None
        return UtilityRequest(call_id, method_name, list(args))

    def call_utility(
        self, method_name: str, *args: Any, timeout: float | None = None, rank: int | None = None
    ) -> Any:
        """Call a utility on one rank; without ``rank`` and with several ranks, on each (a list of results)."""
        self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = []
        try:
            for target in self._targets(rank):
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                call_id = self._pending.add(future)
                calls.append((call_id, future))
                self._send(self._utility_request(call_id, method_name, args), target)
            results = []
            for _, future in calls:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                results.append(self._receiver().wait_future(future, remaining))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        finally:
            for call_id, _ in calls:
                self._pending.discard(call_id)
        return results if rank is None and len(self.engines) > 1 else results[0]

    async def call_utility_async(
        self, method_name: str, *args: Any, timeout: float | None = None, rank: int | None = None
    ) -> Any:
        self._check_usable()
        if isinstance(self.receiver, LoopReceiver):
            self.receiver.bind()  # someone must read the answer on this loop
        loop, calls = asyncio.get_running_loop(), []
        try:
            for target in self._targets(rank):
                future = loop.create_future()
                call_id = self._pending.add(future)
                calls.append((call_id, future))
                self._send(self._utility_request(call_id, method_name, args), target)
            with awaiting_with_signal_checks():
                results = await answers([future for _, future in calls], timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        finally:
            for call_id, _ in calls:
                self._pending.discard(call_id)
        return list(results) if rank is None and len(self.engines) > 1 else results[0]

    # ---- receiving ----------------------------------------------------------------------------------
    def get_output(self, timeout: float | None = 0) -> EngineCoreOutputs | None:
        """Take the next batch, waiting up to ``timeout``; ``None`` if none came."""
        receiver = self._receiver()
        batch = receiver.pop()
        if batch is None and timeout != 0:
            receiver.wait(timeout)
            batch = receiver.pop()
        if batch is None and receiver.dead:
            self._check_usable()
            raise EngineDeadError("the engine is gone")
        return batch

    def wait_for_output(self, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        self._receiver().wait(timeout, until)

    def wake_waiters(self) -> None:
        receiver = self.receiver
        if receiver is not None:
            receiver.wake_waiters()

    async def wait_for_output_async(self) -> None:
        await self._receiver().wait_async()

    def _receiver(self) -> ThreadReceiver | LoopReceiver:
        self._check_usable()
        assert self.receiver is not None
        return self.receiver

    def _handle_frames(self, frames: list[Any]) -> EngineCoreOutputs | None:
        """Decode one message: answer utility calls; return step outputs to queue; note a death."""
        try:
            message = self._decoder.decode(frames)
        except Exception as error:
            logger.warning("dropped a malformed output message: %s", error)
            return None
        if isinstance(message, EngineDead):
            self._on_engine_dead(message)
            return None
        for answer in message.utility_outputs:
            self._pending.resolve(answer)
        if self.balancer is not None:
            for output in message.outputs:
                if output.finish_reason is not None:
                    self.balancer.finished(output.request_id)
        return message if message.outputs else None

    # ---- death --------------------------------------------------------------------------------------
    def _on_process_exit(self, process: WatchedProcess) -> None:
        engine = next(engine for engine in self.engines if engine.process is process)
        self._mark_dead(self._exit_reason(engine), engine)

    def _exit_reason(self, engine: EngineRank) -> str:
        if engine.rank in self._last_words:
            return self._last_words[engine.rank]
        # its EngineDead lost (see wire.messages.last_words): the output it wrote as it sent it
        said = last_words(engine.process.error_tail())
        if said is not None:
            return self._death_reason(engine, said)
        # NOTE: an engine that stopped for a signal sends EngineDead naming it before it exits, and the receiver
        # reports the exit after it; should that message be lost, its exit code (128 + the signal) says the same.
        # This front end sends none before it has closed, when an exit is no death.
        code = engine.process.returncode() if isinstance(engine.process, EngineProcess) else None
        if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            assert isinstance(code, int)
            return self._stopped_for(engine, signal.Signals(code - 128).name)
        return f"{self._who(engine)}the engine process died"

    def _stopped_for(self, engine: EngineRank, signal_name: str) -> str:
        return (
            f"{self._who(engine)}the engine process was sent {signal_name} (not by this front end) and stopped; "
            "the requests it was running did not finish"
        )

    def _on_engine_dead(self, message: EngineDead) -> None:
        engine = next((e for e in self.engines if e.rank == message.engine_index), self.engines[0])
        reason = self._death_reason(engine, message)
        # NOTE: noted before any thread starts: the exit the receiver reports next (on another thread, which
        # may take the death lock first) names this reason too
        self._last_words[engine.rank] = reason
        if running_loop() is None:
            self._mark_dead(reason, engine)
        else:  # NOTE: describing the death waits for the exit (up to a second): never on a running loop
            thread = threading.Thread(
                target=self._mark_dead, args=(reason, engine), name="enginekit-engine-exit"
            )
            thread.daemon = True
            thread.start()

    def _death_reason(self, engine: EngineRank, message: EngineDead) -> str:
        if message.signal_name is not None:
            return self._stopped_for(engine, message.signal_name)
        return f"{self._who(engine)}the engine core reported a fatal error ({message.reason})"

    def _who(self, engine: EngineRank) -> str:
        return f"engine rank {engine.rank}: " if len(self.engines) > 1 or engine.rank else ""

    def _mark_dead(self, reason: str, engine: EngineRank) -> None:
        with self._dead_lock:
            if self._dead_error is not None or self._closed:
                return
            self._dead_error = _describe_death(reason, engine.process)
        logger.info("%s", self._dead_error)
        self._pending.fail_all(self._dead_error)
        if self.receiver is not None:
            self.receiver.mark_dead()

    @property
    def is_alive(self) -> bool:
        return (
            not self._closed and self._dead_error is None and all(e.process.is_alive() for e in self.engines)
        )

    # ---- shutdown -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        for engine in self.engines:
            if engine.process.is_alive():  # after a rank's death too: the others then exit at once
                with contextlib.suppress(Exception):
                    self._send_unchecked(ShutdownRequest(timeout), engine.rank)
        self._closed = True  # from here on, a process exiting is not a death
        self._pending.fail_all(EngineShutdownError("the engine was shut down"))
        self.resources.stop_timeout = timeout + SHUTDOWN_GRACE_S
        self._finalizer()


class SyncMPClient(MPClient):
    """Engines in background processes; a thread receives their outputs (mode ``"mp"``)."""

    mode = "mp"
    receiver_type = ThreadReceiver


class AsyncMPClient(MPClient):
    """Engines in background processes; a task on the caller's loop receives their outputs (``"async"``)."""

    mode = "async"
    receiver_type = LoopReceiver


def _describe_death(reason: str, process: EngineProcess | RemoteRank) -> EngineDeadError:
    process.wait_dead(1.0)  # it usually exits right after its last message
    lines = [line for line in process.error_tail().splitlines() if not line.startswith(LAST_WORDS)]
    tail = "\n".join(lines[-12:]) if not process.is_alive() else ""
    return EngineDeadError(
        f"{reason}; {process.describe_exit()}. Call engine.restart() to start a new engine."
        + (f"\nLast engine output:\n{tail}" if tail else "")
    )
