"""MPClient: the front end of an engine process — sockets, handshake, liveness, shutdown.

Front end ``ROUTER`` (bound) → engine ``DEALER`` carries requests; engine ``PUSH`` → front end ``PULL``
(bound) carries outputs. Each message is ``[request type, msgpack body, *tensor frames]``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from enginekit.client.base import EngineCoreClient
from enginekit.client.engine_process import EngineProcess
from enginekit.client.launcher import LauncherError
from enginekit.config import EngineConfig
from enginekit.core.engine_core_proc import EngineProcArgs
from enginekit.core.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    ReadyMessage,
    RequestType,
    ShutdownRequest,
    UtilityRequest,
)
from enginekit.core.serial import MsgpackDecoder, MsgpackEncoder
from enginekit.errors import (
    EngineDeadError,
    EngineShutdownError,
    EngineStartupError,
    UtilityCallError,
)

logger = logging.getLogger("enginekit.client")

ENGINE_IDENTITY = b"engine-0"
SHUTDOWN_GRACE_S = 5.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class MPClient(EngineCoreClient):
    """Starts the engine process and owns the sockets; subclasses decide how outputs are awaited."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._closed = False
        self._dead_error: EngineDeadError | None = None
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self.process = EngineProcess(config.start_method)
        self._context = zmq.Context(io_threads=1)
        try:
            self._open_sockets()
            self._start_engine()
        except BaseException:
            self._close_resources(kill=True)
            raise

    # ---- startup ------------------------------------------------------------------------------------
    def _open_sockets(self) -> None:
        config = self.config
        self.input_socket = self._context.socket(zmq.ROUTER)
        self.output_socket = self._context.socket(zmq.PULL)
        for socket in (self.input_socket, self.output_socket):
            socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output_socket.setsockopt(zmq.RCVHWM, config.max_pending_outputs)
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if config.address is None or config.address.startswith("ipc://"):
            base = self.process.ipc_address("") if config.address is None else config.address
            self.input_address, self.output_address = base + "input.sock", base + "output.sock"
            self.input_socket.bind(self.input_address)
            self.output_socket.bind(self.output_address)
            return
        host, colon, port = config.address.removeprefix("tcp://").rpartition(":")
        if colon and not host:
            host = "127.0.0.1"  # no host named: loopback, never every interface
        if not host or not port.isdigit():
            raise ValueError(
                f"address must look like tcp://HOST:PORT or tcp://:PORT (loopback), got {config.address!r}"
            )
        if zmq.has("curve"):
            # NOTE: a per-engine CURVE key pair is the secret: a peer that does not know the server key
            # never completes the handshake, so it can neither send requests nor read outputs.
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            for socket in (self.input_socket, self.output_socket):
                socket.curve_server = True
                socket.curve_secretkey = server_secret
                socket.curve_publickey = server_public
            self._curve = (server_public, client_public, client_secret)
        elif host not in LOOPBACK_HOSTS:
            raise EngineStartupError(
                f"refusing to bind {config.address}: this libzmq has no CURVE support to protect a "
                "non-loopback endpoint",
                phase="spawn",
            )
        addresses = []
        for socket in (self.input_socket, self.output_socket):
            if port == "0":
                bound = socket.bind_to_random_port(f"tcp://{host}")
                addresses.append(f"tcp://{host}:{bound}")
            else:
                socket.bind(f"tcp://{host}:{port}")
                addresses.append(f"tcp://{host}:{port}")
                port = str(int(port) + 1)
        self.input_address, self.output_address = addresses

    def _start_engine(self) -> None:
        server_public, client_public, client_secret = self._curve or (b"", b"", b"")
        args = EngineProcArgs(
            self.config,
            self.input_address,
            self.output_address,
            ENGINE_IDENTITY,
            server_public,
            client_public,
            client_secret,
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
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        while True:
            if dict(poller.poll(100)):
                frames = self.input_socket.recv_multipart()
                if len(frames) == 3 and frames[0] == ENGINE_IDENTITY and frames[1] == b"READY":
                    with contextlib.suppress(msgspec.MsgspecError):
                        return msgspec.msgpack.decode(frames[2], type=ReadyMessage)
                logger.warning("ignored an unexpected message during the handshake")
                continue
            if not self.process.is_alive():
                phase = self.process.phase
                raise EngineStartupError(
                    f"engine startup failed during {phase}: {self.process.describe_exit()}.\n"
                    f"Last engine output:\n{self.process.error_tail()}",
                    phase=phase,
                    error_tail=self.process.error_tail(),
                )
            if time.monotonic() > deadline:
                phase = self.process.phase
                self.process.stop(0.0)
                raise EngineStartupError(
                    f"engine did not report READY within startup_timeout={self.config.startup_timeout}s "
                    f"(stuck in {phase}); the engine process was killed.\n"
                    f"Last engine output:\n{self.process.error_tail()}",
                    phase=phase,
                    error_tail=self.process.error_tail(),
                )

    # ---- sending ------------------------------------------------------------------------------------
    def _send(self, request_type: RequestType, payload: Any = None) -> None:
        self._check_usable()
        frames = [ENGINE_IDENTITY, request_type.value]
        if payload is not None:
            frames.extend(self._encoder.encode(payload))
        with self._send_lock:
            try:
                self.input_socket.send_multipart(frames, copy=False)
            except zmq.ZMQError as error:
                self._check_usable()
                raise EngineDeadError(f"cannot reach the engine process: {error}") from error

    def _check_usable(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._closed:
            raise EngineShutdownError("the engine has been shut down; call engine.restart()")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(RequestType.ABORT, list(request_ids))

    def _utility_request(self, method_name: str, args: tuple[Any, ...]) -> UtilityRequest:
        try:
            msgspec.msgpack.encode(list(args))
        except TypeError as error:
            raise TypeError(f"utility arguments must be msgpack-able: {error}") from None
        return UtilityRequest(0, next(self._call_ids), method_name, list(args))

    # ---- receiving ----------------------------------------------------------------------------------
    def _handle_frames(self, frames: list[Any]) -> None:
        if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
            self._mark_dead("the engine core reported a fatal error")
            return
        try:
            outputs: EngineCoreOutputs = self._decoder.decode(frames)
        except Exception as error:
            logger.warning("dropped a malformed output message: %s", error)
            return
        if outputs.utility_output is not None:
            result = outputs.utility_output
            error = UtilityCallError(result.failure_message) if result.failure_message else None
            self._resolve_utility(result.call_id, result.result, error)
        if outputs.outputs:
            self._deliver(outputs)

    def _mark_dead(self, reason: str) -> None:
        if self._dead_error is not None or self._closed:
            return
        self.process.wait_dead(1.0)  # usually exits right after its last message
        status = self.process.describe_exit()
        tail = "\n".join(self.process.error_tail().splitlines()[-12:])
        self._dead_error = EngineDeadError(
            f"{reason}; {status}. Call engine.restart() to start a new engine."
            + (f"\nLast engine output:\n{tail}" if tail else "")
        )
        logger.info("%s", self._dead_error)
        self._fail_waiters(self._dead_error)

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        raise NotImplementedError

    def _resolve_utility(self, call_id: int, result: Any, error: BaseException | None) -> None:
        raise NotImplementedError

    def _fail_waiters(self, error: BaseException) -> None:
        raise NotImplementedError

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
                self._send(RequestType.SHUTDOWN, ShutdownRequest(timeout))
        self._closed = True  # from here on, the process exiting is not a death
        self.process.stop(timeout + SHUTDOWN_GRACE_S)
        self._stop_receiving()
        self._fail_waiters(EngineShutdownError("the engine was shut down"))
        self._close_resources()

    def _stop_receiving(self) -> None:
        raise NotImplementedError

    def _close_resources(self, kill: bool = False) -> None:
        self._closed = True
        if kill:
            self.process.stop(0.0)
        for name in ("input_socket", "output_socket"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.shutdown(timeout=0)


def pidfd_or_none(process: EngineProcess) -> int | None:
    return process.pidfd if process.pidfd is not None and os.name == "posix" else None
