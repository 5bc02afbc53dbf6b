"""Load: a thousand requests at once with random aborts lose nothing; a stalled reader bounds the engine.

Continuous batching, prefix caching and preemption (a deliberately small KV cache) all run under load, and
every request that was not aborted must still produce exactly the greedy tokens its prompt produces alone.

Back-pressure: the engine process holds at most ``max_pending_outputs`` (default 64) output batches in its
output queue; past that its busy loop stops stepping until the front end reads again. Between the two
processes at most ``max_pending_outputs`` more wait in each socket's pipe (SNDHWM and RCVHWM) plus what the
operating system buffers. A front end that stops reading therefore stalls the engine instead of growing it.
"""

import logging
import random
import threading
import time

import psutil
import pytest

from enginekit import Engine, SamplingParams
from process_support import HANG_GUARD_S, LogWatch, generate_with_deltas, wait_for

NUM_REQUESTS = 1000
NUM_PROMPTS = 20
PROMPTS = [f"request family {i}: " + "abcdefghij"[: i % 10] * (1 + i % 3) for i in range(NUM_PROMPTS)]
PARAMS = [SamplingParams(max_tokens=8 + 3 * (i % 11), temperature=0) for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def engine():
    # 48 blocks of 16 tokens cannot hold 128 running requests: the scheduler preempts under this load.
    with Engine("builtin", mode="mp", num_kv_blocks=48) as engine:
        yield engine


def abort_randomly(engine, aborted, stop, rng):
    """Abort a random tenth of the engine's requests every few milliseconds (plus ids it no longer has)."""
    while not stop.is_set():
        request_ids = engine.call_utility("get_request_ids")
        if request_ids:
            chosen = rng.sample(request_ids, max(1, len(request_ids) // 10))
            aborted.update(chosen)
            engine.abort([*chosen, "no-such-request"])
        time.sleep(rng.uniform(0.005, 0.03))


def test_a_thousand_requests_with_random_aborts(engine):
    alone = [engine.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, PARAMS)]
    families = [i % NUM_PROMPTS for i in range(NUM_REQUESTS)]
    aborted: set[str] = set()
    stop = threading.Event()
    aborter = threading.Thread(target=abort_randomly, args=(engine, aborted, stop, random.Random(5)))
    aborter.start()
    try:
        outputs = engine.generate(
            [PROMPTS[f] for f in families], [PARAMS[f] for f in families], progress=False
        )
    finally:
        stop.set()
        aborter.join()
    num_aborted = 0
    for family, output in zip(families, outputs):
        completion = output.outputs[0]
        if completion.finish_reason == "abort":
            num_aborted += 1
            assert output.request_id in aborted
            assert completion.token_ids == alone[family][: len(completion.token_ids)]
        else:
            assert completion.token_ids == alone[family], f"request {output.request_id} ({family})"
            assert completion.finish_reason == "length"
    assert num_aborted > 0
    stats = engine.call_utility("wait_idle")
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0
    assert engine.call_utility("get_request_ids") == []
    assert stats["num_preemptions"] > 0  # the load did reach the preemption path


# ---- back-pressure ---------------------------------------------------------------------------------------

STALLED = "steps wait for the front end"  # the engine's log line when its output queue is full
RESUMED = "steps resume"
MAX_STALLED_RSS_GROWTH = 4 * 2**20


def test_a_reader_that_stops_reading_stalls_the_engine_instead_of_growing_it(caplog):
    # The engine's log lines reach the front end through the process's output, which a stalled socket leaves
    # alone: the stall and the resumption are events to wait for.
    caplog.set_level(logging.DEBUG, logger="enginekit")
    with LogWatch() as log, Engine("builtin", mode="mp", log_level="debug") as engine:
        client = engine.client
        released = threading.Event()
        handle_frames = client._handle_frames

        def stalled_reader(frames):  # the front end's receive thread stops reading the socket
            released.wait()
            return handle_frames(frames)

        client.receiver._handle_frames = stalled_reader
        # Wide batches: 64 requests, each token with 20 logprobs (two tensor frames per request).
        params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True, logprobs=20)
        generation = threading.Thread(
            target=generate_with_deltas,
            args=(engine, [f"reader {i}" for i in range(64)], params),
            daemon=True,
        )
        generation.start()
        log.wait_for(STALLED)
        process = psutil.Process(engine.engine_pid)
        stalled_rss = process.memory_info().rss
        time.sleep(1.0)  # a window to watch the stalled engine's memory in, not a wait for an event
        assert process.memory_info().rss - stalled_rss <= MAX_STALLED_RSS_GROWTH
        assert log.count(RESUMED) == 0  # it stepped no more while the reader stalled
        released.set()
        log.wait_for(RESUMED)

        steps_when_released = engine.call_utility("get_stats")["num_steps"]
        assert steps_when_released < params.max_tokens  # the engine had not run ahead through the work
        queue = engine.call_utility("debug_output_queue")
        # The output queue filled up to the bound, and never past it.
        assert queue["max_depth"] == queue["max_pending_outputs"] == 64
        wait_for(lambda: engine.call_utility("get_stats")["num_steps"] > steps_when_released, what="a step")
        engine.abort(engine.call_utility("get_request_ids"))
        generation.join(HANG_GUARD_S)
        assert not generation.is_alive()
        stats = engine.call_utility("wait_idle")
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
