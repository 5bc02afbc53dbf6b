"""Receivers: who reads the engine's output socket for an ``MPClient``, and how callers wait for a batch.

- ``ThreadReceiver`` (mode ``"mp"``): a thread polls the socket, the engine's pidfd and a wake-up pipe, and
  queues batches. A blocking caller waits on a condition; an async caller is woken from the thread with
  ``call_soon_threadsafe``. Needs no asyncio loop at all.
- ``LoopReceiver`` (mode ``"async"``): a reader on the caller's running loop (``add_reader`` on the socket's
  edge-triggered fd; it drains the socket each time) queues batches and sets an ``asyncio.Event``; the reader
  holds the receiver only weakly. A new loop (a second ``asyncio.run``) rebinds it. A blocking caller reads
  the socket itself: the loop cannot be running its reader meanwhile (a blocking call holds the loop's
  thread), unless the loop runs in another thread — that is refused with a clear error instead of two readers
  racing for one socket.

Waiting and taking are separate (``wait``/``wait_async``, then ``pop``), so the facade takes a batch and
routes it in one short critical section, and batches are applied in the order they arrived. Every message is
handed to ``handle_frames``, which answers utility calls and returns the step outputs to queue, if any; both
receivers call ``on_exit`` when the engine process is gone.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from enginekit.interrupts import deferred_interrupts
from enginekit.wire.messages import EngineCoreOutputs

HandleFrames = Callable[[list[Any]], "EngineCoreOutputs | None"]


class WatchedProcess(Protocol):
    """What a receiver watches of an engine: a local ``EngineProcess`` or a ``RemoteRank`` (whose ``pidfd``
    is a pipe that turns readable when its connection drops)."""

    @property
    def pidfd(self) -> int | None: ...

    def is_alive(self) -> bool: ...


_READ_SLICE_S = 0.05


class _Receiver:
    """What both receivers hold: the output socket, the processes whose exit they watch, what to do with a
    message and with an exit, and the batches received and not yet taken."""

    def __init__(
        self,
        socket: zmq.Socket,
        processes: Sequence[WatchedProcess],
        handle_frames: HandleFrames,
        on_exit: Callable[[WatchedProcess], None],
    ) -> None:
        self._socket = socket
        self._processes = processes
        self._handle_frames = handle_frames
        self._on_exit = on_exit
        self._batches: collections.deque[EngineCoreOutputs] = collections.deque()
        self.dead = False
        self._closed = False

    def pop(self) -> EngineCoreOutputs | None:
        try:
            return self._batches.popleft()
        except IndexError:
            return None


class ThreadReceiver(_Receiver):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._arrived = threading.Condition()
        self._waiters: list[asyncio.Future[None]] = []
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="enginekit-client-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        watched = [process for process in self._processes if process.pidfd is not None]
        for process in watched:
            poller.register(process.pidfd, zmq.POLLIN)
        while not self._closed:
            events = dict(poller.poll(None if len(watched) == len(self._processes) else 200))
            if self._closed:
                return
            if events.get(self._socket):
                # Drain everything ready before looking at liveness: the last outputs come before death.
                while not self._closed:
                    try:
                        frames = self._socket.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        if self._closed:
                            return  # shut down while this thread was busy: the socket is gone
                        raise
                    batch = self._handle_frames(frames)
                    if batch is not None:
                        self._queue(batch)
            else:
                dead = next((process for process in self._processes if not process.is_alive()), None)
                if dead is not None:
                    self._on_exit(dead)
                    return
            if self.dead:
                return

    def _queue(self, batch: EngineCoreOutputs | None) -> None:
        with self._arrived:
            if batch is not None:
                self._batches.append(batch)
            self._arrived.notify_all()
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            loop = waiter.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, waiter)

    def wait(self, timeout: float | None) -> None:
        with self._arrived:
            self._arrived.wait_for(lambda: self._batches or self.dead, timeout)

    async def wait_async(self) -> None:
        with self._arrived:
            if self._batches or self.dead:
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
        await waiter

    def wait_future(self, future: concurrent.futures.Future[Any], timeout: float | None) -> Any:
        """Block until ``future`` is done (the thread answers it); its result, ``TimeoutError`` past ``timeout``."""
        return future.result(timeout)

    def mark_dead(self) -> None:
        self.dead = True
        self._queue(None)

    def close(self) -> None:
        self._closed = True
        self.mark_dead()
        os.write(self._wake_write, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


class LoopReceiver(_Receiver):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._arrived: asyncio.Event | None = None  # set on the bound loop when a batch is queued
        self._reading = False  # a reader is on the bound loop
        self._watched_fds: list[int] = []  # what the bound loop has a reader on: the socket's and the pidfd
        self._read_lock = threading.Lock()  # one blocking reader at a time

    # ---- the async side -----------------------------------------------------------------------------
    async def wait_async(self) -> None:
        arrived = self.bind()
        while not (self._batches or self.dead):
            arrived.clear()
            await arrived.wait()

    def bind(self) -> asyncio.Event:
        """Have a reader on the running loop (a new loop rebinds); returns its arrival event."""
        loop = asyncio.get_running_loop()
        if loop is self._loop and self._reading:
            assert self._arrived is not None
            return self._arrived
        self._unbind()
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._arrived = asyncio.Event()
        if self.dead:
            return self._arrived
        # NOTE: a plain reader, not a zmq.asyncio socket: one callback per wake-up instead of a poll future
        # and a task switch (which made a utility round trip several times as long). The fd is edge-triggered: each callback
        # drains the socket until it would block, and messages queued before the reader existed are read by
        # the first, scheduled now.
        fd = self._socket.FD
        receiver: weakref.ref[LoopReceiver] = weakref.ref(self)
        loop.add_reader(fd, _on_readable, receiver, loop, fd)
        loop.call_soon(_on_readable, receiver, loop, fd)
        self._reading = True
        self._watched_fds = [fd]
        for process in self._processes:
            if process.pidfd is not None:
                loop.add_reader(process.pidfd, self._on_pidfd, process, process.pidfd)
                self._watched_fds.append(process.pidfd)
        return self._arrived

    def _on_pidfd(self, process: WatchedProcess, pidfd: int) -> None:
        assert self._loop is not None
        self._loop.remove_reader(pidfd)  # the fd watched: a stopped RemoteRank has set its pidfd to None
        # Outputs sent just before the exit may still be in the socket: let the task drain them first. The
        # death is then described (its exit status may take a launcher round trip) off the loop.
        self._loop.call_later(0.05, self._exit_off_loop, process)

    def _exit_off_loop(self, process: WatchedProcess) -> None:
        threading.Thread(
            target=self._on_exit, args=(process,), name="enginekit-engine-exit", daemon=True
        ).start()

    def read_ready(self) -> None:
        """Handle every message waiting on the socket (the loop's reader calls this when it is readable)."""
        while not self.dead:
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            batch = self._handle_frames(frames)
            if batch is not None:
                self._batches.append(batch)
                self._wake()

    # ---- the blocking side --------------------------------------------------------------------------
    def wait(self, timeout: float | None) -> None:
        """Read the socket on the calling thread until a batch is queued, the engine is gone, or ``timeout``."""
        self._check_not_driven_elsewhere()
        deadline = None if timeout is None else time.monotonic() + timeout
        # NOTE: pyzmq runs signal handlers inside recv (after part of a message: lost) and in a frame's
        # destructor (dropped there): a Ctrl-C is raised between messages instead.
        with deferred_interrupts() as interrupted:
            while not (self._batches or self.dead or interrupted):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                slice_s = _READ_SLICE_S if remaining is None else min(_READ_SLICE_S, remaining)
                self._read_slice(slice_s)

    def wait_future(self, future: concurrent.futures.Future[Any], timeout: float | None) -> Any:
        """Block until ``future`` is done, reading the socket meanwhile; its result (``TimeoutError`` past
        ``timeout``). Batches read on the way stay queued."""
        self._check_not_driven_elsewhere()
        deadline = None if timeout is None else time.monotonic() + timeout
        with deferred_interrupts() as interrupted:
            while not (future.done() or interrupted):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise concurrent.futures.TimeoutError
                self._read_slice(_READ_SLICE_S if remaining is None else min(_READ_SLICE_S, remaining))
        return future.result()

    def _read_slice(self, timeout: float) -> None:
        if not self._read_lock.acquire(timeout=timeout):
            return  # another thread is reading; it queues what it reads
        try:
            if self.dead:
                return
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            for process in self._processes:
                if process.pidfd is not None:
                    poller.register(process.pidfd, zmq.POLLIN)
            events = dict(poller.poll(int(timeout * 1000)))
            if events.get(self._socket):
                self.read_ready()
                return
            dead = next((p for p in self._processes if p.pidfd is not None and events.get(p.pidfd)), None)
            if dead is not None:
                self._on_exit(dead)
        finally:
            self._read_lock.release()

    def _check_not_driven_elsewhere(self) -> None:
        loop = self._loop
        driven = loop is not None and not loop.is_closed() and loop.is_running()
        if driven and self._loop_thread != threading.get_ident():
            raise RuntimeError(
                "this engine (mode='async') is being driven by an asyncio loop running in another thread; "
                "call it from that thread (await engine.agenerate(...)), or use mode='mp' to call it "
                "from several threads"
            )

    # ---- death and teardown -------------------------------------------------------------------------
    def mark_dead(self) -> None:
        self.dead = True
        self._wake()

    def _wake(self) -> None:
        loop, arrived = self._loop, self._arrived
        if arrived is None or loop is None or loop.is_closed():
            return
        if loop.is_running() and self._loop_thread != threading.get_ident():
            loop.call_soon_threadsafe(arrived.set)
        else:
            arrived.set()

    def close(self) -> None:
        self._closed = True
        self.mark_dead()
        self._unbind()

    def _unbind(self) -> None:
        loop, fds = self._loop, self._watched_fds
        self._reading, self._watched_fds = False, []
        if loop is None or loop.is_closed():
            return
        # NOTE: a reader left on a loop that keeps running (a notebook kernel's) outlives its fd: once the
        # number is reused (the next engine's socket or pidfd), the loop keeps the stale entry and never
        # watches the new fd, so that engine's outputs never arrive. Remove them by number.
        if loop.is_running() and self._loop_thread != threading.get_ident():
            loop.call_soon_threadsafe(_release, loop, fds)
        else:
            _release(loop, fds)


def _on_readable(receiver_ref: weakref.ref[LoopReceiver], loop: asyncio.AbstractEventLoop, fd: int) -> None:
    # NOTE: the reader holds the receiver weakly, so an abandoned client is collected; its reader then goes.
    receiver = receiver_ref()
    if receiver is None:
        loop.remove_reader(fd)
    elif not receiver._closed and receiver._loop is loop:  # else unbound: _unbind removes this reader
        receiver.read_ready()
        if receiver.dead:
            loop.remove_reader(fd)


def _release(loop: asyncio.AbstractEventLoop, fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
