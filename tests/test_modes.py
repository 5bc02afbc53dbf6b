"""The three modes give the same results; the background process handles every request type."""

import asyncio
import os
import stat
import threading
import time

import pytest
import torch

from enginekit import (
    Engine,
    EngineDeadError,
    EngineShutdownError,
    RequestOutputKind,
    SamplingParams,
    UtilityCallError,
)
from enginekit.client import SyncMPClient
from enginekit.config import EngineConfig
from enginekit.wire.messages import EngineCoreRequest, ShutdownRequest, WakeupRequest
from process_support import HANG_GUARD_S, in_thread, wait_until_generating

MODES = ["inproc", "mp", "async"]
PROMPTS = ["Parity across modes", "second prompt", "3", "The fourth one is a little longer than the rest"]


def run_workload(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=i) for i in range(4)]
    logprobs = SamplingParams(max_tokens=4, temperature=0, logprobs=2)
    results = {
        "greedy": engine.generate(PROMPTS, greedy),
        "seeded": engine.generate(PROMPTS, seeded),
        "logprobs": engine.generate(PROMPTS[:1], logprobs),
        # Chunk boundaries of a stream depend on timing; the final output does not.
        "stream": list(engine.stream(PROMPTS[0], greedy))[-1:],
        "async": asyncio.run(engine.agenerate(PROMPTS[1:3], greedy)),
    }
    return {
        key: [
            (o.outputs[0].token_ids, o.text, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs
        ]
        for key, outs in results.items()
    }


def without_logprob_values(results):
    return {
        key: [(*out[:3], [sorted(e) for e in out[3] or []]) for out in outs] for key, outs in results.items()
    }


def test_same_tokens_and_text_in_every_mode():
    results = {}
    for mode in MODES:
        with Engine("builtin", mode=mode) as engine:
            results[mode] = run_workload(engine)
    # Tokens, text and which tokens got logprobs are identical; the values themselves may differ in the last
    # bits, because the engine process and this one run torch with different thread counts by default.
    assert without_logprob_values(results["mp"]) == without_logprob_values(results["inproc"])
    assert without_logprob_values(results["async"]) == without_logprob_values(results["inproc"])
    for mode in ("mp", "async"):
        for got, expected in zip(results[mode]["logprobs"][0][3], results["inproc"]["logprobs"][0][3]):
            assert {t: e.logprob for t, e in got.items()} == pytest.approx(
                {t: e.logprob for t, e in expected.items()}, abs=1e-4
            )
            assert {t: (e.rank, e.decoded_token) for t, e in got.items()} == {
                t: (e.rank, e.decoded_token) for t, e in expected.items()
            }
    # The logprobs tensors crossed the process boundary intact.
    logprobs = results["mp"]["logprobs"][0][3]
    assert len(logprobs) == 4 and all(len(entry) >= 2 for entry in logprobs)


@pytest.fixture(scope="module", params=["mp", "async"])
def engine(request):
    with Engine("builtin", mode=request.param) as engine:
        yield engine


def test_abort_mid_stream(engine):
    stream = engine.stream("Abort this one", SamplingParams(max_tokens=500, temperature=0))
    first = next(stream)
    engine.abort(first.request_id)
    last = list(stream)[-1]
    assert last.outputs[0].finish_reason == "abort"
    stats = engine.call_utility("wait_idle")
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_utility_calls(engine):
    assert engine.ping()
    stats = engine.get_stats()
    assert stats["engine_pid"] != os.getpid() and stats["mode"] == engine.mode
    assert {"num_running_requests", "kv_cache_usage", "prefix_cache_hit_rate"} <= set(stats)
    assert engine.reset_prefix_cache() is True
    assert engine.call_utility("sleep", 0.01) == 0.01


def test_unknown_utility_fails_clearly_and_engine_lives(engine):
    with pytest.raises(UtilityCallError, match="unknown utility method 'frobnicate'"):
        engine.call_utility("frobnicate", 1)
    with pytest.raises(UtilityCallError, match="TypeError"):
        engine.call_utility("sleep")  # missing argument
    assert engine.ping()


BUSY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_utility_returning_a_future_answers_when_done(engine):
    # wait_idle is asked while the request runs (it has produced a token), so its Future completes only when the
    # request has ended: the stats it answers with count all 40 of its tokens.
    before = engine.get_stats()["num_generated_tokens"]
    if engine.mode == "async":
        stats = asyncio.run(_busy_then_wait_idle(engine))
    else:
        worker, _ = in_thread(lambda: engine.generate("Keep busy", BUSY))
        wait_until_generating(engine)
        stats = engine.call_utility("wait_idle", timeout=HANG_GUARD_S)
        worker.join(HANG_GUARD_S)
    assert stats["num_running_requests"] == 0 and stats["num_generated_tokens"] == before + 40


async def _busy_then_wait_idle(engine):
    task = asyncio.create_task(engine.agenerate("Keep busy", BUSY))
    deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
    while not any(state.version for state in list(engine._router.processor.states.values())):
        assert asyncio.get_running_loop().time() < deadline, "the request never started"
        await asyncio.sleep(0.005)  # a poll: the loop runs the request meanwhile
    stats = await engine.acall_utility("wait_idle", timeout=HANG_GUARD_S)
    await task
    return stats


def test_utility_timeout(engine):
    # The utility sleeps a hundred times the timeout: a caller descheduled past its deadline still finds no answer.
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.05s"):
        engine.call_utility("sleep", 5.0, timeout=0.05)
    assert engine.ping()


def test_an_async_utility_call_raises_at_its_timeout_and_a_cancelled_one_leaves_nothing_pending():
    async def calls(engine):
        with pytest.raises(TimeoutError, match=r"utility 'sleep' did not answer within 0\.05s"):
            await engine.acall_utility("sleep", 2.0, timeout=0.05)
        waiter = asyncio.create_task(engine.acall_utility("ping", timeout=HANG_GUARD_S))
        await asyncio.sleep(0)  # one pass of the loop: the call is sent and awaits its answer
        assert len(engine.client._pending) == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return await engine.acall_utility("ping", timeout=HANG_GUARD_S)  # answered after the sleep

    with Engine("builtin", mode="async", num_kv_blocks=16) as engine:
        assert asyncio.run(calls(engine)) == "pong"
        assert len(engine.client._pending) == 0


@pytest.mark.parametrize("mode", ["inproc", "mp", "async"])
def test_ping_is_false_while_the_engine_cannot_answer_in_time_and_true_once_it_can(mode):
    with Engine("builtin", mode=mode, num_kv_blocks=64) as engine:
        with pytest.raises(TimeoutError):
            engine.call_utility("sleep", 6.0, timeout=0.01)  # it reached the engine, which now sleeps 6 s
        assert engine.ping(timeout=0.2) is False  # queued behind the sleep
        assert engine.ping(timeout=120) is True  # the hang guard: it answers once the sleep is over


def test_prompt_embeds_cross_the_process_boundary(engine):
    with Engine("builtin", mode="inproc") as local:
        ids = local.tokenizer.encode("Embeddings travel as tensor frames")
        weight = local.client.core.runner.model.embed_tokens.weight
        embeds = weight[torch.tensor(ids)].clone()
        expected = local.generate(ids, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    out = engine.generate({"prompt_embeds": embeds}, SamplingParams(max_tokens=6, temperature=0))
    assert out[0].outputs[0].token_ids == expected


def test_wakeup_does_nothing(engine):
    engine.client._send(WakeupRequest())
    assert engine.ping()


def test_ipc_sockets_in_a_private_directory_removed_on_shutdown():
    engine = Engine("builtin", mode="mp")
    run_dir = engine.client.sockets.run_dir
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert sorted(os.listdir(run_dir)) == ["input.sock", "output.sock"]
    other = Engine("builtin", mode="mp")
    assert other.client.sockets.run_dir != run_dir
    other.shutdown()
    engine.shutdown()
    assert not os.path.exists(run_dir)


def test_calls_after_shutdown_raise_shutdown_error():
    engine = Engine("builtin", mode="mp")
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(EngineShutdownError, match=r"call engine.restart\(\)"):
        engine.generate("x")
    engine.restart(mode="inproc")
    assert engine.generate("x", SamplingParams(max_tokens=2))[0].finished
    engine.shutdown()


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_injected_executor_failure_is_an_engine_death(mode):
    engine = Engine("builtin", mode=mode, fail_at_step=3)
    try:
        with pytest.raises(EngineDeadError, match=r"fatal error.*exited with code 1") as info:
            engine.generate("die", SamplingParams(max_tokens=20))
        assert "injected executor failure at step 3" in str(info.value)
        assert "Executor failed" in str(info.value)
        with pytest.raises(EngineDeadError):
            engine.ping()
        engine.restart(fail_at_step=None)
        assert engine.ping()
    finally:
        engine.shutdown()


# ---- the engine process's shutdown protocol, at the client level ----------------------------------------


def collect_until_finished(client, request_ids):
    finished = {}
    while len(finished) < len(request_ids):
        batch = client.get_output(timeout=30)
        assert batch is not None, "no output within 30 s"
        for out in batch.outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out
    return finished


def add(client, request_id, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    client.add_request(EngineCoreRequest(request_id, [1, 70, 71, 72], params))


def test_shutdown_with_timeout_zero_aborts_every_request():
    client = SyncMPClient(EngineConfig(model="builtin"))
    try:
        for i in range(3):
            add(client, f"r{i}", 10_000)
        client.get_output(timeout=30)  # they are running
        client._send(ShutdownRequest(0.0))
        finished = collect_until_finished(client, ["r0", "r1", "r2"])
        assert {out.finish_reason.value for out in finished.values()} == {"abort"}
        assert client.process.wait_dead(HANG_GUARD_S) and client.process.returncode() == 0
    finally:
        client.shutdown()


def test_shutdown_with_timeout_drains_and_rejects_new_work():
    client = SyncMPClient(EngineConfig(model="builtin"))
    try:
        add(client, "running", 30)
        client.get_output(timeout=30)
        client._send(ShutdownRequest(60.0))
        add(client, "late", 5)
        with pytest.raises(UtilityCallError, match="Server shutting down"):
            client.call_utility("ping", timeout=30)
        finished = collect_until_finished(client, ["running", "late"])
        assert finished["running"].finish_reason.value == "length"
        assert (finished["late"].finish_reason.value, finished["late"].stop_reason) == (
            "abort",
            "engine shutting down",
        )
        assert client.process.wait_dead(HANG_GUARD_S) and client.process.returncode() == 0
    finally:
        client.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_a_slow_stream_consumer_still_gets_the_final_output(mode):
    async def consume(engine):
        last = None
        async for out in engine.astream("slow consumer", SamplingParams(max_tokens=12, temperature=0)):
            if last is None:  # the request finishes while the consumer holds its first snapshot
                await engine.acall_utility("wait_idle", timeout=HANG_GUARD_S)
            last = out
        return last

    with Engine("builtin", mode=mode) as engine:
        last = asyncio.run(consume(engine))
        streamed = list(engine.stream("slow consumer", SamplingParams(max_tokens=12, temperature=0)))
    assert last.finished and len(last.outputs[0].token_ids) == 12
    assert streamed[-1].finished and streamed[-1].text == last.text


@pytest.mark.parametrize("mode", MODES)
def test_many_concurrent_agenerate_calls_all_finish(mode):
    async def many(engine):
        async def one(i):
            await asyncio.sleep(0.001 * i)  # staggered arrivals
            return await engine.agenerate(f"prompt {i}", SamplingParams(max_tokens=6, temperature=0))

        return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(48)]), 120)

    with Engine("builtin", mode=mode) as engine:
        results = asyncio.run(many(engine))
        alone = engine.generate("prompt 7", SamplingParams(max_tokens=6, temperature=0))[0]
    assert all(r[0].finished and len(r[0].outputs[0].token_ids) == 6 for r in results)
    assert results[7][0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_sync_streams_in_async_mode_never_lose_a_token():
    # Outside a loop each chunk of a sync stream runs on a fresh asyncio.run, which cancels the output task
    # at its end: a cancelled receive must never drop a message it had already taken off the socket.
    params = SamplingParams(max_tokens=12, temperature=0)
    with Engine("builtin", mode="inproc") as engine:
        expected = engine.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    with Engine("builtin", mode="async") as engine:
        for _ in range(40):
            assert list(engine.stream(PROMPTS[0], params))[-1].outputs[0].token_ids == expected


@pytest.mark.parametrize("mode", MODES)
def test_max_tokens_none_generates_up_to_the_context(mode):
    with Engine("builtin", mode=mode, max_model_len=40, num_kv_blocks=16) as engine:
        prompt = engine.tokenizer.encode("twelve bytes")
        params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
        out = engine.generate(prompt, params)[0].outputs[0]
        assert len(out.token_ids) == 40 - len(prompt) and out.finish_reason == "length"


def test_an_inproc_utility_call_raises_at_its_timeout_while_the_utility_still_runs():
    with Engine("builtin", mode="inproc", num_kv_blocks=16) as engine:
        with pytest.raises(TimeoutError, match=r"utility 'sleep' did not answer within 0\.2s"):
            engine.call_utility("sleep", 5.0, timeout=0.2)  # 25 times the timeout: it still runs after it
        # As with an engine process: the caller's deadline holds, the engine is busy until the utility ends.
        assert any(thread.name == "enginekit-utility" for thread in threading.enumerate())
        assert engine.ping()
        assert engine.generate("after", SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize("mode", MODES)
def test_cumulative_logprob_sums_the_sampled_tokens_logprobs_when_asked(mode):
    # vLLM's meaning: the sum of the sampled tokens' logprobs when logprobs were requested, else None.
    with Engine("builtin", mode=mode, num_kv_blocks=16) as engine:
        asked = SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=0, n=2)
        for sample in engine.generate("sum me", asked)[0].outputs:
            sampled = [entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids)]
            assert sample.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-5)
            assert sample.cumulative_logprob < 0
        delta = SamplingParams(max_tokens=5, temperature=0, logprobs=1, output_kind=RequestOutputKind.DELTA)
        pieces = [out.outputs[0] for out in engine.stream("sum me", delta)]
        total = sum(entry[token].logprob for p in pieces for entry, token in zip(p.logprobs, p.token_ids))
        assert pieces[-1].cumulative_logprob == pytest.approx(total, abs=1e-5)  # the whole sum, as in vLLM
        plain = engine.generate("sum me", SamplingParams(max_tokens=3))[0].outputs[0]
        assert plain.cumulative_logprob is None


@pytest.mark.parametrize("mode", ["inproc", "mp", "async"])
def test_a_threads_stream_ends_when_another_thread_routes_its_last_output(mode, monkeypatch):
    # Eight threads stream at once; each batch holds all their updates and one thread routes it. The others must
    # wake for their own updates, the last ones included: no batch comes after them. With the blocking wait's
    # guard set past the hang guard, a thread that waited for another batch instead would never end in time.
    from enginekit.frontend import output_router

    monkeypatch.setattr(output_router, "_POLL_S", 10 * HANG_GUARD_S)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Engine("builtin", mode=mode, num_kv_blocks=128) as engine:
        for _ in range(3):
            ends, errors = [], []

            def consume(index, ends=ends, errors=errors):
                try:
                    ends.append(list(engine.stream(f"thread {index}", params))[-1])
                except BaseException as error:
                    errors.append(error)

            threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(8)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + HANG_GUARD_S
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            assert not errors and not any(thread.is_alive() for thread in threads)
            assert len(ends) == 8 and all(o.finished and len(o.outputs[0].token_ids) == 24 for o in ends)
