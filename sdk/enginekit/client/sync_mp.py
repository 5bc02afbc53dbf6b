"""SyncMPClient: a background thread receives outputs into a ``queue.Queue``; ``get_output`` blocks on it.

Needs no asyncio loop at all, so it works the same in scripts, threads and notebook cells.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from typing import Any

import zmq

from enginekit.client.mp import MPClient
from enginekit.config import EngineConfig
from enginekit.core.messages import EngineCoreOutputs, RequestType
from enginekit.errors import EngineDeadError

_DEAD = object()  # queued when the engine dies, so that a blocked get_output wakes up


class SyncMPClient(MPClient):
    mode = "mp"

    def __init__(self, config: EngineConfig) -> None:
        self.outputs_queue: queue.Queue[Any] = queue.Queue()
        self._futures: dict[int, concurrent.futures.Future[Any]] = {}
        self._wake_read, self._wake_write = os.pipe()
        super().__init__(config)
        self._output_thread = threading.Thread(
            target=self._receive_loop, name="enginekit-client-output", daemon=True
        )
        self._output_thread.start()

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        pidfd = self.process.pidfd
        if pidfd is not None:
            poller.register(pidfd, zmq.POLLIN)
        while not self._closed:
            events = dict(poller.poll(None if pidfd is not None else 200))
            if self._closed:
                return
            if events.get(self.output_socket):
                # Drain everything ready before looking at liveness: the last outputs come before death.
                while True:
                    try:
                        frames = self.output_socket.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle_frames(frames)
            elif not self.process.is_alive():
                self._mark_dead("the engine process died")
            if self._dead_error is not None:
                return

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        self.outputs_queue.put_nowait(outputs)

    def _resolve_utility(self, call_id: int, result: Any, error: BaseException | None) -> None:
        future = self._futures.pop(call_id, None)
        if future is None:
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _fail_waiters(self, error: BaseException) -> None:
        self.outputs_queue.put_nowait(_DEAD)
        futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        self._check_usable()
        try:
            item = (
                self.outputs_queue.get(timeout=timeout) if timeout != 0 else self.outputs_queue.get_nowait()
            )
        except queue.Empty:
            return None
        if item is _DEAD:
            self.outputs_queue.put_nowait(_DEAD)  # for any other waiter
            self._check_usable()
            raise EngineDeadError("the engine is gone")
        return item

    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        request = self._utility_request(method_name, args)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._futures[request.call_id] = future
        try:
            self._send(RequestType.UTILITY, request)
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        finally:
            self._futures.pop(request.call_id, None)

    def _stop_receiving(self) -> None:
        os.write(self._wake_write, b"x")
        if self._output_thread is not threading.current_thread():
            self._output_thread.join(timeout=5.0)

    def _close_resources(self, kill: bool = False) -> None:
        super()._close_resources(kill)
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_read = self._wake_write = -1
