"""Failure paths that used to hang, leak or raise the wrong error — each done for real, in every mode it concerns."""

import asyncio
import gc
import logging
import os
import socket
import threading
import weakref

import pytest
import torch

from enginekit import Engine, EngineShutdownError, EngineStartupError, SamplingParams
from enginekit.diagnostics import snapshot, wait_until_clean
from enginekit.errors import EngineDeadError
from enginekit.runtime.launcher import Launcher
from process_support import HANG_GUARD_S, LogWatch, in_thread, wait_for

MODES = ["inproc", "mp", "async"]
LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0)


def generating(engine) -> bool:
    return any(state.version for state in list(engine._router.processor.states.values()))


@pytest.mark.parametrize("mode", MODES)
def test_wait_idle_returns_when_the_last_requests_end_by_abort(mode):
    with Engine("builtin", mode=mode, num_kv_blocks=64) as engine:
        # In-process, the generating thread and the waiting one share the core under the client's lock.
        worker, generated = in_thread(lambda: engine.generate(["a", "b"], LONG))
        wait_for(lambda: generating(engine))
        waiter, stats = in_thread(lambda: engine.call_utility("wait_idle", timeout=HANG_GUARD_S))
        wait_for(lambda: engine.get_stats()["num_idle_waiters"] == 1, what="wait_idle reaching the engine")
        engine.abort(engine.call_utility("get_request_ids"))
        waiter.join(HANG_GUARD_S)
        assert not waiter.is_alive(), "wait_idle still waits after every request was aborted"
        assert stats[0]["num_running_requests"] == 0 and stats[0]["num_idle_waiters"] == 0
        worker.join(HANG_GUARD_S)
        assert [output.outputs[0].finish_reason for output in generated[0]] == ["abort", "abort"]


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_from_another_thread_during_generate_is_not_a_death(mode):
    engine = Engine("builtin", mode=mode, num_kv_blocks=64)
    worker, outcome = in_thread(lambda: engine.generate("stop me", LONG))
    wait_for(lambda: generating(engine))
    engine.shutdown()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive()
    assert isinstance(outcome[0], EngineShutdownError), repr(outcome[0])
    assert not isinstance(outcome[0], EngineDeadError)


def test_a_failed_in_process_engine_frees_its_model_and_cache_even_if_the_error_is_kept():
    engine = Engine("builtin", mode="inproc", num_kv_blocks=64, fail_at_step=3)
    core = engine.client.core
    refs = [
        weakref.ref(core.runner.model.embed_tokens.weight),
        *(weakref.ref(t) for t in core.runner.kv_caches),
    ]
    del core
    with pytest.raises(EngineDeadError, match="injected executor failure") as info:
        engine.generate("fail", SHORT)
    kept = info.value  # as IPython keeps sys.last_value and sys.last_traceback
    kept_traceback = kept.__traceback__
    engine.shutdown()
    gc.collect()
    assert all(ref() is None for ref in refs), "the model or the KV cache outlived the failure"
    del kept, kept_traceback
    engine.restart(fail_at_step=None)
    assert engine.generate("alive", SHORT)[0].finished
    engine.shutdown()


def test_an_engine_core_that_fails_partway_frees_what_it_built(monkeypatch):
    from enginekit.core import model_start

    built = []
    real_load_model = model_start.load_model

    def load_model(*args, **kwargs):
        model = real_load_model(*args, **kwargs)
        built.append(weakref.ref(model.embed_tokens.weight))
        return model

    def no_cache(*args, **kwargs):
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(model_start, "load_model", load_model)
    monkeypatch.setattr(model_start, "ModelRunner", no_cache)
    with pytest.raises(RuntimeError, match="no memory for the KV cache") as info:
        Engine("builtin", mode="inproc")
    kept = info.value  # noqa: F841  (kept alive, as a notebook would)
    gc.collect()
    assert built and built[0]() is None


def test_concurrent_prompt_embeds_submissions_never_lose_a_tensor_frame():
    with Engine("builtin", mode="inproc") as local:
        weight = local.client.core.runner.model.embed_tokens.weight
        prompts = [local.tokenizer.encode(f"embedding prompt {i}") for i in range(8)]
        embeds = [weight[torch.tensor(ids)].clone() for ids in prompts]
        expected = [local.generate(ids, SHORT)[0].outputs[0].token_ids for ids in prompts]
    with Engine("builtin", mode="mp") as engine:

        def submit(offset):
            return [engine.generate({"prompt_embeds": embeds[i]}, SHORT)[0] for i in range(offset, 8, 2)]

        results = {}
        threads = [
            threading.Thread(target=lambda o=o: results.update({o: submit(o) + submit(o)})) for o in (0, 1)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a request hangs"
        for offset, outputs in results.items():
            tokens = [o.outputs[0].token_ids for o in outputs]
            assert tokens == [expected[i] for i in range(offset, 8, 2)] * 2


@pytest.mark.parametrize("mode", MODES)
def test_prompt_embeds_are_copied_at_submission(mode):
    with Engine("builtin", mode=mode) as engine:
        ids = engine.tokenizer.encode("copy my embeddings")
        if mode == "inproc":
            weight = engine.client.core.runner.model.embed_tokens.weight
        else:
            with Engine("builtin", mode="inproc") as local:
                weight = local.client.core.runner.model.embed_tokens.weight.clone()
        embeds = weight[torch.tensor(ids)].clone()
        expected = engine.generate({"prompt_embeds": embeds}, SHORT)[0].outputs[0].token_ids

        async def submit_then_change():
            pending = engine.agenerate({"prompt_embeds": embeds}, SHORT)  # submitted now
            embeds.zero_()  # the caller reuses its tensor
            return await pending

        assert asyncio.run(submit_then_change())[0].outputs[0].token_ids == expected


def test_a_port_in_use_is_a_startup_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            EngineStartupError, match=rf"cannot bind the engine's sockets at tcp://127.0.0.1:{port}"
        ):
            Engine("builtin", mode="mp", address=f"tcp://127.0.0.1:{port}")
    finally:
        taken.close()


def test_a_failing_pidfd_open_leaks_no_pipe(monkeypatch):
    Launcher.shared()
    before = snapshot()

    def no_pidfd(pid, flags=0):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    with pytest.raises(EngineStartupError, match="Too many open files"):
        Engine("builtin", mode="mp")
    monkeypatch.undo()
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


@pytest.mark.parametrize(
    ("options", "exception", "message"),
    [
        (
            {"max_num_seq": 3},
            TypeError,
            r"unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'\?",
        ),
        ({"mode": "bogus"}, ValueError, r"mode must be one of 'inproc', 'mp', 'async', got 'bogus'"),
        ({"num_kv_blocks": -5}, ValueError, r"num_kv_blocks must be at least 2, got -5"),
        (
            {"dtype": "fp16"},
            ValueError,
            r"engine option dtype must be one of 'float32', 'float16', 'bfloat16' or None",
        ),
    ],
)
def test_restart_with_a_bad_argument_keeps_the_running_engine(options, exception, message):
    with Engine("builtin", mode="mp") as engine:
        pid = engine.engine_pid
        with pytest.raises(exception, match=message):
            engine.restart(**options)
        assert engine.is_running and engine.engine_pid == pid
        assert engine.generate("still here", SHORT)[0].finished


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(
            {"device": "cuda"},
            r"device='cuda' was asked for but CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
        ({"model": "/bad.gguf"}, r"model '/bad.gguf' is not a local folder or file"),
        ({"max_model_len": 10**6}, r"max_model_len=1000000 exceeds the model's limit of 4096 positions"),
        ({"max_model_len": 4000, "num_kv_blocks": 8}, r"max_model_len=4000 does not fit the KV cache"),
    ],
)
def test_restart_that_cannot_start_keeps_the_engine_and_its_config(options, message):
    with Engine("builtin", mode="mp", num_kv_blocks=64) as engine:
        pid, config = engine.engine_pid, engine.config
        with pytest.raises(EngineStartupError, match=message):
            engine.restart(**options)
        assert engine.is_running and engine.engine_pid == pid  # checked before the running engine stopped
        assert engine.config == config
        assert engine.generate("still here", SHORT)[0].finished
        engine.restart()  # the bad option was not kept
        assert engine.is_running and engine.engine_pid != pid


def test_restart_whose_new_engine_fails_to_start_starts_the_previous_one_again():
    with Engine("builtin", mode="mp", num_kv_blocks=64) as engine:
        config = engine.config
        with pytest.raises(EngineStartupError, match="did not report READY") as info:
            engine.restart(debug_load_delay_s=60, startup_timeout=1.0)  # fails only once started
        assert (
            "the previous mode and config are kept, and the previous engine runs again"
            in info.value.__notes__
        )
        assert engine.config == config and engine.is_running
        assert engine.generate("back again", SHORT)[0].finished


def test_a_kv_cache_budget_below_two_blocks_is_refused():
    with pytest.raises(EngineStartupError, match=r"kv_cache_memory_bytes=1 holds less than the 2 KV blocks"):
        Engine("builtin", mode="inproc", kv_cache_memory_bytes=1)


def test_async_mode_serves_blocking_calls_from_two_threads():
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = [f"thread prompt {i}" for i in range(15)]
    with Engine("builtin", mode="inproc") as local:
        expected = [o.outputs[0].token_ids for o in local.generate(prompts, params)]
    with Engine("builtin", mode="async") as engine:
        results = [[], []]

        def run(index):
            for prompt in prompts:
                results[index].append(engine.generate(prompt, params)[0].outputs[0].token_ids)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a thread hangs"
        assert results == [expected, expected]


def test_async_mode_refuses_a_blocking_call_while_another_threads_loop_drives_it():
    with Engine("builtin", mode="async") as engine:
        started = threading.Event()

        async def drive():
            pending = engine.agenerate(
                "the loop's own request", SamplingParams(max_tokens=300, ignore_eos=True)
            )
            started.set()
            return await pending

        loop_thread, outcome = in_thread(lambda: asyncio.run(drive()))
        started.wait(30)
        wait_for(lambda: generating(engine))
        with pytest.raises(
            RuntimeError, match=r"driven by an asyncio loop running in another thread.*mode='mp'"
        ):
            engine.generate("from another thread", SHORT)
        loop_thread.join(120)
        assert outcome[0][0].finished
        assert engine.generate("the loop is gone: this thread may drive it now", SHORT)[0].finished


def test_a_draining_shutdown_with_a_stalled_reader_ends_the_process(caplog):
    from process_support import wait_gone

    caplog.set_level(logging.DEBUG, logger="enginekit")
    with LogWatch() as log:
        engine = Engine("builtin", mode="mp", num_kv_blocks=64, max_pending_outputs=4, log_level="debug")
        pid, receiver = engine.engine_pid, engine.client.receiver
        released = threading.Event()
        handle_frames = receiver._handle_frames

        def stalled(frames):  # the front end stops reading outputs
            released.wait()
            return handle_frames(frames)

        receiver._handle_frames = stalled
        params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True, logprobs=20)
        in_thread(lambda: engine.generate([f"stall {i}" for i in range(16)], params))
        log.wait_for("steps wait for the front end")  # its output queue and the socket are full
        stopper, _ = in_thread(lambda: engine.shutdown(timeout=1.0))
        stopper.join(HANG_GUARD_S)
        assert not stopper.is_alive(), "a draining shutdown hangs on a stalled reader"
        released.set()
        assert wait_gone([pid]) == []
