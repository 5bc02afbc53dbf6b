"""Engine deaths, done for real: every waiting call fails fast with EngineDeadError, then restart() works.

The engine process is killed with SIGKILL in the middle of each kind of call, made to fail in its executor
(``fail_at_step``), or loses an IO thread (``utility_debug_kill_io_thread``). The mode-parity death test for
``generate`` lives in test_modes.py; these cover streams, async calls and pending utility calls.
"""

import asyncio
import os
import signal
import threading

import pytest

from enginekit import Engine, EngineDeadError, SamplingParams
from enginekit.client.mp import MPClient
from enginekit.wire.messages import LAST_WORDS
from process_support import HANG_GUARD_S, in_thread, wait_for, wait_gone

# A death reaches the waiting calls through the engine's pidfd and sockets, at once ("about a second" on a quiet
# machine): the messages below name how the engine ended, which only those paths know. A call still blocked after
# HANG_GUARD_S counts as hung.
LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)


def run_generate(engine):
    engine.generate("kill me while I generate", LONG)


def run_stream(engine):
    for _ in engine.stream("kill me while I stream", LONG):
        pass


def run_agenerate(engine):
    asyncio.run(engine.agenerate("kill me while I await", LONG))


def run_astream(engine):
    async def consume():
        async for _ in engine.astream("kill me while I stream asynchronously", LONG):
            pass

    asyncio.run(consume())


def run_utility(engine):
    engine.call_utility("sleep", 30.0, timeout=60)


OPERATIONS = {
    "generate": run_generate,
    "stream": run_stream,
    "agenerate": run_agenerate,
    "astream": run_astream,
    "utility": run_utility,
}


def producing_tokens(engine):
    """Some request of ``engine`` runs: the engine reported it scheduled (``generate`` gets its tokens only when
    its request ends) or sent it tokens."""
    states = list(engine._router.processor.states.values())
    return any(state.output.status == "running" for state in states)


def run_until_fault(engine, operation, *, in_flight, inject):
    """Run ``operation`` on a worker thread, inject the fault once ``in_flight()``, return what it raised.

    Fails the test if the operation never got in flight, or is still blocked ``HANG_GUARD_S`` after the fault.
    """
    outcome = []

    def victim():
        try:
            operation(engine)
        except BaseException as error:
            outcome.append(error)
        else:
            outcome.append(None)

    worker = threading.Thread(target=victim, name="fault-victim", daemon=True)
    worker.start()
    wait_for(lambda: in_flight() or not worker.is_alive(), what="the call getting in flight")
    assert in_flight(), f"the call ended before the fault: {outcome}"
    inject()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive(), f"the call still hangs {HANG_GUARD_S}s after the engine died"
    assert outcome[0] is not None, "the call returned normally although the engine died"
    return outcome[0]


@pytest.fixture(scope="module", params=["mp", "async"])
def module_engine(request):
    with Engine("builtin", mode=request.param) as engine:
        yield engine


@pytest.fixture
def engine(module_engine):
    """The module's engine, running: a test that failed before its own restart leaves it dead for no other."""
    if not module_engine.is_running:
        module_engine.restart()
    return module_engine


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_kill_9_fails_the_waiting_call_then_restart_works(engine, operation):
    pid = engine.engine_pid
    # The utility sleeps for 30 s: once the front end holds its call pending, the call waits on the engine.
    utility_pending = lambda: len(engine.client._pending) > 0  # noqa: E731
    error = run_until_fault(
        engine,
        OPERATIONS[operation],
        in_flight=utility_pending if operation == "utility" else (lambda: producing_tokens(engine)),
        inject=lambda: os.kill(pid, signal.SIGKILL),
    )
    with pytest.raises(EngineDeadError, match=rf"engine process \(pid {pid}\) was killed by SIGKILL"):
        raise error
    assert "restart()" in str(error)
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        engine.generate("a later call fails the same way", SamplingParams(max_tokens=2))
    engine.restart()
    assert engine.engine_pid != pid
    assert engine.generate("alive again", SamplingParams(max_tokens=3))[0].finished


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("operation", ["generate", "stream", "agenerate", "astream"])
def test_a_signal_to_the_engine_process_fails_the_calls_in_flight_naming_it(engine, operation, signum):
    # The engine stops for it; a request nobody aborted must not end as if it had finished ('abort').
    name = signal.Signals(signum).name
    pid = engine.engine_pid
    error = run_until_fault(
        engine,
        OPERATIONS[operation],
        in_flight=lambda: producing_tokens(engine),
        inject=lambda: os.kill(pid, signum),
    )
    with pytest.raises(EngineDeadError, match=rf"engine process was sent {name} \(not by this front end\)"):
        raise error
    with pytest.raises(EngineDeadError, match=name):
        engine.generate("a later call fails the same way", SamplingParams(max_tokens=2))
    engine.restart()
    assert engine.generate("alive again", SamplingParams(max_tokens=3))[0].finished


def test_a_signal_is_named_when_the_engine_exit_is_seen_before_its_last_message():
    # On a busy machine the front end can see the engine's exit (its pidfd) while zmq still delivers the EngineDead
    # that names the signal: the exit code (128 + SIGTERM) must name it the same way.
    with Engine("builtin", mode="mp") as engine:
        client, receiver = engine.client, engine.client.receiver
        holding, released = threading.Event(), threading.Event()
        handle_frames = receiver._handle_frames

        def held(frames):  # the reader takes one message and holds it
            holding.set()
            released.wait()
            return handle_frames(frames)

        receiver._handle_frames = held
        in_thread(engine.ping)  # its answer is the message held
        assert holding.wait(HANG_GUARD_S)
        process = client.engines[0].process
        os.kill(engine.engine_pid, signal.SIGTERM)
        assert process.wait_dead(HANG_GUARD_S)
        client._on_process_exit(process)  # what the reader does when it sees the exit first
        released.set()
        with pytest.raises(EngineDeadError, match=r"was sent SIGTERM \(not by this front end\)"):
            engine.generate("after the signal", SamplingParams(max_tokens=2))


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_a_lost_engine_dead_is_found_in_the_engines_output(monkeypatch, mode):
    # Over IPC, libzmq drops the engine's last message when it hangs up while the front end's queue is full (an
    # async reader far behind on a loaded machine): the engine repeats it on stderr, where the exit's report finds
    # it. The front end here never hears the message, as if zmq had dropped it.
    monkeypatch.setattr(MPClient, "_on_engine_dead", lambda self, message: None)
    with (
        Engine("builtin", mode=mode, fail_at_step=3) as engine,
        pytest.raises(EngineDeadError, match=EXECUTOR_FAILURE) as caught,
    ):
        engine.generate("fail in my third step", LONG)
    assert LAST_WORDS not in str(caught.value)  # its repetition is no line of the output shown


@pytest.mark.parametrize(
    ("signum", "described"), [(signal.SIGKILL, "killed by SIGKILL"), (signal.SIGTERM, "SIGTERM")]
)
def test_an_engine_that_died_idle_names_how_in_every_mode(engine, signum, described):
    # "async" with no loop running has nobody watching the engine until the next call: that call must still
    # say how the engine ended, not only that the socket could not reach it.
    pid = engine.engine_pid
    os.kill(pid, signum)
    assert wait_gone([pid]) == []
    with pytest.raises(EngineDeadError, match=described):
        engine.generate("after an idle death", SamplingParams(max_tokens=2))
    engine.restart()


# ---- an executor failure: EXECUTOR_FAILED -> ENGINE_CORE_DEAD -> EngineDeadError -------------------------


def wait_idle_pending(engine) -> dict:
    """Wait until a ``wait_idle`` call has reached the engine; its stats then."""
    seen = {}

    def registered() -> bool:
        seen.update(engine.get_stats())
        return seen["num_idle_waiters"] == 1

    wait_for(registered, what="wait_idle reaching the engine")
    return seen


EXECUTOR_FAILURE = r"engine core reported a fatal error(.|\n)*Executor failed(.|\n)*injected executor failure"
FAILING_STEP = 2000  # far enough that the wait_idle below has reached the engine (checked) before it fails


def test_executor_failure_fails_a_stream_and_a_pending_utility_call():
    with Engine("builtin", mode="mp", fail_at_step=FAILING_STEP) as engine:
        pending = {}

        def wait_idle():
            try:
                engine.call_utility("wait_idle", timeout=HANG_GUARD_S)
            except BaseException as error:
                pending["error"] = error

        waiter = threading.Thread(target=wait_idle)  # answers only when idle: never
        with pytest.raises(EngineDeadError, match=EXECUTOR_FAILURE):
            for output in engine.stream("fail while I stream", LONG):
                if waiter.ident is None and output.outputs[0].token_ids:  # not started yet
                    waiter.start()
                    stats = wait_idle_pending(engine)
                    assert stats["num_steps"] < FAILING_STEP  # it waited on a live engine
        waiter.join(HANG_GUARD_S)
        assert not waiter.is_alive(), "the pending utility call hangs"
        with pytest.raises(EngineDeadError, match=EXECUTOR_FAILURE):
            raise pending["error"]


def test_executor_failure_fails_astream_and_a_pending_async_utility_call():
    async def scenario(engine):
        waiter = None
        with pytest.raises(EngineDeadError, match=EXECUTOR_FAILURE):
            async for output in engine.astream("fail while I stream", LONG):
                if waiter is None and output.outputs[0].token_ids:
                    waiter = asyncio.create_task(engine.acall_utility("wait_idle", timeout=HANG_GUARD_S))
                    while (stats := await engine.aget_stats())["num_idle_waiters"] == 0:
                        await asyncio.sleep(0.005)  # a poll: the loop runs the waiter meanwhile
                    assert stats["num_steps"] < FAILING_STEP  # it waited on a live engine
        with pytest.raises(EngineDeadError, match=EXECUTOR_FAILURE):
            await asyncio.wait_for(waiter, HANG_GUARD_S)

    with Engine("builtin", mode="async", fail_at_step=FAILING_STEP) as engine:
        asyncio.run(scenario(engine))
        engine.restart(fail_at_step=None)
        assert engine.ping()


# ---- an IO thread that dies after startup --------------------------------------------------------------


def stream_then_kill_output_thread(engine, killed):
    """Stream; after the first token, make the output thread die (its last message answers that call)."""
    prompt = "lose my output thread"
    if engine.mode == "async":

        async def consume():
            async for output in engine.astream(prompt, LONG):
                if not killed.is_set() and output.outputs[0].token_ids:
                    killed.set()  # the stream is running: its answer may already come as the engine's death
                    await engine.acall_utility("debug_kill_io_thread", "output")

        asyncio.run(consume())
    else:
        for output in engine.stream(prompt, LONG):
            if not killed.is_set() and output.outputs[0].token_ids:
                killed.set()
                engine.call_utility("debug_kill_io_thread", "output")


def test_output_thread_death_is_an_engine_death(engine):
    pid = engine.engine_pid
    killed = threading.Event()
    error = run_until_fault(
        engine,
        lambda engine: stream_then_kill_output_thread(engine, killed),
        in_flight=killed.is_set,
        inject=lambda: None,
    )
    with pytest.raises(EngineDeadError, match=rf"pid {pid}\) exited with code 1(.|\n)*enginekit-output died"):
        raise error
    engine.restart()
    assert engine.ping()


def test_input_thread_death_is_an_engine_death(engine):
    pid = engine.engine_pid
    engine.call_utility("debug_kill_io_thread", "input")
    # The input thread dies on the next message it receives (this ping), which it never delivers.
    with pytest.raises(EngineDeadError, match=rf"pid {pid}\) exited with code 1(.|\n)*enginekit-input died"):
        engine.ping()
    engine.restart()
    assert engine.ping()


def test_debug_kill_io_thread_names_a_thread(engine):
    from enginekit import UtilityCallError

    with pytest.raises(UtilityCallError, match="name must be 'input' or 'output', got 'main'"):
        engine.call_utility("debug_kill_io_thread", "main")
    assert engine.ping()
