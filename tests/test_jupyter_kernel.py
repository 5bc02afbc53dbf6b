"""The engine in a real Jupyter kernel (jupyter_client): interrupt a cell, restart the kernel, kill it.

Jupyter interrupts a kernel by sending SIGINT to the kernel's whole process group; the engine process runs
in its own session, so only the cell is interrupted. When the kernel goes away (restart, SIGKILL) the engine
process and the launcher see EOF on their parent-death pipe and exit within seconds.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from jupyter_client import KernelManager

import process_support
from notebook_support import default_kernel_runs_this_python, write_private_kernelspec

CELL_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = process_support.HANG_GUARD_S  # "within seconds": a bounded wait, not a speed assertion

SETUP = """
import os, threading, time
from enginekit import Engine, SamplingParams

def when_generating(engine, action):
    def watch():
        while not any(s.version for s in list(engine._router.processor.states.values())):
            time.sleep(0.002)
        action()
    threading.Thread(target=watch, daemon=True).start()

LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0)
"""


def wait_gone(pids: list[int], timeout: float = GONE_TIMEOUT_S) -> list[int]:
    return process_support.wait_gone(pids, timeout)


@dataclass
class CellResult:
    status: str
    ename: str | None
    stdout: str


class Kernel:
    """A kernel on this interpreter, driven by a blocking client."""

    def __init__(self, cwd: Path) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=CELL_TIMEOUT_S)

    def run(self, code: str, on_output: Callable[[str], None] | None = None) -> CellResult:
        """Execute one cell; ``on_output`` sees every stream text (threads' output included)."""
        msg_id = self.client.execute(code)
        stdout, ename = [], None
        deadline = time.monotonic() + CELL_TIMEOUT_S
        while True:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"cell did not finish within {CELL_TIMEOUT_S}s:\n{code}") from None
            kind, content = message["msg_type"], message["content"]
            if kind == "stream" and on_output is not None:
                on_output(content["text"])
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if kind == "stream":
                stdout.append(content["text"])
            elif kind == "error":
                ename = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.client.get_shell_msg(timeout=CELL_TIMEOUT_S)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=CELL_TIMEOUT_S)
        return CellResult(reply["content"]["status"], ename, "".join(stdout))

    def check(self, code: str) -> str:
        result = self.run(code)
        assert result.status == "ok", f"{result.ename}\n{result.stdout}\n{code}"
        return result.stdout

    def value(self, expression: str) -> str:
        return self.check(f"print({expression})").strip()

    @property
    def pid(self) -> int:
        return int(self.value("__import__('os').getpid()"))

    def descendants(self) -> list[int]:
        return [process.pid for process in psutil.Process(self.pid).children(recursive=True)]

    def close(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=False)
        self.manager.cleanup_resources()


@pytest.fixture(scope="module")
def kernel_environment(tmp_path_factory) -> Iterator[Path]:
    """A folder to run kernels in, with a ``python3`` kernelspec that runs this interpreter."""
    folder = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as patch:
        if not default_kernel_runs_this_python():
            write_private_kernelspec(folder / "jupyter")
            patch.setenv(
                "JUPYTER_PATH", os.pathsep.join([str(folder / "jupyter"), os.environ.get("JUPYTER_PATH", "")])
            )
        yield folder


@pytest.fixture
def make_kernel(kernel_environment) -> Iterator[Callable[[], Kernel]]:
    kernels: list[Kernel] = []

    def make() -> Kernel:
        kernels.append(Kernel(kernel_environment))
        kernels[-1].check(SETUP)
        return kernels[-1]

    yield make
    for kernel in kernels:
        kernel.close()


@pytest.fixture(scope="module")
def kernel_with_engines(kernel_environment) -> Iterator[Kernel]:
    kernel = Kernel(kernel_environment)
    try:
        kernel.check(SETUP)
        kernel.check(
            'engines = {mode: Engine("builtin", mode=mode, num_kv_blocks=64) for mode in ("inproc", "mp", "async")}'
        )
        yield kernel
        kernel.check("for engine in engines.values(): engine.shutdown()")
    finally:
        kernel.close()


CELLS = {
    "generate": "when_generating(engine, lambda: print('generating', flush=True))\n"
    "engine.generate(['interrupt me', 'and me'], LONG)",
    "stream": "for chunk, _ in enumerate(engine.stream('interrupt me', LONG)):\n"
    "    if chunk == 0: print('generating', flush=True)",
    "agenerate": "when_generating(engine, lambda: print('generating', flush=True))\n"
    "await engine.agenerate('interrupt me', LONG)",
}


@pytest.mark.parametrize(
    ("mode", "call"),
    [
        ("mp", "generate"),
        ("mp", "stream"),
        ("async", "generate"),
        ("async", "stream"),
        ("async", "agenerate"),
        ("inproc", "generate"),
    ],
)
def test_interrupt_mid_generation_aborts_and_the_next_cell_generates(kernel_with_engines, mode, call):
    kernel = kernel_with_engines
    kernel.check(f"engine = engines[{mode!r}]; pid = engine.engine_pid")
    interrupted = []

    def interrupt(text: str) -> None:
        if "generating" in text and not interrupted:
            interrupted.append(True)
            kernel.manager.interrupt_kernel()  # SIGINT to the kernel's process group

    result = kernel.run(CELLS[call], on_output=interrupt)
    assert interrupted and result.status == "error"
    # ipykernel cancels a cell that awaits: the abort runs in the cancelled coroutine.
    assert result.ename == ("CancelledError" if call == "agenerate" else "KeyboardInterrupt")
    assert kernel.value("engine.engine_pid == pid and engine.is_running") == "True"
    assert kernel.value("engine.call_utility('get_request_ids')") == "[]"
    assert kernel.value("len(engine.generate('next', SHORT)[0].outputs[0].token_ids)") == "4"


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_interrupting_a_cell_that_awaits_agenerate_aborts_its_request_at_once(make_kernel, mode):
    # ipykernel cancels an awaiting cell from its SIGINT handler, which runs only when the kernel's loop wakes
    # up; agenerate hears nothing until its request ends, so without a periodic wake-up the whole generation
    # ran first. The request must end long before its max_tokens.
    kernel = make_kernel()
    kernel.check(
        f"engine = Engine('builtin', mode={mode!r}, num_kv_blocks=300, num_threads=1)\n"
        "VERY_LONG = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)"
    )
    interrupted = []

    def interrupt(text: str) -> None:
        if "generating" in text and not interrupted:
            interrupted.append(True)
            kernel.manager.interrupt_kernel()

    cell = (
        "when_generating(engine, lambda: print('generating', flush=True))\n"
        "await engine.agenerate('interrupt me', VERY_LONG)"
    )
    result = kernel.run(cell, on_output=interrupt)
    assert interrupted and result.ename == "CancelledError"
    assert kernel.value("engine.call_utility('get_request_ids')") == "[]"
    assert int(kernel.value("engine.get_stats()['num_generated_tokens']")) < 4000
    kernel.check("engine.shutdown()")


def test_interrupts_at_any_moment_never_wedge_the_async_engine(kernel_with_engines):
    # A sync call in "async" mode runs the kernel's loop: an interrupt must not land inside one of its
    # callbacks (a zmq socket's would stop reading that socket for good). Vary where the SIGINT lands.
    kernel = kernel_with_engines
    kernel.check(
        "import signal\n"
        "engine = engines['async']\n"
        "def interrupted(call, delay):\n"
        "    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))\n"
        "    timer.start()\n"
        "    try:\n"
        "        call()\n"
        "    except KeyboardInterrupt:\n"
        "        return True\n"
        "    finally:\n"
        "        timer.join()\n"
        "    return False"
    )
    for attempt in range(12):
        call = "engine.generate(['a', 'b'], LONG)" if attempt % 2 else "list(engine.stream('a', LONG))"
        output = kernel.check(
            f"print(interrupted(lambda: {call}, {0.02 + 0.03 * attempt:.2f}))\n"
            "print(engine.call_utility('get_request_ids', timeout=60))\n"
            "print(engine.generate('next', SHORT)[0].finished)"
        )
        assert output.split() == ["True", "[]", "True"], f"attempt {attempt}: {output}"


def test_kernel_restart_ends_the_old_engine_process(make_kernel):
    kernel = make_kernel()
    kernel.check("engine = Engine('builtin', mode='mp', num_kv_blocks=64)\nengine.generate('hello', SHORT)")
    old_pid, processes = kernel.pid, kernel.descendants()
    assert len(processes) == 2  # the launcher and the engine process
    kernel.manager.restart_kernel(now=False)  # what the notebook's "Restart kernel" does
    kernel.client.wait_for_ready(timeout=CELL_TIMEOUT_S)
    assert wait_gone(processes) == []
    assert kernel.pid != old_pid


def test_killed_kernel_ends_the_engine_process(make_kernel):
    kernel = make_kernel()
    kernel.check("engine = Engine('builtin', mode='mp', num_kv_blocks=64)\nengine.generate('hello', SHORT)")
    kernel_pid, processes = kernel.pid, kernel.descendants()
    assert len(processes) == 2
    os.kill(kernel_pid, signal.SIGKILL)
    assert wait_gone([kernel_pid, *processes]) == []
