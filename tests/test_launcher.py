"""The launcher: engines live and die without it, a dead one is replaced, and a forked engine is a spawned one.

Every scenario does the damage for real: SIGKILL to the launcher, to the engine, to both; closing the
launcher while engines run; a launcher that cannot start. Each ends within about a second in
``EngineDeadError`` or in service that goes on, and ``restart()`` works afterwards.
"""

import os
import signal
import sys
import threading
import time

import psutil
import pytest

import enginekit
from enginekit import Engine, EngineDeadError, EngineStartupError, SamplingParams
from enginekit.runtime import launcher as launcher_module
from enginekit.runtime.launcher import Launcher
from process_support import HANG_GUARD_S, wait_for, wait_gone, wait_until_generating

# A killed engine fails the waiting call through its pidfd at once ("about a second" on a quiet machine); the
# messages asserted name the signal, which only that path knows. HANG_GUARD_S only bounds a hang.
LONG = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture
def engine():
    engine = Engine("builtin", mode="mp", num_kv_blocks=64)
    yield engine
    engine.shutdown()


def generate_in_thread(engine):
    """Run a long generate on a thread; returns (thread, outcome list) once it produces tokens."""
    outcome = []

    def run():
        try:
            outcome.append(engine.generate("keep going", LONG)[0])
        except BaseException as error:
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    wait_until_generating(engine)
    return worker, outcome


def test_killing_the_launcher_during_generate_does_not_disturb_the_engine(engine):
    launcher = Launcher.shared()
    worker, outcome = generate_in_thread(engine)
    os.kill(launcher.pid, signal.SIGKILL)
    worker.join(120)
    assert not worker.is_alive() and outcome[0].outputs[0].finish_reason == "length"
    assert engine.ping()
    engine.restart()  # a new launcher, started without the user noticing
    assert engine.generate("again", SHORT)[0].finished
    assert Launcher.shared().pid != launcher.pid


def test_killing_the_engine_fails_the_waiting_call(engine):
    pid = engine.engine_pid
    worker, outcome = generate_in_thread(engine)
    os.kill(pid, signal.SIGKILL)
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive(), "generate still hangs after the engine was killed"
    with pytest.raises(EngineDeadError, match=rf"pid {pid}\) was killed by SIGKILL"):
        raise outcome[0]
    engine.restart()
    assert engine.generate("again", SHORT)[0].finished


def test_killing_the_engine_and_the_launcher_fails_the_call_then_restart_works(engine):
    pid, launcher_pid = engine.engine_pid, Launcher.shared().pid
    worker, outcome = generate_in_thread(engine)
    os.kill(launcher_pid, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive(), "generate still hangs after the engine and the launcher were killed"
    # Whether the launcher could still report the exit depends on which died first; either way it is a death.
    with pytest.raises(
        EngineDeadError, match=rf"pid {pid}\) (was killed by SIGKILL|exited; its exit status is unknown)"
    ):
        raise outcome[0]
    engine.restart()
    assert engine.generate("again", SHORT)[0].finished


def test_closing_the_launcher_while_engines_run(engine):
    other = Engine("builtin", mode="async", num_kv_blocks=64)
    try:
        run_dirs = [engine.client.sockets.run_dir, other.client.sockets.run_dir]
        enginekit.shutdown_launcher()
        assert engine.generate("still here", SHORT)[0].finished
        assert other.generate("still here", SHORT)[0].finished
        pids = [engine.engine_pid, other.engine_pid]
        engine.shutdown()
        other.shutdown()
        assert wait_gone(pids) == []
        assert not any(os.path.exists(path) for path in run_dirs)
        engine.restart()
        assert engine.generate("again", SHORT)[0].finished
    finally:
        other.shutdown()


def test_a_reply_left_unread_is_not_taken_as_the_next_calls_answer():
    """A call that gave up (a timeout; a Ctrl-C lands the same way) leaves its reply in the socket: the next call
    reads past it to its own."""
    from enginekit.runtime.launcher import LauncherError
    from enginekit.wire.messages import ExitStatus, StatusRequest

    launcher = Launcher()
    try:
        os.kill(launcher.pid, signal.SIGSTOP)  # it cannot answer in time
        try:
            with pytest.raises(LauncherError, match="did not answer"):
                launcher.exit_status(111111, timeout=0.2)
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
        assert launcher._call(StatusRequest(222222), [], 30.0) == ExitStatus(222222, None)
    finally:
        launcher.close()


def test_a_launcher_that_cannot_start_raises_startup_error_with_its_output(monkeypatch):
    enginekit.shutdown_launcher()
    failing = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('launcher exploded: no torch here'); sys.exit(3)",
    ]
    monkeypatch.setattr(Launcher, "command", failing)
    with pytest.raises(
        EngineStartupError, match=r"launcher did not start: launcher exploded: no torch here"
    ) as info:
        Engine("builtin", mode="mp")
    assert info.value.phase == "spawn"
    monkeypatch.undo()
    with Engine("builtin", mode="mp") as engine:
        assert engine.ping()


def test_an_idle_launcher_exits_by_itself_and_is_replaced(monkeypatch):
    enginekit.shutdown_launcher()
    monkeypatch.setattr(launcher_module, "IDLE_TIMEOUT_S", 0.5)
    with Engine("builtin", mode="mp") as engine:
        # The baseline, on this machine now: how long a launcher takes to exit once its engine has stopped.
        first = Launcher.shared()
        engine.shutdown()
        stopped = time.monotonic()
        wait_for(lambda: not first.is_alive(), what="the idle launcher exiting")
        idle_exit_s = time.monotonic() - stopped
        engine.restart()
        launcher = Launcher.shared()
        assert launcher.pid != first.pid
        time.sleep(3 * idle_exit_s)  # a window three times the baseline: an engine runs, so it is not idle
        assert launcher.is_alive()
        engine.shutdown()
        wait_for(lambda: not launcher.is_alive(), what="the idle launcher exiting")
        engine.restart()
        assert engine.ping() and Launcher.shared().pid != launcher.pid
    enginekit.shutdown_launcher()


def test_a_forked_engine_gets_the_front_ends_environment_cwd_and_sys_path(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINEKIT_TEST_MARKER", "before")
    with Engine("builtin", mode="mp") as engine:
        launcher = Launcher.shared()
        monkeypatch.setenv("ENGINEKIT_TEST_MARKER", "after")
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path / "extra"))
        engine.restart()
        assert Launcher.shared() is launcher  # an ordinary variable needs no new launcher
        inside = engine.call_utility("debug_process")
        assert inside["environ"]["ENGINEKIT_TEST_MARKER"] == "after"
        assert inside["cwd"] == str(tmp_path) == psutil.Process(engine.engine_pid).cwd()
        assert str(tmp_path / "extra") in inside["sys_path"]
        # What torch reads as it loads: a new launcher imports it under the new values; /proc shows them too.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        engine.restart()
        assert Launcher.shared() is not launcher
        environ = psutil.Process(engine.engine_pid).environ()
        assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert environ["CUDA_VISIBLE_DEVICES"] == "" and environ["ENGINEKIT_TEST_MARKER"] == "after"


def test_the_launcher_refuses_to_fork_once_cuda_is_initialised(monkeypatch):
    import socket

    import torch

    from enginekit.runtime.launcher_server import LauncherServer
    from enginekit.wire.messages import LauncherFailure, SpawnRequest

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    try:
        reply = LauncherServer(theirs, 1.0)._spawn(SpawnRequest({}, "/", []), [read_end, write_end])
    finally:
        ours.close()
        theirs.close()
    assert isinstance(reply, LauncherFailure) and "initialised CUDA" in reply.message
    for fd in (read_end, write_end):  # the launcher closed them
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("start_method", ["launcher", "spawn"])
def test_an_engine_process_takes_every_core_with_libgomps_long_openmp_spin(start_method, monkeypatch):
    # Workers spin some milliseconds between ops (a futex wake-up per op cost a third of the speed, and a short spin
    # still let them sleep inside a step), then sleep; the engine runs fewer threads while other processes are
    # busy (test_threads.py).
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with Engine("builtin", mode="mp", start_method=start_method) as engine:
        inside = engine.call_utility("debug_process")
        assert inside["max_torch_threads"] == len(os.sched_getaffinity(0))
        assert inside["environ"]["GOMP_SPINCOUNT"] == "300000"
        assert "OMP_WAIT_POLICY" not in inside["environ"]
        if start_method == "launcher":  # where the OpenMP runtime read it, as torch loaded
            assert psutil.Process(Launcher.shared().pid).environ()["GOMP_SPINCOUNT"] == "300000"
        assert "GOMP_SPINCOUNT" not in os.environ  # the front end's own environment is left alone
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's choice wins
        engine.restart()
        environ = engine.call_utility("debug_process")["environ"]
        assert environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in environ
