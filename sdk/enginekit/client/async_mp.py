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
        self._watched_fds: list[int] = []  # what the bound loop has a reader on: the socket's and the pidfd
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
        self._watched_fds = [self.output_socket.FD]  # the shadow adds its reader on this fd
        pidfd = self.process.pidfd
        if pidfd is not None:
            loop.add_reader(pidfd, self._on_process_exit)
            self._watched_fds.append(pidfd)
        return self._queue

    def _unbind(self) -> None:
        loop, task, fds = self._loop, self._task, self._watched_fds
        self._task, self._watched_fds = None, []
        if loop is None or loop.is_closed():
            return
        # NOTE: a reader left on a loop that keeps running (a notebook kernel's) outlives its fd: once the
        # number is reused (the next engine's socket or pidfd), the loop keeps the stale entry and never
        # watches the new fd, so that engine's outputs never arrive. Remove them by number.
        if loop.is_running() and loop is not _running_loop():
            loop.call_soon_threadsafe(_release, loop, task, fds)
        else:
            _release(loop, task, fds)

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
    # The task only *waits* for readability; messages are read synchronously after that. An awaited recv that
    # is cancelled (asyncio.run ending, a loop switch) can lose the message it had already taken off the
    # socket; a cancelled poll loses nothing.
    while True:
        await socket.poll(flags=zmq.POLLIN)
        client = client_ref()
        if client is None or client._closed:
            return
        while client._dead_error is None:
            try:
                frames = client.output_socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            client._handle_frames(frames)
        if client._dead_error is not None:
            return
        del client


def _release(loop: asyncio.AbstractEventLoop, task: asyncio.Task[None] | None, fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
    if task is not None and not task.done():
        task.cancel()


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
