"""A background engine that cannot start fails with EngineStartupError and leaves no process behind.

Each failure is real: a missing folder, a damaged weights file, an engine process killed by a crash signal
while it loads, an engine process stuck in model load past ``startup_timeout``. The error names the phase,
says how the process ended and carries the tail of its error output; afterwards this process holds no more
children, threads or file descriptors than before (measured with ``enginekit.diagnostics``).
"""

import os
import signal
import threading
import time

import pytest

from enginekit import Engine, EngineStartupError
from enginekit.client import SyncMPClient
from enginekit.config import EngineConfig
from enginekit.core import engine_core_proc
from enginekit.core.engine_core_proc import EngineCoreProc
from enginekit.diagnostics import snapshot, wait_until_clean
from enginekit.runtime.engine_process import EngineProcess
from enginekit.runtime.launcher import Launcher, LauncherError
from enginekit.wire.messages import EngineProcArgs
from hf_checkpoints import build_checkpoint, corrupt_safetensors
from process_support import HANG_GUARD_S


@pytest.fixture
def baseline():
    """What this process holds before the failed start (the shared launcher already running)."""
    Launcher.shared()
    before = snapshot()
    yield before
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("checkpoint") / "llama")


def test_missing_model_folder_fails_before_any_process_starts(baseline, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(EngineProcess, "start", lambda process, args: started.append(process))
    missing = tmp_path / "no-such-model"
    with pytest.raises(
        EngineStartupError,
        match=r"model '.*no-such-model' is not a local folder or file, nor a Hugging Face repo id",
    ) as info:
        Engine(str(missing), mode="mp")
    assert info.value.phase == "model load"
    assert started == []


def test_model_folder_missing_in_the_engine_process(baseline, tmp_path):
    # The front end checks the folder first; this is the engine process's own check (the folder went away).
    missing = tmp_path / "gone"
    with pytest.raises(EngineStartupError, match=r"failed during model load: .* exited with code 1") as info:
        SyncMPClient(EngineConfig(model=str(missing)))
    assert info.value.phase == "model load"
    assert "gone' is not a local folder or file" in info.value.error_tail
    assert str(info.value).startswith("enginekit.errors.EngineStartupError: model '")  # the cause leads


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(baseline, checkpoint, tmp_path, damage):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in checkpoint.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    corrupt_safetensors(broken, damage)
    with pytest.raises(EngineStartupError, match=r"failed during model load: .* exited with code 1") as info:
        Engine(str(broken), mode="mp")
    assert info.value.phase == "model load"
    assert "cannot read weights file" in info.value.error_tail
    assert "model.safetensors" in str(info.value)


def test_engine_process_crashing_during_load(baseline, monkeypatch):
    started = []
    original_start = EngineProcess.start

    def start(process, args):
        original_start(process, args)
        started.append(process)

    monkeypatch.setattr(EngineProcess, "start", start)

    def crash_while_loading():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if started and started[0].phase == "model load":
                os.kill(started[0].pid, signal.SIGSEGV)  # as a native crash in the loader would
                return
            time.sleep(0.01)

    crasher = threading.Thread(target=crash_while_loading)
    crasher.start()
    with pytest.raises(EngineStartupError, match=r"failed during model load: .* killed by SIGSEGV") as info:
        Engine("builtin", mode="mp", debug_load_delay_s=60)
    crasher.join()
    assert info.value.phase == "model load"
    assert "Fatal Python error: Segmentation fault" in info.value.error_tail


def test_engine_process_hanging_past_the_startup_deadline(baseline):
    with pytest.raises(
        EngineStartupError,
        match=r"did not report READY within startup_timeout=1\.0s \(stuck in model load\); .* was killed",
    ) as info:
        Engine("builtin", mode="mp", debug_load_delay_s=60, startup_timeout=1.0)
    assert info.value.phase == "model load"


def test_launcher_that_cannot_fork(baseline, monkeypatch):
    def refuse(launcher, stdin_fd, output_fd):
        raise LauncherError("the engine launcher could not fork: b'error:out of memory'")

    monkeypatch.setattr(Launcher, "spawn", refuse)
    with pytest.raises(
        EngineStartupError, match=r"cannot start the engine process: .*could not fork"
    ) as info:
        Engine("builtin", mode="mp")
    assert info.value.phase == "spawn"


def _construct(args: EngineProcArgs) -> list[BaseException]:
    """Build an engine core process object here, on a thread; the exception it raised (a hang fails too)."""
    from enginekit.model.kernels.library import native_library

    # The test run's cache starts empty: building the native kernels here first keeps a compile (minutes on a
    # busy machine) out of the bound below, which is on the engine core's start.
    native_library()
    raised: list[BaseException] = []

    def build() -> None:
        try:
            EngineCoreProc(args)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(
        120.0
    )  # the checks below give up within seconds; this only keeps a hang from blocking the run
    assert not thread.is_alive(), "the engine core waited for its input thread forever"
    return raised


def test_an_input_thread_that_dies_during_startup_fails_it_at_once(monkeypatch):
    # The input socket thread connects to the front end before anything else; if it dies first (here: an
    # address zmq cannot parse), the engine process must fail its start rather than wait for it.
    monkeypatch.setattr(engine_core_proc, "READY_TIMEOUT_S", 3600.0)  # dead is dead: no deadline needed
    config = EngineConfig(model="builtin", num_kv_blocks=16)
    raised = _construct(EngineProcArgs(config, "no-such-transport://x", "no-such-transport://y"))
    assert [str(error) for error in raised] == ["Input socket thread died during startup"]


def test_an_input_thread_that_never_gets_ready_fails_startup_at_the_deadline(monkeypatch):
    stuck = threading.Event()
    monkeypatch.setattr(engine_core_proc, "READY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(engine_core_proc.EngineCoreProc, "_input_loop", lambda self: stuck.wait(120.0))
    config = EngineConfig(model="builtin", num_kv_blocks=16)
    try:
        raised = _construct(EngineProcArgs(config, "no-such-transport://x", "no-such-transport://y"))
    finally:
        stuck.set()
    assert [str(error) for error in raised] == ["Input socket thread did not start within 0.5 s"]
