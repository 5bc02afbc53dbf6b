"""The receivers report an engine's exit only after the messages it sent before it: its ``EngineDead`` first.

An engine process sends ``EngineDead`` last and then exits; the front end may see the exit (its pidfd) before zmq's
IO thread has queued that message. Here a real process on the front end's real output socket plays the engine,
and the test fixes the order: the process is watched through a pipe the test makes readable first (as a remote
rank's "pidfd" is), and it sends its last message and exits only when the receiver looks at it (``is_alive``),
so the message is at best in flight when the receiver knows of the exit.
"""

import asyncio
import os
import subprocess
import sys

import pytest

from enginekit.client import receiver as receiver_module
from enginekit.client.receiver import LoopReceiver, ThreadReceiver
from enginekit.client.sockets import EngineSockets
from enginekit.config import EngineConfig
from enginekit.runtime.engine_process import readable
from enginekit.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineDead, EngineOutput
from enginekit.wire.serial import MsgpackDecoder, MsgpackEncoder

DEADLINE_S = 30.0  # a hang guard only: every wait ends on the event it waits for
LAST_WORDS = "RuntimeError: Executor failed. injected executor failure"

# An engine process's output side, with pyzmq alone: it connects and sends a batch; on "words" it sends its
# EngineDead last and exits once zmq has sent it, as engine_main does; on "stay" it keeps its connection open.
ENGINE = """
import os, sys, zmq
address, batch, last_words = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
context = zmq.Context()
push = context.socket(zmq.PUSH)
push.connect(address)
push.send(batch)
if sys.stdin.readline().strip() == "stay":
    sys.stdin.readline()
    os._exit(0)
push.send(last_words)
push.close(linger=5000)
context.term()
os._exit(1)
"""


def encoded(message) -> str:
    (frame,) = MsgpackEncoder().encode(message)
    return bytes(frame).hex()


class EngineAtItsEnd:
    """A real process on the output socket, watched through a pipe: ``gone()`` makes the pipe readable, and
    the receiver's first look (``is_alive``) then ends the process: it sends its ``EngineDead`` and exits
    (``"words"``), is killed (``"kill"``), or stays connected, its connection never ending (``"stay"``)."""

    def __init__(self, address: str, end: str) -> None:
        batch = EngineCoreOutputs(outputs=[EngineCoreOutput("first", [7])])
        self._process = subprocess.Popen(
            [sys.executable, "-c", ENGINE, address, encoded(batch), encoded(EngineDead(LAST_WORDS))],
            stdin=subprocess.PIPE,
        )
        self._end = end
        self._gone_read, self._gone_write = os.pipe()
        self.pidfd: int | None = self._gone_read
        self.ended = False

    def gone(self) -> None:
        os.write(self._gone_write, b"x")

    def is_alive(self) -> bool:
        if not self.ended and readable(self._gone_read, 0):
            self.ended = True
            if self._end == "kill":
                self._process.kill()
            else:
                self._tell(self._end)
            if self._end != "stay":
                self._process.wait(DEADLINE_S)
        return not self.ended

    def _tell(self, line: str) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(line.encode() + b"\n")
        self._process.stdin.flush()

    def close(self) -> None:
        self._process.kill()
        self._process.wait(DEADLINE_S)
        assert self._process.stdin is not None
        self._process.stdin.close()
        os.close(self._gone_read)
        os.close(self._gone_write)


class FrontEnd:
    """What a client does with the receiver's messages and exit, recorded in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []
        self.receiver: ThreadReceiver | LoopReceiver | None = None
        self._decoder = MsgpackDecoder(EngineOutput)

    def handle_frames(self, frames) -> EngineCoreOutputs | None:
        message = self._decoder.decode(frames)
        if isinstance(message, EngineDead):
            self.seen.append(("last words", message.reason))
            return None
        return message

    def on_exit(self, process) -> None:
        self.seen.append(("exit", process))
        assert self.receiver is not None
        self.receiver.mark_dead()


def run_to_the_end(
    kind: str, end: str, *, sender: bool = False
) -> tuple[list[tuple[str, object]], EngineAtItsEnd]:
    """Receive the engine's first batch, make it gone, and wait (as a caller of ``kind``; with ``sender``, as a
    send that found the engine unreachable) until the receiver reports the engine dead; what the front end saw,
    in order, and the engine (``ended`` once the receiver looked at it)."""
    sockets = EngineSockets(EngineConfig())
    engine = EngineAtItsEnd(sockets.output_address, end)
    front = FrontEnd()
    receiver_type = ThreadReceiver if kind == "mp" else LoopReceiver
    receiver = receiver_type(
        sockets.output, sockets.output_hang_ups, [engine], front.handle_frames, front.on_exit
    )
    front.receiver = receiver
    try:
        if kind == "async":

            async def receive() -> None:
                await asyncio.wait_for(receiver.wait_async(), DEADLINE_S)
                assert receiver.pop() is not None, "the first batch never came"
                engine.gone()
                if sender:  # a send on the loop's thread: it blocks the loop
                    receiver.wait_reported(DEADLINE_S)
                else:
                    await asyncio.wait_for(receiver.wait_async(), DEADLINE_S)

            asyncio.run(receive())
        else:
            receiver.wait(DEADLINE_S)
            assert receiver.pop() is not None, "the first batch never came"
            engine.gone()
            if sender:
                receiver.wait_reported(DEADLINE_S)
            else:
                receiver.wait(DEADLINE_S)
        return front.seen, engine
    finally:
        receiver.close()
        engine.close()
        sockets.close()


KINDS = ["mp", "async", "async, blocking call"]


@pytest.fixture
def no_guard(monkeypatch):
    """Only the connection's hang-up may end an exit's wait: the guard is far past every deadline here."""
    monkeypatch.setattr(receiver_module, "EXIT_DRAIN_S", 10 * DEADLINE_S)


@pytest.mark.parametrize("kind", KINDS)
def test_an_exit_seen_before_the_last_message_is_reported_after_it(kind, no_guard):
    seen, engine = run_to_the_end(kind, "words")
    assert seen == [("last words", LAST_WORDS), ("exit", engine)]
    assert engine.ended


@pytest.mark.parametrize("kind", KINDS)
def test_a_send_that_finds_the_engine_gone_waits_for_the_report_with_its_last_words(kind, no_guard):
    # MPClient's send path: the death must not be named before the receiver read the engine's EngineDead
    seen, engine = run_to_the_end(kind, "words", sender=True)
    assert seen == [("last words", LAST_WORDS), ("exit", engine)]
    assert engine.ended


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_engine_is_reported_at_its_hang_up(kind, no_guard):
    seen, engine = run_to_the_end(kind, "kill")
    assert seen == [("exit", engine)]
    assert engine.ended


@pytest.mark.parametrize("kind", KINDS)
def test_an_exit_whose_connection_never_ends_is_reported_after_the_guard(kind, monkeypatch):
    # a remote rank's host gone silent: its watch says it is gone, its output connection shows nothing
    monkeypatch.setattr(receiver_module, "EXIT_DRAIN_S", 0.5)
    seen, engine = run_to_the_end(kind, "stay")
    assert seen == [("exit", engine)]
    assert engine.ended
