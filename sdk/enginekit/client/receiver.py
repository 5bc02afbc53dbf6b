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
receivers call ``on_exit`` when the engine process is gone, once what it sent before it went is read.
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
from zmq.utils.monitor import parse_monitor_message

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
EXIT_DRAIN_S = 2.0  # the longest an exit waits for its connection's hang-up (a guard: see _Receiver)


class _Receiver:
    """What both receivers hold: the output socket, the processes whose exit they watch, what to do with a
    message and with an exit, and the batches received and not yet taken.

    An exit is reported only after the messages sent before it. An engine sends ``EngineDead`` (why it dies)
    last and then exits, and its pidfd turns readable only once the kernel has closed its end of the
    connection: what it sent is then in the output socket's queue, or in the kernel's buffer for zmq's IO
    thread, which reads it up to the end of the stream and only then reports the hang-up on ``hang_ups`` (the
    output socket's monitor of disconnects). So a receiver that sees an exit reads the socket until a hang-up
    is reported, reads what is left, and then reports the exit, unless an ``EngineDead`` ended the engine
    first. ``EXIT_DRAIN_S`` only guards against a connection whose end never shows (a remote rank's host gone
    silent).

    NOTE: over IPC, libzmq (4.3.5) drops what is left in the kernel's buffer when the peer hangs up while the
    socket's queue is at its high-water mark (``max_pending_outputs``): a reader that far behind when the
    engine exits never gets its ``EngineDead``, and the exit is all that is left to report (the client then
    finds the reason on the engine's stderr: ``wire.messages.last_words``). TCP is not affected (a peer's close
    does not raise the poll's hang-up there).
    """

    def __init__(
        self,
        socket: zmq.Socket,
        hang_ups: zmq.Socket,
        processes: Sequence[WatchedProcess],
        handle_frames: HandleFrames,
        on_exit: Callable[[WatchedProcess], None],
    ) -> None:
        self._socket = socket
        self._hang_ups = hang_ups
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

    def wake_waiters(self) -> None:
        """Have blocked ``wait`` calls check their ``until`` again (a loop's sync readers do so between reads)."""

    def _read_available(self) -> bool:
        """Handle every message ready on the socket; False once the receiver is closed."""
        raise NotImplementedError

    def _exited(self) -> WatchedProcess | None:
        """A watched process that is gone (a pidfd or the watch's timeout only says when to look)."""
        return next((process for process in self._processes if not process.is_alive()), None)

    def _report_exit(self, process: WatchedProcess) -> None:
        """Read what the engine sent before it exited, then report the exit (blocking, ``EXIT_DRAIN_S`` at
        most), unless its ``EngineDead`` ended the engine first."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._hang_ups, zmq.POLLIN)
        deadline = time.monotonic() + EXIT_DRAIN_S
        while not (self.dead or self._closed):
            hung_up = self._hung_up()
            self._read_available()
            remaining = deadline - time.monotonic()
            if hung_up or remaining <= 0:
                break
            # in slices: a shutdown from another thread is noticed between them
            poller.poll(max(1, int(min(remaining, _READ_SLICE_S) * 1000)))
        if not self.dead:
            self._on_exit(process)

    def _hung_up(self) -> bool:
        """Whether a connection to the output socket was reported closed (since the last call).

        NOTE: any connection's: with several ranks, the first one to die is the engine's death. Over TCP a
        stray peer that connected and left counts too, and an exit then reports what was read by that time."""
        hung_up = False
        while True:
            try:
                event = parse_monitor_message(self._hang_ups.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return hung_up
            hung_up = hung_up or event["event"] == zmq.EVENT_DISCONNECTED


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
                if not self._read_available():
                    return
            else:
                exited = self._exited()
                if exited is not None:
                    self._report_exit(exited)
                    return
            if self.dead:
                return

    def _read_available(self) -> bool:
        while not self._closed:
            try:
                frames = self._socket.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return True
            except zmq.ZMQError:
                if self._closed:
                    return False  # shut down while this thread was busy: the socket is gone
                raise
            batch = self._handle_frames(frames)
            if batch is not None:
                self._queue(batch)
        return False

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

    def wait(self, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        """Until a batch is queued, the engine is gone, ``until()`` holds (checked again at each
        ``wake_waiters``), or ``timeout``."""
        with self._arrived:
            self._arrived.wait_for(
                lambda: self._batches or self.dead or (until is not None and until()), timeout
            )

    def wake_waiters(self) -> None:
        with self._arrived:
            self._arrived.notify_all()

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

    def wait_reported(self, timeout: float) -> None:
        """Block until the thread has reported the engine's death, or ``timeout`` (at once on the thread)."""
        if threading.current_thread() is not self._thread:
            with self._arrived:
                self._arrived.wait_for(lambda: self.dead, timeout)

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
        # the bound loop's readers: the socket's, the pidfds', and the hang-ups' while an exit is read
        self._watched_fds: list[int] = []
        self._exiting: WatchedProcess | None = None  # seen gone; its exit is reported after its hang-up
        self._exit_guard: asyncio.TimerHandle | None = None  # reports it anyway after EXIT_DRAIN_S
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
                loop.add_reader(process.pidfd, self._on_pidfd, loop, process.pidfd)
                self._watched_fds.append(process.pidfd)
        return self._arrived

    def _on_pidfd(self, loop: asyncio.AbstractEventLoop, pidfd: int) -> None:
        loop.remove_reader(pidfd)  # the fd watched: a stopped RemoteRank has set its pidfd to None
        exited = self._exited()
        if exited is None or self.dead or self._exiting is not None:
            return
        # What it sent last may not be read yet: report the exit once its connection's hang-up is (see
        # _Receiver), reading the socket meanwhile, without blocking the loop.
        self._exiting = exited
        fd = self._hang_ups.FD
        loop.add_reader(fd, self._drain_exit, loop, False)
        self._watched_fds.append(fd)
        self._exit_guard = loop.call_later(EXIT_DRAIN_S, self._drain_exit, loop, True)
        self._drain_exit(loop, False)

    def _drain_exit(self, loop: asyncio.AbstractEventLoop, out_of_time: bool) -> None:
        exited = self._exiting
        if exited is None or self._closed or loop is not self._loop:
            return  # reported, closed or rebound (a new loop watches the pidfd afresh)
        hung_up = self._hung_up()
        self.read_ready()
        if not (self.dead or hung_up or out_of_time):
            return
        fd = self._hang_ups.FD
        _release(loop, [fd], self._exit_guard)
        self._watched_fds.remove(fd)
        self._exiting = self._exit_guard = None
        if not self.dead:
            # described off the loop: its exit status may take a launcher round trip
            self._exit_off_loop(exited)

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
    def wait(self, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        """Read the socket on the calling thread until a batch is queued, the engine is gone, ``until()`` holds
        (checked between reads: a thread waiting for the reader's lock does so at least every read slice), or
        ``timeout``."""
        self._check_not_driven_elsewhere()
        deadline = None if timeout is None else time.monotonic() + timeout
        # NOTE: pyzmq runs signal handlers inside recv (after part of a message: lost) and in a frame's
        # destructor (dropped there): a Ctrl-C is raised between messages instead.
        with deferred_interrupts() as interrupted:
            while not (self._batches or self.dead or interrupted or (until is not None and until())):
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

    def wait_reported(self, timeout: float) -> None:
        """Read the socket on this thread until the engine's death is reported, or ``timeout``; at once when a
        loop in another thread reads it (that loop reports it)."""
        if self._driven_elsewhere():
            return
        deadline = time.monotonic() + timeout
        with deferred_interrupts() as interrupted:
            while not (self.dead or interrupted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._read_slice(min(_READ_SLICE_S, remaining))

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
            exited = self._exited() if events else None  # a pidfd turned readable
            if exited is not None:
                self._report_exit(exited)
        finally:
            self._read_lock.release()

    def _read_available(self) -> bool:
        self.read_ready()
        return not self._closed

    def _driven_elsewhere(self) -> bool:
        loop = self._loop
        driven = loop is not None and not loop.is_closed() and loop.is_running()
        return driven and self._loop_thread != threading.get_ident()

    def _check_not_driven_elsewhere(self) -> None:
        if self._driven_elsewhere():
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
        loop, fds, guard = self._loop, self._watched_fds, self._exit_guard
        self._reading, self._watched_fds, self._exiting, self._exit_guard = False, [], None, None
        if loop is None or loop.is_closed():
            return
        # NOTE: a reader left on a loop that keeps running (a notebook kernel's) outlives its fd: once the
        # number is reused (the next engine's socket or pidfd), the loop keeps the stale entry and never
        # watches the new fd, so that engine's outputs never arrive. Remove them by number.
        if loop.is_running() and self._loop_thread != threading.get_ident():
            loop.call_soon_threadsafe(_release, loop, fds, guard)
        else:
            _release(loop, fds, guard)


def _on_readable(receiver_ref: weakref.ref[LoopReceiver], loop: asyncio.AbstractEventLoop, fd: int) -> None:
    # NOTE: the reader holds the receiver weakly, so an abandoned client is collected; its reader then goes.
    receiver = receiver_ref()
    if receiver is None:
        loop.remove_reader(fd)
    elif not receiver._closed and receiver._loop is loop:  # else unbound: _unbind removes this reader
        receiver.read_ready()
        if receiver.dead:
            loop.remove_reader(fd)


def _release(
    loop: asyncio.AbstractEventLoop, fds: list[int], guard: asyncio.TimerHandle | None = None
) -> None:
    for fd in fds:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
    if guard is not None:
        guard.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
