"""EngineCoreProc: the engine core in its own process, fed by two IO threads.

    front end ROUTER ──► DEALER ─ input thread ─► input_queue ─┐
                                                (aborts_queue) ├─► busy loop (main thread): EngineCore.step
    front end PULL   ◄── PUSH ─── output thread ◄─ output_queue┘

The main loop never touches a socket: socket IO releases the GIL, so (de)serialisation in the IO threads
overlaps with the forward pass. Started as ``python -m enginekit.core.engine_core_proc``; its arguments
arrive as one msgpack message on stdin, which then stays open as the parent-death pipe.
"""

from __future__ import annotations

import enum
import faulthandler
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec
import torch
import zmq

from enginekit.config import EngineConfig
from enginekit.core.engine_core import EngineCore
from enginekit.core.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ReadyMessage,
    RequestType,
    ShutdownRequest,
    UtilityOutput,
    UtilityRequest,
)
from enginekit.core.serial import MsgpackDecoder, MsgpackEncoder
from enginekit.model.runner import ExecutorError

logger = logging.getLogger("enginekit.engine_process")

READY_TIMEOUT_S = 10.0
ORPHAN_GRACE_S = 2.0
GIL_YIELD_S = 0.001


class EngineProcArgs(msgspec.Struct, array_like=True):
    """Everything the engine process needs, sent by the front end on stdin."""

    config: EngineConfig
    input_address: str
    output_address: str
    identity: bytes
    curve_server_public: bytes = b""
    curve_client_public: bytes = b""
    curve_client_secret: bytes = b""


class ShutdownState(enum.Enum):
    RUNNING = 0
    REQUESTED = 1
    DONE = 2


class EngineCoreProc(EngineCore):
    def __init__(self, args: EngineProcArgs) -> None:
        self.args = args
        self.input_queue: queue.SimpleQueue[tuple[RequestType, Any]] = queue.SimpleQueue()
        self.aborts_queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.shutdown_state = ShutdownState.RUNNING
        self.shutdown_deadline: float | None = None
        self.max_output_queue_depth = 0  # deepest the output queue has been (back-pressure check)
        self._debug_kill_io: str | None = None
        self._ready = threading.Event()
        self._zmq = zmq.Context(io_threads=1)
        self._input_thread_ready = threading.Event()
        self.input_thread = threading.Thread(
            target=self._run_io, args=(self._input_loop,), name="enginekit-input", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._run_io, args=(self._output_loop,), name="enginekit-output", daemon=True
        )
        self.input_thread.start()
        self.output_thread.start()
        report_phase("model load")
        super().__init__(args.config)
        report_phase("handshake")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._input_thread_ready.wait(0.1):
            if time.monotonic() > deadline and not self.input_thread.is_alive():
                raise RuntimeError("Input socket thread died during startup")
        # NOTE: the startup heap (model, tokenizer, modules) lives until exit: keep it out of GC scans.
        gc.collect()
        gc.freeze()
        self._ready.set()  # the input thread now sends READY

    # ---- the busy loop ------------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        while self.shutdown_state is not ShutdownState.DONE:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        if not self.has_work() and self.shutdown_state is ShutdownState.RUNNING:
            self._handle_client_request(*self.input_queue.get(block=True))
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                break
            self._handle_client_request(*item)

    def _process_engine_step(self) -> None:
        while True:
            try:
                self.abort_requests(self.aborts_queue.get_nowait())
            except queue.Empty:
                break
        if self.shutdown_state is ShutdownState.REQUESTED:
            self._advance_shutdown()
        if not self.has_work():
            return
        while self.output_queue.qsize() >= self.config.max_pending_outputs:
            # Back-pressure: the front end is not reading; stop producing until it does.
            time.sleep(GIL_YIELD_S)
            if self.shutdown_state is not ShutdownState.RUNNING or not self.output_thread.is_alive():
                break
        try:
            outputs, ran_forward = self.step()
        except ExecutorError as error:
            # The executor's failure callback: the loop raises "Executor failed." when it reads this.
            self.input_queue.put_nowait((RequestType.EXECUTOR_FAILED, str(error)))
            return
        if outputs:
            self.output_queue.put_nowait(EngineCoreOutputs(outputs, timestamp=time.monotonic()))
            self.max_output_queue_depth = max(self.max_output_queue_depth, self.output_queue.qsize())
        if not ran_forward and self.scheduler.has_unfinished_requests():
            time.sleep(GIL_YIELD_S)  # NOTE: let the IO threads take the GIL

    def _handle_client_request(self, request_type: RequestType, payload: Any) -> None:
        if request_type is RequestType.ADD:
            if self.shutdown_state is not ShutdownState.RUNNING:
                self._reject(payload, "engine shutting down")
                return
            try:
                self.add_request(payload)
            except ValueError as error:
                logger.warning("rejected request %s: %s", payload.request_id, error)
                if payload.request_id not in self.scheduler.requests:
                    # NOTE: never answer under the id of a running request: that would end it for the client.
                    self._reject(payload, str(error))
        elif request_type is RequestType.ABORT:
            self.abort_requests(payload)
        elif request_type is RequestType.UTILITY:
            self._handle_utility(payload)
        elif request_type is RequestType.SHUTDOWN:
            self.request_shutdown(payload.timeout)
        elif request_type is RequestType.EXECUTOR_FAILED:
            raise RuntimeError(f"Executor failed. {payload or ''}".strip())
        # WAKEUP: nothing to do; it only unblocked input_queue.get

    def add_request(self, message: EngineCoreRequest) -> None:
        # NOTE: the facade validates prompts, but a frame on the socket is not trusted: a token id outside the
        # vocabulary or misshapen embeddings would crash the forward pass and with it every other request.
        vocab_size, hidden_size = self.model_config.vocab_size, self.model_config.hidden_size
        token_ids = message.prompt_token_ids
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        embeds = message.prompt_embeds
        if embeds is not None and tuple(embeds.shape) != (len(token_ids), hidden_size):
            raise ValueError(
                f"prompt_embeds must have shape [{len(token_ids)}, {hidden_size}], got {list(embeds.shape)}"
            )
        super().add_request(message)

    def _reject(self, request: EngineCoreRequest, reason: str) -> None:
        output = EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.ABORT, stop_reason=reason
        )
        self.output_queue.put_nowait(EngineCoreOutputs([output]))

    def _handle_utility(self, request: UtilityRequest) -> None:
        def send(result: Any = None, failure: str | None = None) -> None:
            self.output_queue.put_nowait(
                EngineCoreOutputs(utility_output=UtilityOutput(request.call_id, result, failure))
            )

        if self.shutdown_state is not ShutdownState.RUNNING:
            send(failure="Server shutting down")
            return
        try:
            result = self.call_utility(request.method_name, request.args)
        except Exception as error:
            send(failure=f"{type(error).__name__}: {error}")
            return
        if hasattr(result, "add_done_callback"):  # a Future: answer when it completes

            def done(future: Any) -> None:
                try:
                    send(_plain(future.result()))
                except Exception as error:
                    send(failure=f"{type(error).__name__}: {error}")

            result.add_done_callback(done)
        else:
            send(_plain(result))

    # ---- debug utilities (tests reach them with engine.call_utility) --------------------------------
    def utility_debug_kill_io_thread(self, name: str) -> None:
        """Make the ``"input"`` or ``"output"`` IO thread raise at its next iteration (fault-injection hook).

        The output thread raises right after sending this call's answer; the input thread raises when the next
        message arrives (and drops it). Either way the engine process dies as it would from a real IO failure.
        """
        if name not in ("input", "output"):
            raise ValueError(f"name must be 'input' or 'output', got {name!r}")
        self._debug_kill_io = name

    def utility_debug_output_queue(self) -> dict[str, int]:
        """Depth of the output queue now and at its deepest, and the bound the busy loop keeps it under."""
        return {
            "depth": self.output_queue.qsize(),
            "max_depth": self.max_output_queue_depth,
            "max_pending_outputs": self.config.max_pending_outputs,
        }

    # ---- shutdown -----------------------------------------------------------------------------------
    def request_shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests; abort running ones now (timeout 0) or let them finish up to the timeout."""
        if self.shutdown_state is ShutdownState.RUNNING:
            timeout = self.config.shutdown_timeout if timeout is None else timeout
            self.shutdown_state = ShutdownState.REQUESTED
            self.shutdown_deadline = time.monotonic() + timeout
            logger.info("shutdown requested (timeout %.1fs)", timeout)

    def _advance_shutdown(self) -> None:
        assert self.shutdown_deadline is not None
        if time.monotonic() >= self.shutdown_deadline:
            self.abort_all()
        if not self.scheduler.has_unfinished_requests():
            outputs, _ = self.step()  # flush the final (abort) outputs
            if outputs:
                self.output_queue.put_nowait(EngineCoreOutputs(outputs, timestamp=time.monotonic()))
            self.shutdown_state = ShutdownState.DONE

    def signal_shutdown(self, signum: int, frame: Any) -> None:
        # NOTE: runs on the main thread between bytecodes; SimpleQueue.put is safe to call re-entrantly.
        self.request_shutdown()
        self.input_queue.put_nowait((RequestType.WAKEUP, None))

    def send_engine_dead(self) -> None:
        """Broadcast ENGINE_CORE_DEAD and wait (bounded) for the output thread to send it."""
        self.output_queue.put_nowait(ENGINE_CORE_DEAD)
        self.output_thread.join(timeout=5.0)

    def close_io(self) -> None:
        """Flush pending outputs and stop the output thread; the input thread dies with the process."""
        if self.output_thread.is_alive():
            self.output_queue.put_nowait(None)
            self.output_thread.join(timeout=5.0)

    # ---- IO threads ---------------------------------------------------------------------------------
    def _run_io(self, loop: Any) -> None:
        try:
            loop()
        except Exception as error:
            if self.shutdown_state is ShutdownState.DONE:
                return
            logger.exception("%s died", threading.current_thread().name)
            # An IO thread that dies after startup is an engine death, not something to ignore.
            self.input_queue.put_nowait(
                (RequestType.EXECUTOR_FAILED, f"{threading.current_thread().name} died: {error}")
            )

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        socket = self._zmq.socket(kind)
        socket.setsockopt(zmq.LINGER, 5000)
        if self.args.curve_server_public:
            socket.curve_serverkey = self.args.curve_server_public
            socket.curve_publickey = self.args.curve_client_public
            socket.curve_secretkey = self.args.curve_client_secret
        return socket

    def _input_loop(self) -> None:
        socket = self._socket(zmq.DEALER, self.args.input_address)
        socket.setsockopt(zmq.IDENTITY, self.args.identity)
        socket.connect(self.args.input_address)
        decoders = {
            RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            RequestType.ABORT: MsgpackDecoder(list[str]),
            RequestType.UTILITY: MsgpackDecoder(UtilityRequest),
            RequestType.SHUTDOWN: MsgpackDecoder(ShutdownRequest),
        }
        try:
            self._serve_input(socket, decoders)
        finally:
            socket.close(linger=0)

    def _serve_input(self, socket: zmq.Socket, decoders: dict) -> None:
        self._input_thread_ready.set()
        self._ready.wait()
        ready = ReadyMessage(
            status="READY",
            max_model_len=self.max_model_len,
            num_gpu_blocks=self.num_kv_blocks,
            kv_cache_size_tokens=self.num_kv_blocks * self.config.block_size,
            block_size=self.config.block_size,
            pid=os.getpid(),
            device=str(self.device),
        )
        socket.send_multipart([b"READY", msgspec.msgpack.encode(ready)])
        while True:
            frames = socket.recv_multipart(copy=False)
            if self._debug_kill_io == "input":
                raise RuntimeError("input thread stopped by debug_kill_io_thread")
            item = self._decode_request(frames, decoders)
            if item is None:
                continue
            if item[0] is RequestType.ABORT:
                self.aborts_queue.put_nowait(item[1])
            self.input_queue.put_nowait(item)

    @staticmethod
    def _decode_request(frames: list[Any], decoders: dict) -> tuple[RequestType, Any] | None:
        """Decode one message; a malformed one is logged and dropped, never fatal."""
        try:
            request_type = RequestType(frames[0].bytes)
        except ValueError:
            logger.warning("dropped a message with unknown request type %r", frames[0].bytes[:16])
            return None
        if request_type is RequestType.EXECUTOR_FAILED:
            logger.warning("dropped an EXECUTOR_FAILED message from the socket (it is internal only)")
            return None
        if request_type is RequestType.WAKEUP:
            if len(frames) == 1:
                return request_type, None
            logger.warning("dropped a WAKEUP message with a body")
            return None
        if len(frames) < 2:
            logger.warning("dropped a %s message without a body", request_type.name)
            return None
        try:
            return request_type, decoders[request_type].decode(frames[1:])
        except Exception as error:  # msgspec.DecodeError, ValidationError, bad tensor frames...
            logger.warning("dropped a malformed %s message: %s", request_type.name, error)
            return None

    def _output_loop(self) -> None:
        socket = self._socket(zmq.PUSH, self.args.output_address)
        socket.setsockopt(zmq.SNDHWM, self.args.config.max_pending_outputs)
        socket.connect(self.args.output_address)
        try:
            self._serve_output(socket)
        finally:
            socket.close()  # lingers until queued messages are sent

    def _serve_output(self, socket: zmq.Socket) -> None:
        encoder = MsgpackEncoder()
        max_reuse = 2  # NOTE: len(sockets) + 1 reusable encode buffers
        reuse: list[bytearray] = []
        in_flight: deque[tuple[zmq.MessageTracker, list[Any], bytearray]] = deque()
        while True:
            outputs = self.output_queue.get()
            if outputs is None:
                return
            if outputs is ENGINE_CORE_DEAD:
                socket.send(ENGINE_CORE_DEAD, copy=True)
                return
            while in_flight and in_flight[0][0].done:
                buffer = in_flight.popleft()[2]
                if len(reuse) < max_reuse:
                    reuse.append(buffer)
            buffer = reuse.pop() if reuse else bytearray()
            frames = encoder.encode_into(outputs, buffer)
            tracker = socket.send_multipart(frames, copy=False, track=True)
            # Buffers (and the tensors behind tensor frames) stay referenced until zmq has sent them.
            in_flight.append((tracker, frames, buffer))
            if self._debug_kill_io == "output":
                raise RuntimeError("output thread stopped by debug_kill_io_thread")


def report_phase(phase: str) -> None:
    """Tell the front end which startup phase we are in (it names it if startup fails)."""
    sys.stderr.write(f"enginekit-phase: {phase}\n")
    sys.stderr.flush()


def _plain(result: Any) -> Any:
    """Utility results must be msgpack-able; say so clearly instead of failing in the output thread."""
    try:
        msgspec.msgpack.encode(result)
    except TypeError as error:
        raise TypeError(f"utility result of type {type(result).__name__} cannot be sent: {error}") from None
    return result


def run_engine_core(args: EngineProcArgs) -> int:
    """Entry of the engine process: run until shut down; any exception is broadcast as ENGINE_CORE_DEAD."""
    engine: EngineCoreProc | None = None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    shutdown_requested = threading.Event()

    def early_signal(signum: int, frame: Any) -> None:
        shutdown_requested.set()
        raise SystemExit(128 + signum)  # during startup: just stop loading

    for sig in previous:
        signal.signal(sig, early_signal)
    try:
        engine = EngineCoreProc(args)
        for sig in previous:
            signal.signal(sig, engine.signal_shutdown)
        engine.run_busy_loop()
        engine.close_io()
        return 0
    except SystemExit:
        raise
    except BaseException:
        logger.exception("engine core failed")
        if engine is not None:
            engine.send_engine_dead()
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if engine is not None:
            engine.shutdown_state = ShutdownState.DONE
            engine.shutdown()
            gc.unfreeze()
            _terminate(engine._zmq)


def _terminate(context: zmq.Context) -> None:
    """Let queued output messages reach the front end before the process exits (bounded wait)."""
    closer = threading.Thread(target=context.term, name="enginekit-zmq-term", daemon=True)
    closer.start()
    closer.join(timeout=5.0)


def _watch_parent(stdin: Any) -> None:
    """The parent holds our stdin open; EOF means it died: shut down, and exit hard if that hangs."""
    try:
        while stdin.read(4096):
            pass
    except OSError:
        pass
    logger.warning("front-end process is gone; engine process exiting")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(3)


def default_num_threads() -> int:
    """torch threads of an engine process: every core this process may use but one."""
    return max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else 1


def main() -> None:
    # A crash in native code (a segfault, an abort) then leaves the crashing stack in the error tail.
    faulthandler.enable(all_threads=False)
    report_phase("startup")
    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(8), "little")
    args = msgspec.msgpack.decode(stdin.read(size), type=EngineProcArgs)
    logging.basicConfig(
        level=args.config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s engine[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(target=_watch_parent, args=(stdin,), name="enginekit-parent-watch", daemon=True).start()
    # NOTE: the front end and our IO threads need a core too: by default torch takes the others. On a
    # loaded machine, more OpenMP threads than free cores makes every matmul wait at a barrier.
    torch.set_num_threads(args.config.num_threads or default_num_threads())
    try:
        code = run_engine_core(args)
    except SystemExit as exit_request:  # a signal during startup
        code = exit_request.code if isinstance(exit_request.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE: daemon IO threads may sit in blocking socket calls; do not wait for them


if __name__ == "__main__":
    main()
