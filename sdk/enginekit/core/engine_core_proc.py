"""EngineCoreProc: the engine core in its own process — two IO threads and a loop of ``handle``, then ``step``.

    front end ROUTER ──► DEALER ─ input thread ─► input_queue ─┐
                                                (aborts_queue) ├─► busy loop (main thread): handle, step
    front end PULL   ◄── PUSH ─── output thread ◄─ output_queue┘

The main loop never touches a socket: socket IO releases the GIL, so (de)serialisation in the IO threads
overlaps with the forward pass. ``runtime/engine_main.py`` starts the process and runs this class.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

import msgspec
import torch
import zmq

from enginekit.core.engine_core import EngineCore, ShutdownState
from enginekit.core.threads import ThreadGovernor
from enginekit.core.validation import sampling_params_error
from enginekit.model.runner import ExecutorError
from enginekit.wire.messages import (
    AbortRequest,
    EngineDead,
    EngineProcArgs,
    EngineRequest,
    ExecutorFailed,
    InvalidRequest,
    PhaseReport,
    ReadyMessage,
    RequestError,
    ShutdownRequest,
    last_words_line,
)
from enginekit.wire.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("enginekit.engine_process")

READY_TIMEOUT_S = 10.0
GIL_YIELD_S = 0.001
SIGNAL_CHECK_S = 0.1  # how long an idle loop may sleep through a signal delivered to another thread
COPY_MAX_BYTES = 64 * 1024  # output messages up to this size are copied into zmq, larger ones sent zero-copy
_STOP = object()  # tells the output thread to finish


class EngineCoreProc(EngineCore):
    def __init__(self, args: EngineProcArgs) -> None:
        self.args = args
        self.input_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.aborts_queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.output_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.max_output_queue_depth = 0  # deepest the output queue has been (back-pressure check)
        self._debug_kill_io: str | None = None
        self.closing = False  # set when the process tears down: IO threads then die quietly
        self.shutdown_state = ShutdownState.RUNNING  # read by an IO thread that dies before the core is built
        self._startup_reports: queue.SimpleQueue[PhaseReport | ReadyMessage | None] = queue.SimpleQueue()
        self._startup_flushed = threading.Event()
        self._input_thread_ready = threading.Event()
        self._zmq = zmq.Context(io_threads=1)
        self.input_thread = threading.Thread(
            target=self._run_io, args=(self._input_loop,), name="enginekit-input", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._run_io, args=(self._output_loop,), name="enginekit-output", daemon=True
        )
        self.input_thread.start()
        self.output_thread.start()
        self.report_phase("model load")
        governor = (
            ThreadGovernor.for_this_process(torch.get_num_threads()) if args.config.adaptive_threads else None
        )
        if governor is not None:
            governor.poll()  # loading the model is work: the first step may run on what this window saw
        try:
            super().__init__(args.config, engine_index=args.engine_index)
        except BaseException:
            # NOTE: the phase reports must reach the front end before we exit: it names the failing phase.
            self._startup_reports.put_nowait(None)
            self._startup_flushed.wait(2.0)
            # Closing the socket only queues them: let the context deliver them (a slow machine may not even
            # have connected yet), or the process exits with its last reports unsent.
            self.close_io()
            terminate_context(self._zmq)
            raise
        # NOTE: tensor-parallel ranks keep a fixed share of the threads: one rank that ran fewer would hold the
        # others at every all_reduce.
        self.thread_governor = governor if self.device.type == "cpu" and self.executor is None else None
        if self.thread_governor is not None:
            self.thread_governor.pause()  # until the first request
        # a worker's death while idle fails the engine at the next loop iteration (one that died before the watch
        # could tell anyone, at the first)
        if self.executor is not None:
            self.executor.on_death = lambda reason: self.input_queue.put_nowait(ExecutorFailed(reason))
            self.executor.on_stuck = self._end_stuck
            reason = self.executor.death_reason()
            if reason is not None:
                self.input_queue.put_nowait(ExecutorFailed(reason))
        self.report_phase("handshake")
        try:
            self._wait_for_input_thread()
        except RuntimeError:
            self.close_io()
            terminate_context(self._zmq)
            raise
        # NOTE: the startup heap (model, tokenizer, modules) lives until exit: keep it out of GC scans.
        gc.collect()
        gc.freeze()
        self._startup_reports.put_nowait(self._ready_message())  # the input thread sends it

    def _wait_for_input_thread(self) -> None:
        """The input thread connects to the front end (and then sends the startup reports): fail the start at
        once if it died before, or if it has not connected within ``READY_TIMEOUT_S``."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._input_thread_ready.wait(0.1):
            if not self.input_thread.is_alive():
                raise RuntimeError("Input socket thread died during startup")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Input socket thread did not start within {READY_TIMEOUT_S} s")

    def report_phase(self, phase: str) -> None:
        """Tell the front end which startup phase we are in (it names it if startup fails)."""
        self._startup_reports.put_nowait(PhaseReport(phase))

    def _ready_message(self) -> ReadyMessage:
        return ReadyMessage(
            max_model_len=self.max_model_len,
            num_gpu_blocks=self.num_kv_blocks,
            kv_cache_size_tokens=self.kv_size.num_tokens,
            kv_cache_bytes=self.kv_size.num_bytes,
            block_size=self.config.block_size,
            pid=os.getpid(),
            device=str(self.device),
            engine_index=self.engine_index,
            model=msgspec.to_builtins(self.model_config),
        )

    # ---- the busy loop ------------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        while not self.is_done:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        if not self.has_work():
            if self.thread_governor is not None:
                self.thread_governor.pause()  # what others do while we wait says nothing of sharing the cores
            self.handle(self._wait_for_input())
        while True:
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self.handle(message)

    def _wait_for_input(self) -> Any:
        # NOTE: a signal sent to this process may be delivered to any of its threads (zmq's, torch's, the IO
        # threads); Python runs the handler on the main thread only once that thread runs bytecode again, and a
        # main thread blocked in an untimed get would sleep through a SIGTERM until the next message.
        while True:
            try:
                return self.input_queue.get(timeout=SIGNAL_CHECK_S)
            except queue.Empty:
                pass

    def _process_engine_step(self) -> None:
        while True:
            try:
                self.abort_requests(self.aborts_queue.get_nowait())
            except queue.Empty:
                break
        if self.output_queue.qsize() >= self.config.max_pending_outputs:
            self._wait_for_the_reader()
        if self.thread_governor is not None and self.has_requests():  # answers alone are no model work
            self.thread_governor.poll()
        try:
            outputs, ran_forward = self.step()
        except ExecutorError as error:
            # The executor's failure callback: the loop raises "Executor failed." when it reads this.
            self.input_queue.put_nowait(ExecutorFailed(str(error)))
            return
        if outputs is not None:
            self.output_queue.put_nowait(outputs)
            self.max_output_queue_depth = max(self.max_output_queue_depth, self.output_queue.qsize())
        if not ran_forward and self.scheduler.has_unfinished_requests():
            time.sleep(GIL_YIELD_S)  # NOTE: let the IO threads take the GIL

    def _wait_for_the_reader(self) -> None:
        """Back-pressure: the front end is not reading; stop producing until it does. Logged at debug level: the
        lines reach the front end through the process's output, which the stalled socket does not hold up."""
        logger.debug(
            "output queue full (%d batches unread): steps wait for the front end", self.output_queue.qsize()
        )
        while self.output_queue.qsize() >= self.config.max_pending_outputs:
            time.sleep(GIL_YIELD_S)
            if not self.is_running or not self.output_thread.is_alive():
                break
        logger.debug("steps resume (%d batches unread)", self.output_queue.qsize())

    @property
    def is_running(self) -> bool:
        return self.shutdown_state is ShutdownState.RUNNING

    def signal_shutdown(self, signum: int, frame: FrameType | None) -> None:
        # NOTE: runs on the main thread between bytecodes; SimpleQueue.put is safe to call re-entrantly.
        if self.shutdown_signal is None and self.is_running:
            self.shutdown_signal = signal.Signals(signum).name
        self.input_queue.put_nowait(ShutdownRequest(self.config.shutdown_timeout))

    def send_engine_dead(self, reason: str, signal_name: str | None = None) -> None:
        """Broadcast the engine's death and wait (bounded) for the output thread to send it; repeat it on stderr,
        where the front end looks should the message be lost (``wire.messages.last_words``)."""
        message = EngineDead(reason, self.engine_index, signal_name)
        print(last_words_line(message), file=sys.stderr, flush=True)
        self.output_queue.put_nowait(message)
        self.output_thread.join(timeout=5.0)

    def _end_stuck(self, reason: str) -> None:
        """The loop is stuck in a tensor-parallel step that cannot end (NCCL, whose collectives never raise on a
        dead peer, even once aborted): report the death as a step that raised would, and end the process."""
        # NOTE: runs on the executor's watch thread; the main thread, blocked in the step, never runs cleanup.
        self.send_engine_dead(f"RuntimeError: Executor failed. {reason}")
        if self.executor is not None:
            self.executor.kill_workers()
        sys.stderr.flush()
        os._exit(1)

    def close_io(self) -> None:
        """Flush pending outputs and stop the output thread; the input thread dies with the process."""
        if self.output_thread.is_alive():
            self.output_queue.put_nowait(_STOP)
            self.output_thread.join(timeout=5.0)

    # ---- debug utilities (tests reach them with engine.call_utility) --------------------------------
    def utility_debug_kill_io_thread(self, name: str) -> None:
        """Make the ``"input"`` or ``"output"`` IO thread raise at its next iteration (fault-injection hook).

        The output thread raises right after sending this call's answer; the input thread raises when the next
        message arrives (and drops it). Either way the engine process dies as it would from a real IO failure.
        """
        if name not in ("input", "output"):
            raise ValueError(f"name must be 'input' or 'output', got {name!r}")
        self._debug_kill_io = name

    def utility_debug_process(self) -> dict[str, Any]:
        """The engine process's environment, working directory and ``sys.path`` (a forked engine gets the
        front end's), its torch thread count and its tensor-parallel workers' pids."""
        return {
            "environ": dict(os.environ),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "torch_threads": torch.get_num_threads(),
            "max_torch_threads": (
                self.thread_governor.max_threads if self.thread_governor else torch.get_num_threads()
            ),
            "thread_changes": self.thread_governor.changes if self.thread_governor else 0,
            "tensor_parallel_workers": self.executor.worker_pids if self.executor is not None else [],
        }

    def utility_debug_output_queue(self) -> dict[str, int]:
        """Depth of the output queue now and at its deepest, and the bound the busy loop keeps it under."""
        return {
            "depth": self.output_queue.qsize(),
            "max_depth": self.max_output_queue_depth,
            "max_pending_outputs": self.config.max_pending_outputs,
        }

    # ---- IO threads ---------------------------------------------------------------------------------
    def _run_io(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception as error:
            if self.is_done or self.closing:
                return
            logger.exception("%s died", threading.current_thread().name)
            # An IO thread that dies after startup is an engine death, not something to ignore.
            self.input_queue.put_nowait(ExecutorFailed(f"{threading.current_thread().name} died: {error}"))

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self._zmq.socket(kind)
        socket.setsockopt(zmq.LINGER, 5000)
        if self.args.curve_server_public:
            socket.curve_serverkey = self.args.curve_server_public
            socket.curve_publickey = self.args.curve_client_public
            socket.curve_secretkey = self.args.curve_client_secret
        return socket

    def _input_loop(self) -> None:
        socket = self._socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.args.identity)
        try:
            socket.connect(self.args.input_address)
            self._input_thread_ready.set()
            if self._send_startup_reports(socket):
                self._serve_input(socket)
            else:  # startup failed: deliver the reports already sent, then stop
                socket.close(linger=1000)
                self._startup_flushed.set()
        finally:
            socket.close(linger=0)

    def _send_startup_reports(self, socket: zmq.Socket) -> bool:
        """Send phase reports until READY (True), or until startup failed (False)."""
        while True:
            report = self._startup_reports.get()
            if report is None:
                return False
            socket.send(msgspec.msgpack.encode(report))
            if isinstance(report, ReadyMessage):
                return True

    def _serve_input(self, socket: zmq.Socket) -> None:
        decoder = MsgpackDecoder(EngineRequest)
        while True:
            frames = socket.recv_multipart(copy=False)
            if self._debug_kill_io == "input":
                raise RuntimeError("input thread stopped by debug_kill_io_thread")
            message = _decode(decoder, frames)
            if message is None:
                continue
            if isinstance(message, AbortRequest):
                self.aborts_queue.put_nowait(message.request_ids)
            self.input_queue.put_nowait(message)

    def _output_loop(self) -> None:
        socket = self._socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, self.args.config.max_pending_outputs)
        try:
            socket.connect(self.args.output_address)
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
            if outputs is _STOP:
                return
            if isinstance(outputs, EngineDead):
                socket.send_multipart(encoder.encode(outputs), copy=True)
                return
            while in_flight and in_flight[0][0].done:
                buffer = in_flight.popleft()[2]
                if len(reuse) < max_reuse:
                    reuse.append(buffer)
            buffer = reuse.pop() if reuse else bytearray()
            frames = encoder.encode_into(outputs, buffer)
            if len(frames) == 1 and len(buffer) <= COPY_MAX_BYTES:
                # Small (a utility answer, a few requests' tokens): a copy costs less than tracking the send.
                socket.send(buffer, copy=True)
                reuse.append(buffer)
            else:
                tracker = socket.send_multipart(frames, copy=False, track=True)
                assert tracker is not None  # pyzmq returns one whenever track=True and copy=False
                # Buffers (and the tensors behind tensor frames) stay referenced until zmq has sent them.
                in_flight.append((tracker, frames, buffer))
            if self._debug_kill_io == "output":
                raise RuntimeError("output thread stopped by debug_kill_io_thread")


def _decode(decoder: MsgpackDecoder, frames: list[Any]) -> Any:
    """Decode one request; an ADD that cannot be decoded is refused under its id, anything else dropped."""
    try:
        return decoder.decode(frames)
    except Exception as error:  # msgspec.DecodeError, ValidationError, bad tensor frames...
        invalid = _invalid_add(frames, error)
        if invalid is None:
            logger.warning("dropped a malformed message: %s", error)
        return invalid


class _AddHeader(msgspec.Struct, tag="add", array_like=True):
    """The leading fields of an ``EngineCoreRequest``, each kept undecoded: what an ADD that failed to decode
    still tells (its id, and the sampling parameters that may say why)."""

    request_id: Any
    prompt_token_ids: Any = msgspec.UNSET
    sampling_params: Any = msgspec.UNSET


def _invalid_add(frames: list[Any], error: Exception) -> InvalidRequest | None:
    try:
        header = msgspec.msgpack.decode(frames[0], type=_AddHeader)
    except Exception:
        return None
    if not isinstance(header.request_id, str):
        return None
    cause = (
        sampling_params_error(header.sampling_params) if header.sampling_params is not msgspec.UNSET else None
    )
    if cause is None:
        cause = ValueError(f"malformed request: {error}")
    kind = "TypeError" if isinstance(cause, TypeError) else "ValueError"
    return InvalidRequest(header.request_id, RequestError(kind, str(cause)))


def terminate_context(context: zmq.Context, timeout: float = 5.0) -> None:
    """Let queued messages reach the front end before the process exits (bounded wait)."""
    closer = threading.Thread(target=context.term, name="enginekit-zmq-term", daemon=True)
    closer.start()
    closer.join(timeout=timeout)
