"""Lifecycle hygiene: restart forever, interrupt, orphan and tear down without leaking anything.

Every check measures the process with ``enginekit.diagnostics``. Background engines (``"mp"``, ``"async"``)
are forked by a launcher process that the first of them starts and that then stays for fast restarts (one
per front-end process). A baseline is therefore taken after a warm-up engine has started it: the launcher
is part of the baseline (the tests check that it is there), and no other child process may be left.

Measured on the 2-core CPU development machine (tiny built-in model, ``num_kv_blocks=64``): after 30
restarts, each generating, threads, file descriptors, child processes, frozen objects, signal handlers and
tensors are back to the baseline exactly; resident memory grew by +0.9 to +3.5 MiB in ``"inproc"`` mode
(flat from 30 to 90 restarts: allocator caches, not a leak) and at most +0.3 MiB in ``"mp"`` and
``"async"`` modes. ``RSS_BOUND_MIB`` allows several times that. See ``docs/lifecycle.md``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import enginekit
import process_support
from enginekit import Engine, EngineDeadError, EngineShutdownError, SamplingParams
from enginekit.diagnostics import ProcessSnapshot, snapshot, wait_until_clean
from enginekit.runtime.launcher import Launcher

MODES = ["inproc", "mp", "async"]
OPTIONS = {"num_kv_blocks": 64}
SHORT = SamplingParams(max_tokens=4, temperature=0)
NUM_RESTARTS = 30
RSS_BOUND_MIB = {"inproc": 32, "mp": 16, "async": 16}  # measured at most: +3.5, +0.3, +0.2 MiB
# Bounded waits: failing them means something hangs, not that it is slow (an orphaned engine exited in 0.05 to
# 0.2 s on a quiet machine, 2 s at worst; a machine shared with other work takes longer).
CLEAN_TIMEOUT_S = process_support.HANG_GUARD_S
GONE_TIMEOUT_S = process_support.HANG_GUARD_S
MIB = 2**20


def long_params(engine: Engine) -> SamplingParams:
    """A request that runs for many steps: interrupts land while it generates."""
    return SamplingParams(max_tokens=engine.max_model_len - 16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected_tokens() -> list[int]:
    with Engine("builtin", mode="inproc", **OPTIONS) as engine:
        return engine.generate("hello", SHORT)[0].outputs[0].token_ids


def warm_baseline(mode: str) -> ProcessSnapshot:
    """Start and stop one engine first, so that one-time costs (imports, the launcher) are in the baseline."""
    with Engine("builtin", mode=mode, **OPTIONS) as engine:
        engine.generate("warm up", SHORT)
    return snapshot()


def launcher_pid() -> int | None:
    launcher = Launcher._instance
    return launcher.proc.pid if launcher is not None and launcher.is_alive() else None


def assert_clean(baseline: ProcessSnapshot, *, rss_bound_mib: float = 64) -> None:
    diff = wait_until_clean(baseline, timeout=CLEAN_TIMEOUT_S, rss_tolerance_bytes=int(rss_bound_mib * MIB))
    assert not diff.leaks(rss_tolerance_bytes=int(rss_bound_mib * MIB)), str(diff)


def signal_handlers() -> dict[int, object]:
    return {
        int(sig): signal.getsignal(sig)
        for sig in signal.valid_signals()
        if sig not in (signal.SIGKILL, signal.SIGSTOP)
    }


def interrupt_when_generating(engine: Engine) -> threading.Thread:
    """From a timer thread, send SIGINT to this process once the engine has produced a token."""

    def fire() -> None:
        deadline = time.monotonic() + process_support.HANG_GUARD_S
        # The front end's request states are the one place that shows tokens flowing in every mode.
        while not any(state.version > 0 for state in list(engine._router.processor.states.values())):
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, name="test-interrupter", daemon=True)
    thread.start()
    return thread


def wait_gone(pids: list[int], timeout: float = GONE_TIMEOUT_S) -> list[int]:
    return process_support.wait_gone(pids, timeout)


# ---- restart forever ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [pytest.param("inproc", marks=pytest.mark.slow), "mp", "async"])
def test_thirty_restarts_leak_nothing(mode, expected_tokens):
    baseline = warm_baseline(mode)
    if mode != "inproc":
        assert launcher_pid() in baseline.child_pids  # the one child a background engine leaves running
    engine = Engine("builtin", mode=mode, **OPTIONS)
    pids = set()
    running = []
    for restart in range(NUM_RESTARTS):
        assert engine.generate("hello", SHORT)[0].outputs[0].token_ids == expected_tokens
        pids.add(engine.engine_pid)
        if restart in (0, NUM_RESTARTS - 1):
            running.append(snapshot())
        engine.restart()
    assert engine.generate("hello", SHORT)[0].outputs[0].token_ids == expected_tokens
    engine.shutdown()
    first, last = running
    assert (last.num_threads, last.num_fds, len(last.child_pids)) == (
        first.num_threads,
        first.num_fds,
        len(first.child_pids),
    )
    assert len(pids) == (1 if mode == "inproc" else NUM_RESTARTS)
    assert_clean(baseline, rss_bound_mib=RSS_BOUND_MIB[mode])


def test_async_mode_restarts_on_a_loop_that_keeps_running(expected_tokens):
    # A notebook kernel's loop runs all session long: each engine must take its readers off it on shutdown,
    # or the next engine, reusing the fd numbers, never hears from its socket.
    # NOTE: only awaits on the running loop here; a sync call would apply nest-asyncio to this process.
    async def restart_forever() -> None:
        engine = Engine("builtin", mode="async", **OPTIONS)
        for _ in range(NUM_RESTARTS):
            outputs = await asyncio.wait_for(engine.agenerate("hello", SHORT), 30)
            assert outputs[0].outputs[0].token_ids == expected_tokens
            engine.restart()
        engine.shutdown()

    baseline = warm_baseline("async")
    asyncio.run(restart_forever())
    assert_clean(baseline, rss_bound_mib=RSS_BOUND_MIB["async"])


def test_async_mode_sync_calls_do_not_accumulate_event_loops():
    # Outside a running loop each sync call runs on a new loop; none may outlive its call.
    def live_loops() -> int:
        gc.collect()
        return sum(1 for obj in gc.get_objects() if issubclass(type(obj), asyncio.AbstractEventLoop))

    before = live_loops()  # earlier tests in this process may still hold a loop of their own
    with Engine("builtin", mode="async", **OPTIONS) as engine:
        for _ in range(20):
            engine.generate("hello", SHORT)
        assert live_loops() <= before + 1


# ---- gc and signal handlers -----------------------------------------------------------------------------


def test_inproc_engine_leaves_the_gc_freeze_count_as_before():
    froze_here = gc.get_freeze_count() == 0
    if froze_here:
        gc.freeze()  # a user heap that is partly frozen already: the engine must not change it
    try:
        before = gc.get_freeze_count()
        with Engine("builtin", mode="inproc", **OPTIONS) as engine:
            engine.generate("hello", SHORT)
        assert gc.get_freeze_count() == before
    finally:
        if froze_here:
            gc.unfreeze()


@pytest.mark.parametrize("mode", MODES)
def test_engine_installs_no_signal_handler_and_restores_the_previous_one(mode):
    def user_handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, user_handler)  # not SIG_DFL: a restore to "default" shows
    try:
        before = signal_handlers()
        engine = Engine("builtin", mode=mode, **OPTIONS)
        engine.generate("hello", SHORT)
        list(engine.stream("hello", SHORT))
        while_running = signal_handlers()
        engine.shutdown()
        assert while_running == before
        assert signal_handlers() == before
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("mode", MODES)
def test_engine_built_from_a_non_main_thread_works(mode, expected_tokens):
    before = signal_handlers()
    result = {}

    def run() -> None:
        try:
            with Engine("builtin", mode=mode, **OPTIONS) as engine:
                result["generate"] = engine.generate("hello", SHORT)[0].outputs[0].token_ids
                result["stream"] = list(engine.stream("hello", SHORT))[-1].outputs[0].token_ids
        except BaseException as error:
            result["error"] = error

    worker = threading.Thread(target=run, name="engine-builder")
    worker.start()
    worker.join(120)
    assert not worker.is_alive()
    assert "error" not in result, repr(result.get("error"))
    assert result == {"generate": expected_tokens, "stream": expected_tokens}
    assert signal_handlers() == before


# ---- interrupt -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=MODES)
def engine(request):
    with Engine("builtin", mode=request.param, **OPTIONS) as engine:
        yield engine


def assert_interrupted_requests_aborted(engine: Engine) -> None:
    assert engine.call_utility("get_request_ids") == []
    stats = engine.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_generated_tokens"] < engine.max_model_len - 16  # stopped early, not finished


def test_sigint_during_generate_aborts_its_requests_and_next_generate_works(engine, expected_tokens):
    interrupter = interrupt_when_generating(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(["interrupt me", "and me"], long_params(engine))
    interrupter.join(10)
    assert_interrupted_requests_aborted(engine)
    assert engine.generate("hello", SHORT)[0].outputs[0].token_ids == expected_tokens


def test_sigint_during_stream_aborts_its_request_and_next_generate_works(engine, expected_tokens):
    interrupter = interrupt_when_generating(engine)
    with pytest.raises(KeyboardInterrupt):
        for _ in engine.stream("interrupt me", long_params(engine)):
            pass
    interrupter.join(10)
    assert_interrupted_requests_aborted(engine)
    assert engine.generate("hello", SHORT)[0].outputs[0].token_ids == expected_tokens


class _SigintWhenDropped:
    """Delivers SIGINT from a destructor, as pyzmq does when it checks signals in ``Frame.__dealloc__``."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_async_sync_call_raises_an_interrupt_that_lands_in_a_destructor_and_keeps_the_message():
    # NOTE: Python drops an exception raised in a destructor ("Exception ignored in ..."): with its default
    # handler, Ctrl-C landing while the socket's frames are freed would be lost and the call would go on.
    with Engine("builtin", mode="async", **OPTIONS) as engine:
        receiver = engine.client.receiver
        handle_frames, handled = receiver._handle_frames, []

        def handle_with_interrupt(frames):
            batch = handle_frames(frames)
            if batch is not None and not handled:
                _SigintWhenDropped()  # dropped at once: the signal is delivered inside its __del__
                handled.append(batch)
            return batch

        receiver._handle_frames = handle_with_interrupt
        with pytest.raises(KeyboardInterrupt):
            engine.generate("interrupt me", long_params(engine))
        # The message was handled whole and stays queued, first; messages already waiting behind it may have
        # been drained into the queue too (the reader reads until the socket would block).
        assert list(receiver._batches)[:1] == handled
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        receiver._handle_frames = handle_frames
        assert_interrupted_requests_aborted(engine)
        assert engine.generate("hello", SHORT)[0].finished


@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_an_interrupt_while_a_batch_is_routed_loses_nothing_of_another_threads_request(mode):
    # A batch holds every running request's tokens (with a delta per step, as streams and viewers get them): the
    # main thread's Ctrl-C must not drop a worker's.
    with Engine("builtin", mode=mode, **OPTIONS) as engine:
        params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)  # overlaps the other call
        expected = engine.generate("another thread", params)[0].outputs[0].token_ids
        router = engine._router
        processor = router.processor
        process, take = processor.process, router.take
        interrupted, released, result = [], threading.Event(), {}

        def process_after_an_interrupt(batch):
            main = threading.current_thread() is threading.main_thread()
            if main and not interrupted and len({output.request_id for output in batch.outputs}) > 1:
                interrupted.append(True)
                released.set()
                signal.raise_signal(signal.SIGINT)  # Python runs the handler here, before the batch is routed
            process(batch)

        def take_after_the_interrupt():
            # NOTE: whichever thread takes a batch routes all of it, and a lock released is often taken back by
            # the thread that released it: the worker waits, so that the main thread routes a batch of both.
            if threading.current_thread() is worker:
                released.wait(60)
            return take()

        processor.process, router.take = process_after_an_interrupt, take_after_the_interrupt
        worker = threading.Thread(
            target=lambda: result.update(
                ids=process_support.generate_with_deltas(engine, "another thread", params)[0]
                .outputs[0]
                .token_ids
            )
        )
        worker.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                process_support.generate_with_deltas(engine, "interrupt me", long_params(engine))
        finally:
            released.set()
            worker.join(60)
            processor.process = process
            del router.take  # the class's method again
        assert interrupted and not worker.is_alive()
        assert result == {"ids": expected}
        assert engine.call_utility("get_request_ids") == []


def test_a_second_interrupt_that_cuts_an_inproc_step_short_marks_the_engine_dead():
    # The first Ctrl-C waits for the step to end; a second one raises at once, mid-step: that step's
    # requests cannot be trusted any more, so the engine says so until it is restarted.
    with Engine("builtin", mode="inproc", **OPTIONS) as engine:
        core = engine.client.core
        step = core.step

        def step_interrupted_twice():
            signal.raise_signal(signal.SIGINT)  # noted
            signal.raise_signal(signal.SIGINT)  # raised here, inside the step
            return step()

        core.step = step_interrupted_twice
        with pytest.raises(KeyboardInterrupt):
            engine.generate("interrupt me twice", long_params(engine))
        assert not engine.is_running
        with pytest.raises(EngineDeadError, match="interrupted in the middle of a step"):
            engine.generate("hello", SHORT)
        engine.restart()
        assert engine.generate("hello", SHORT)[0].finished


# ---- front ends in their own process (process-group signals, SIGKILL, interpreter exit) ------------------

FRONT_END_PRELUDE = """
import gc, os, sys, threading, time
import psutil
from enginekit import Engine, SamplingParams
from enginekit.runtime.engine_process import EngineProcess

def descendants():
    return " ".join(str(p.pid) for p in psutil.Process().children(recursive=True))

def when(condition, action):
    def watch():
        while not condition():
            time.sleep(0.002)
        action()
    threading.Thread(target=watch, daemon=True).start()
"""


class FrontEnd:
    """A front-end script in its own session (so its process group is its own), read line by line."""

    def __init__(self, body: str) -> None:
        code = FRONT_END_PRELUDE + textwrap.dedent(body)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._lines.put), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self._stderr.append), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    def expect(self, prefix: str, timeout: float = 120.0) -> list[str]:
        """Wait for the next line starting with ``prefix``; returns its remaining words."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line within {timeout}s; stderr:\n{self.stderr}"
                ) from None
            if line is None:
                raise AssertionError(f"front end ended before {prefix!r}; stderr:\n{self.stderr}")
            if line.startswith(prefix):
                return line[len(prefix) :].split()

    @property
    def stderr(self) -> str:
        return "\n".join(line for line in self._stderr if line is not None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for reader in self._readers:
            reader.join(10)  # EOF once the script is gone: its engines never hold its stdout or stderr
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def front_end():
    started: list[FrontEnd] = []

    def start(body: str) -> FrontEnd:
        started.append(FrontEnd(body))
        return started[-1]

    yield start
    for process in started:
        process.close()


@pytest.mark.parametrize("start_method", ["launcher", "spawn"])
def test_engine_process_survives_sigint_to_the_front_ends_process_group(front_end, start_method):
    script = front_end(f"""
        engine = Engine("builtin", mode="mp", num_kv_blocks=64, start_method={start_method!r})
        pid = engine.engine_pid
        params = SamplingParams(max_tokens=engine.max_model_len - 16, temperature=0, ignore_eos=True)
        when(lambda: any(s.version for s in list(engine._router.processor.states.values())),
             lambda: print("generating", flush=True))
        try:
            engine.generate("interrupt me", params)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print("same-engine", engine.engine_pid == pid and engine.is_running, flush=True)
        print("next", len(engine.generate("next", SamplingParams(max_tokens=4))[0].outputs[0].token_ids))
        engine.shutdown()
    """)
    script.expect("generating")
    os.killpg(script.proc.pid, signal.SIGINT)  # what Jupyter's interrupt does to a kernel
    script.expect("interrupted")
    assert script.expect("same-engine") == ["True"]
    assert script.expect("next") == ["4"]
    assert script.proc.wait(60) == 0, script.stderr


@pytest.mark.parametrize("start_method", ["launcher", "spawn"])
def test_engine_process_exits_when_its_front_end_is_killed(front_end, start_method):
    script = front_end(f"""
        engine = Engine("builtin", mode="mp", num_kv_blocks=64, start_method={start_method!r})
        engine.generate("hello", SamplingParams(max_tokens=4))
        print("pids", descendants(), flush=True)
        sys.stdin.read()
    """)
    pids = [int(pid) for pid in script.expect("pids")]
    assert pids
    os.kill(script.proc.pid, signal.SIGKILL)
    assert wait_gone(pids) == []


@pytest.mark.parametrize("start_method", ["launcher", "spawn"])
def test_engine_process_exits_when_its_front_end_is_killed_during_model_load(front_end, start_method):
    script = front_end(f"""
        def loading():
            return any(getattr(obj, "phase", None) == "model load"
                       for obj in gc.get_objects() if type(obj) is EngineProcess)
        when(loading, lambda: print("loading", descendants(), flush=True))
        Engine("builtin", mode="mp", num_kv_blocks=64, start_method={start_method!r}, debug_load_delay_s=30)
        print("loaded: too late", flush=True)
    """)
    pids = [int(pid) for pid in script.expect("loading")]
    assert pids
    os.kill(script.proc.pid, signal.SIGKILL)
    assert wait_gone(pids) == []


@pytest.mark.parametrize(
    ("point", "mode"), [("launcher start", "mp"), ("model load", "mp"), ("model load", "async")]
)
def test_ctrl_c_during_the_first_engine_leaves_nothing_once_the_launcher_is_shut_down(front_end, point, mode):
    """A Ctrl-C during a process's first ``Engine()``: while the launcher it starts imports torch, or once the
    engine process reports the model loading. The exception is kept, as a notebook keeps the last traceback."""
    script = front_end(f"""
        import signal
        import enginekit
        from enginekit.diagnostics import snapshot, wait_until_clean
        before = snapshot()
        def reached():
            if {point!r} == "launcher start":  # the launcher exists; it reports ready once torch is imported
                return bool(psutil.Process().children())
            return any(getattr(obj, "phase", None) == "model load"
                       for obj in gc.get_objects() if type(obj) is EngineProcess)
        when(reached, lambda: os.kill(os.getpid(), signal.SIGINT))
        try:
            Engine("builtin", mode={mode!r}, num_kv_blocks=64, debug_load_delay_s=60)
        except KeyboardInterrupt as error:
            kept = error
            print("interrupted", flush=True)
        enginekit.shutdown_launcher()
        print("leaks", repr(wait_until_clean(before, timeout=15).leaks()), flush=True)
    """)
    script.expect("interrupted")
    assert script.expect("leaks") == ["[]"], script.stderr
    assert script.proc.wait(60) == 0, script.stderr


def assert_exits_leaving_nothing(script: FrontEnd, pids: list[int]) -> None:
    assert script.proc.wait(60) == 0, script.stderr
    assert wait_gone(pids) == []
    for sign_of_trouble in ("Traceback", "Exception ignored", "dead", "died"):
        assert sign_of_trouble not in script.stderr, script.stderr


def test_interpreter_exit_without_shutdown_releases_every_engine(front_end):
    script = front_end("""
        engines = [Engine("builtin", mode=mode, num_kv_blocks=64) for mode in ("inproc", "mp", "async", "mp")]
        for engine in engines:
            engine.generate("bye", SamplingParams(max_tokens=4))
        print("pids", descendants(), flush=True)
    """)
    pids = [int(pid) for pid in script.expect("pids")]
    assert len(pids) == 4  # the launcher and three engine processes
    assert_exits_leaving_nothing(script, pids)


def test_interpreter_exit_with_a_bare_client_and_a_dropped_engine_leaves_no_orphan(front_end):
    # A client made without an Engine, and an engine whose only reference is a cycle (collected only by the
    # gc, which may never run before exit): both are released by their finalizers, before the launcher goes.
    script = front_end("""
        from enginekit.client import make_client
        from enginekit.config import EngineConfig
        from enginekit.model.loader import load_model_spec
        config = EngineConfig.from_options("builtin", num_kv_blocks=64)
        client = make_client("mp", config, load_model_spec(config.model, config.revision))
        engine = Engine("builtin", mode="mp", num_kv_blocks=64)
        engine.generate("bye", SamplingParams(max_tokens=4))
        engine.cycle = engine
        del engine
        print("pids", descendants(), flush=True)
    """)
    pids = [int(pid) for pid in script.expect("pids")]
    assert len(pids) == 3  # the launcher and two engine processes
    assert_exits_leaving_nothing(script, pids)


def test_no_cleanup_runs_in_a_destructor():
    # Cleanup is a weakref.finalize over a resources object (runtime/exit_hooks.py): its order at exit is
    # defined, and it never runs half-way through a torn-down interpreter.
    package = Path(enginekit.__file__).parent
    offenders = [str(path) for path in package.rglob("*.py") if "def __del__" in path.read_text()]
    assert offenders == []


# ---- teardown -------------------------------------------------------------------------------------------


@pytest.fixture
def engine_log(caplog):
    caplog.set_level(logging.DEBUG, logger="enginekit")
    return caplog


def assert_no_death_reported(log) -> None:
    for record in log.records:
        message = record.getMessage()
        assert record.levelno < logging.WARNING, message
        assert "died" not in message and "dead" not in message.lower(), message


def teardown_by_shutdown(engine: Engine) -> None:
    engine.shutdown()


def teardown_by_context_manager(engine: Engine) -> None:
    with engine:
        pass


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("teardown", [teardown_by_shutdown, teardown_by_context_manager])
def test_teardown_releases_everything_and_reports_no_death(mode, teardown, engine_log):
    baseline = warm_baseline(mode)
    engine = Engine("builtin", mode=mode, **OPTIONS)
    engine.generate("hello", SHORT)
    teardown(engine)
    assert not engine.is_running
    with pytest.raises(EngineShutdownError, match=r"engine\.restart\(\)"):
        engine.generate("hello", SHORT)
    assert_clean(baseline, rss_bound_mib=RSS_BOUND_MIB[mode])
    assert_no_death_reported(engine_log)


@pytest.mark.parametrize("mode", MODES)
def test_del_engine_releases_everything(mode, engine_log):
    baseline = warm_baseline(mode)
    engine = Engine("builtin", mode=mode, **OPTIONS)
    engine.generate("hello", SHORT)
    list(engine.stream("hello", SHORT))
    pid = engine.engine_pid
    del engine  # the last reference: no gc.collect() needed
    if mode != "inproc":
        assert wait_gone([pid]) == []
    assert_clean(baseline, rss_bound_mib=RSS_BOUND_MIB[mode])
    assert_no_death_reported(engine_log)
