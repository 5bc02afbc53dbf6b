"""MPClient: the front end of an engine process — sockets, handshake, sending, liveness, shutdown.

Front end ``ROUTER`` (bound) → engine ``DEALER`` carries requests (and, during startup, the engine's phase
reports and READY the other way); engine ``PUSH`` → front end ``PULL`` (bound) carries outputs. Every message
is ``[msgpack body, *tensor frames]`` (the ROUTER adds the engine's identity). Who reads the output socket is
the receiver's business: a thread (``SyncMPClient``) or a task on the caller's loop (``AsyncMPClient``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, ClassVar

import msgspec
import zmq

from enginekit.client.base import EngineCoreClient
from enginekit.client.pending import PendingCalls
from enginekit.client.receiver import LoopReceiver, ThreadReceiver
from enginekit.client.sockets import EngineSockets
from enginekit.config import EngineConfig
from enginekit.errors import EngineDeadError, EngineShutdownError, EngineStartupError
from enginekit.model.loader import ModelSpec
from enginekit.runtime.engine_process import EngineProcess
from enginekit.runtime.launcher import LauncherError
from enginekit.wire.messages import (
    AbortRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineOutput,
    EngineProcArgs,
    PhaseReport,
    ReadyMessage,
    ShutdownRequest,
    StartupReport,
    UtilityRequest,
    engine_identity,
)
from enginekit.wire.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("enginekit.client")

SHUTDOWN_GRACE_S = 5.0


class MPClient(EngineCoreClient):
    """Starts the engine process, owns its sockets; its receiver decides how outputs are awaited."""

    receiver_type: ClassVar[type[ThreadReceiver] | type[LoopReceiver]]

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None, *, engine_index: int = 0) -> None:
        # ``spec`` is unused: the engine process reads the model itself.
        self.config = config
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        self._closed = False
        self._dead_error: EngineDeadError | None = None
        self._dead_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineOutput)
        self._pending = PendingCalls()
        self.process = EngineProcess(config.start_method)
        self.sockets: EngineSockets | None = None
        self.receiver: ThreadReceiver | LoopReceiver | None = None
        try:
            self.sockets = EngineSockets(config, self.process)
            self._start_engine()
            self.receiver = self.receiver_type(
                self.sockets.output, self.process, self._handle_frames, self._on_process_exit
            )
        except BaseException:
            self._close_resources()
            raise

    # ---- startup ------------------------------------------------------------------------------------
    def _start_engine(self) -> None:
        assert self.sockets is not None
        args = EngineProcArgs(
            self.config,
            self.sockets.input_address,
            self.sockets.output_address,
            self.engine_index,
            *self.sockets.curve_client_keys,
        )
        try:
            self.process.start(args)
        except (OSError, LauncherError) as error:
            raise EngineStartupError(f"cannot start the engine process: {error}", phase="spawn") from error
        ready = self._wait_for_ready(time.monotonic() + self.config.startup_timeout)
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_gpu_blocks
        self.kv_cache_size_tokens = ready.kv_cache_size_tokens
        self.engine_pid = ready.pid
        self.engine_device = ready.device

    def _wait_for_ready(self, deadline: float) -> ReadyMessage:
        assert self.sockets is not None
        socket = self.sockets.input
        decoder = msgspec.msgpack.Decoder(StartupReport)
        while True:
            if socket.poll(100):
                frames = socket.recv_multipart()
                report = _decode_report(decoder, frames, self.identity)
                if isinstance(report, ReadyMessage):
                    return report
                if isinstance(report, PhaseReport):
                    self.process.phase = report.phase
                continue
            if not self.process.is_alive():
                raise self._startup_error(
                    f"engine startup failed during {self.process.phase}: {self.process.describe_exit()}"
                )
            if time.monotonic() > deadline:
                phase = self.process.phase
                self.process.stop(0.0)
                raise self._startup_error(
                    f"engine did not report READY within startup_timeout={self.config.startup_timeout}s "
                    f"(stuck in {phase}); the engine process was killed",
                )

    def _startup_error(self, headline: str) -> EngineStartupError:
        tail = self.process.error_tail()
        cause = _last_error_line(tail)
        message = f"{cause}\n{headline}." if cause else f"{headline}."
        if tail:
            message += f"\nLast engine output:\n{tail}"
        return EngineStartupError(message, phase=self.process.phase, error_tail=tail)

    # ---- sending ------------------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        self._check_usable()
        assert self.sockets is not None
        with self._send_lock:  # NOTE: encoding too: the encoder collects one message's tensor frames
            frames = [self.identity, *self._encoder.encode(message)]
            try:
                self.sockets.input.send_multipart(frames, copy=False)
            except zmq.ZMQError as error:
                self._check_usable()
                raise EngineDeadError(f"cannot reach the engine process: {error}") from error

    def _check_usable(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._closed:
            raise EngineShutdownError("the engine has been shut down; call engine.restart()")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequest(list(request_ids)))

    def _utility_request(self, call_id: int, method_name: str, args: tuple[Any, ...]) -> UtilityRequest:
        try:
            msgspec.msgpack.encode(list(args))
        except TypeError as error:
            self._pending.discard(call_id)
            raise TypeError(f"utility arguments must be msgpack-able: {error}") from None
        return UtilityRequest(call_id, method_name, list(args))

    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        self._check_usable()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = self._pending.add(future)
        try:
            self._send(self._utility_request(call_id, method_name, args))
            return self._receiver().wait_future(future, timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        finally:
            self._pending.discard(call_id)

    async def call_utility_async(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        self._check_usable()
        if isinstance(self.receiver, LoopReceiver):
            self.receiver.bind()  # someone must read the answer on this loop
        future = asyncio.get_running_loop().create_future()
        call_id = self._pending.add(future)
        try:
            self._send(self._utility_request(call_id, method_name, args))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        finally:
            self._pending.discard(call_id)

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

    def wait_for_output(self, timeout: float | None) -> None:
        self._receiver().wait(timeout)

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
            self._on_engine_dead(f"the engine core reported a fatal error ({message.reason})")
            return None
        for answer in message.utility_outputs:
            self._pending.resolve(answer)
        return message if message.outputs else None

    def _on_process_exit(self) -> None:
        self._mark_dead("the engine process died")

    def _on_engine_dead(self, reason: str) -> None:
        if _running_loop() is None:
            self._mark_dead(reason)
        else:  # NOTE: describing the death waits for the exit (up to a second): never on a running loop
            threading.Thread(
                target=self._mark_dead, args=(reason,), name="enginekit-engine-exit", daemon=True
            ).start()

    def _mark_dead(self, reason: str) -> None:
        with self._dead_lock:
            if self._dead_error is not None or self._closed:
                return
            self._dead_error = self._describe_death(reason)
        logger.info("%s", self._dead_error)
        self._pending.fail_all(self._dead_error)
        if self.receiver is not None:
            self.receiver.mark_dead()

    def _describe_death(self, reason: str) -> EngineDeadError:
        self.process.wait_dead(1.0)  # it usually exits right after its last message
        status = self.process.describe_exit()
        tail = "\n".join(self.process.error_tail().splitlines()[-12:]) if not self.process.is_alive() else ""
        return EngineDeadError(
            f"{reason}; {status}. Call engine.restart() to start a new engine."
            + (f"\nLast engine output:\n{tail}" if tail else "")
        )

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._dead_error is None and self.process.is_alive()

    # ---- shutdown -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        if self._dead_error is None and self.process.is_alive():
            with contextlib.suppress(Exception):
                self._send(ShutdownRequest(timeout))
        self._closed = True  # from here on, the process exiting is not a death
        self._pending.fail_all(EngineShutdownError("the engine was shut down"))
        self._close_resources(stop_timeout=timeout + SHUTDOWN_GRACE_S)

    def _close_resources(self, *, stop_timeout: float = 0.0) -> None:
        """Stop receiving, then stop the process (the receiver watches its pidfd), then close the sockets."""
        self._closed = True
        if self.receiver is not None:
            self.receiver.close()
        self.process.stop(stop_timeout)
        if self.sockets is not None:
            self.sockets.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.shutdown(timeout=0)


class SyncMPClient(MPClient):
    """The engine in a background process; a thread receives its outputs (mode ``"mp"``)."""

    mode = "mp"
    receiver_type = ThreadReceiver


class AsyncMPClient(MPClient):
    """The engine in a background process; a task on the caller's loop receives its outputs (``"async"``)."""

    mode = "async"
    receiver_type = LoopReceiver


def _decode_report(decoder: msgspec.msgpack.Decoder, frames: list[bytes], identity: bytes) -> Any:
    if len(frames) == 2 and frames[0] == identity:
        with contextlib.suppress(msgspec.MsgspecError):
            return decoder.decode(frames[1])
    logger.warning("ignored an unexpected message during the handshake")
    return None


def _last_error_line(tail: str) -> str:
    """The exception line of a traceback in the engine's output, to lead the startup error with."""
    for line in reversed(tail.splitlines()):
        if (
            line
            and not line.startswith((" ", "\t", "Traceback"))
            and ("Error" in line or "Exception" in line)
        ):
            return line.strip()
    return ""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
