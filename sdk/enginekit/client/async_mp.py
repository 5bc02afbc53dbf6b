"""AsyncMPClient: an asyncio task on the caller's loop receives outputs into an ``asyncio.Queue``.

The client binds to whichever loop is running when it is used: in a notebook that is the kernel's loop, so
the output task keeps running between cells. A new loop (a second ``asyncio.run``) rebinds it: the same zmq
socket is shadowed on the new loop, and outputs already received are carried over. The output task holds
only a weak reference to the client, so a dropped client can be collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any

import zmq
import zmq.asyncio

from enginekit.client.mp import MPClient
from enginekit.config import EngineConfig
from enginekit.core.messages import EngineCoreOutputs, RequestType
from enginekit.errors import EngineDeadError

_DEAD = object()


class AsyncMPClient(MPClient):
    mode = "async"

    def __init__(self, config: EngineConfig) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._futures: dict[int, asyncio.Future[Any]] = {}
        super().__init__(config)

    # ---- loop binding -------------------------------------------------------------------------------
    def _ensure_bound(self) -> asyncio.Queue[Any]:
        loop = asyncio.get_running_loop()
        if loop is self._loop and self._task is not None and not self._task.done():
            assert self._queue is not None
            return self._queue
        self._check_usable()
        leftover = []
        if self._queue is not None:
            while not self._queue.empty():
                leftover.append(self._queue.get_nowait())
        self._unbind()
        self._loop = loop
        self._queue = asyncio.Queue()
        for item in leftover:
            self._queue.put_nowait(item)
        socket = zmq.asyncio.Socket.shadow(self.output_socket.underlying)
        self._task = loop.create_task(
            _receive_outputs(weakref.ref(self), socket), name="enginekit-async-output"
        )
        pidfd = self.process.pidfd
        if pidfd is not None:
            loop.add_reader(pidfd, self._on_process_exit)
        return self._queue

    def _unbind(self) -> None:
        loop, task = self._loop, self._task
        self._task = None
        if loop is None or loop.is_closed():
            return
        if self.process.pidfd is not None:
            with contextlib.suppress(Exception):
                if loop is _running_loop():
                    loop.remove_reader(self.process.pidfd)
                else:
                    loop.call_soon_threadsafe(loop.remove_reader, self.process.pidfd)
        if task is not None and not task.done():
            if loop is _running_loop():
                task.cancel()
            else:
                loop.call_soon_threadsafe(task.cancel)

    def _on_process_exit(self) -> None:
        if self._loop is not None and self.process.pidfd is not None:
            self._loop.remove_reader(self.process.pidfd)
        # Outputs sent just before the exit may still be in the socket: let the task drain them first.
        assert self._loop is not None
        self._loop.call_later(0.05, self._mark_dead, "the engine process died")

    # ---- MPClient hooks (run on the bound loop) ---------------------------------------------------
    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        assert self._queue is not None
        self._queue.put_nowait(outputs)

    def _resolve_utility(self, call_id: int, result: Any, error: BaseException | None) -> None:
        future = self._futures.pop(call_id, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _fail_waiters(self, error: BaseException) -> None:
        if self._queue is not None:
            self._queue.put_nowait(_DEAD)
        futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done() and not future.get_loop().is_closed():
                future.get_loop().call_soon_threadsafe(_fail, future, error)

    # ---- API ------------------------------------------------------------------------------------------
    async def add_request_async(self, request: Any) -> None:
        self._ensure_bound()
        self._send(RequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._send(RequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check_usable()
        queue = self._ensure_bound()
        item = await queue.get()
        if item is _DEAD:
            queue.put_nowait(_DEAD)
            self._check_usable()
            raise EngineDeadError("the engine is gone")
        return item

    async def call_utility_async(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        self._ensure_bound()
        request = self._utility_request(method_name, args)
        future = asyncio.get_running_loop().create_future()
        self._futures[request.call_id] = future
        try:
            self._send(RequestType.UTILITY, request)
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s") from None
        finally:
            self._futures.pop(request.call_id, None)

    # Sync methods of the interface: the facade routes async-mode sync calls through the loop.
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        raise RuntimeError("AsyncMPClient is driven from an asyncio loop; use get_output_async")

    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        raise RuntimeError("AsyncMPClient is driven from an asyncio loop; use call_utility_async")

    def _stop_receiving(self) -> None:
        self._unbind()


async def _receive_outputs(client_ref: weakref.ref[AsyncMPClient], socket: zmq.asyncio.Socket) -> None:
    # NOTE: only a weak reference between awaits, so an abandoned client is collected and the task ends.
    while True:
        frames = await socket.recv_multipart(copy=False)
        client = client_ref()
        if client is None or client._closed:
            return
        client._handle_frames(frames)
        if client._dead_error is not None:
            return
        del client


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
