"""Data parallelism: N engine processes behind one facade (internal load balancing), or one rank per front end
(external). Results never depend on N; a rank's death is the engine's death; restart brings every rank back."""

import asyncio
import os
import signal

import pytest

from enginekit import Engine, EngineDeadError, SamplingParams
from enginekit.diagnostics import snapshot, wait_until_clean
from enginekit.runtime.launcher import Launcher
from process_support import HANG_GUARD_S, in_thread, wait_gone, wait_until_generating

PROMPTS = [f"data parallel prompt {i}: " + "x" * i for i in range(12)]
GREEDY = SamplingParams(max_tokens=10, temperature=0)
SEEDED = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=i) for i in range(12)]
LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference():
    with Engine("builtin", mode="mp") as engine:
        return tokens(engine.generate(PROMPTS, GREEDY)), tokens(engine.generate(PROMPTS, SEEDED))


@pytest.fixture(scope="module", params=["mp", "async"])
def engine(request):
    with Engine("builtin", mode=request.param, data_parallel_size=2, num_kv_blocks=128) as engine:
        yield engine


def test_two_ranks_give_the_tokens_of_one(engine, reference):
    greedy, seeded = reference
    assert tokens(engine.generate(PROMPTS, GREEDY)) == greedy
    assert tokens(engine.generate(PROMPTS, SEEDED)) == seeded
    # Another arrival order and batch: a request's seed alone decides its tokens.
    order = list(reversed(range(len(PROMPTS))))
    shuffled = engine.generate([PROMPTS[i] for i in order], [SEEDED[i] for i in order])
    assert tokens(shuffled) == [seeded[i] for i in order]


def test_requests_are_spread_over_both_ranks(engine):
    before = [rank["num_generated_tokens"] for rank in engine.get_stats()["ranks"]]
    engine.generate(PROMPTS, GREEDY)
    stats = engine.get_stats()
    after = [rank["num_generated_tokens"] for rank in stats["ranks"]]
    assert all(a - b == 60 for a, b in zip(after, before))  # 12 requests x 10 tokens, 6 on each rank
    assert stats["num_generated_tokens"] == sum(after)
    assert len(set(engine.client.engine_pids)) == 2 and engine.engine_pid == engine.client.engine_pids[0]


def test_async_calls_and_streams_merge_the_ranks_outputs(engine, reference):
    greedy, _ = reference

    async def run():
        first = await engine.agenerate(PROMPTS[:6], GREEDY)
        streamed = []
        for prompt in PROMPTS[6:8]:
            streamed.append([chunk async for chunk in engine.astream(prompt, GREEDY)][-1])
        return tokens(first) + tokens(streamed)

    assert asyncio.run(run()) == greedy[:8]
    assert [list(engine.stream(p, GREEDY))[-1].outputs[0].token_ids for p in PROMPTS[8:10]] == greedy[8:10]


def test_utilities_go_to_one_rank_or_to_each(engine):
    assert engine.call_utility("ping") == ["pong", "pong"]
    assert engine.call_utility("ping", rank=1) == "pong"
    with pytest.raises(ValueError, match=r"rank must be one of \[0, 1\], got 5"):
        engine.call_utility("ping", rank=5)
    stats = engine.get_stats()
    assert [rank["num_kv_blocks"] for rank in stats["ranks"]] == [128, 128] and stats["num_kv_blocks"] == 256


def test_merged_stats_sum_the_counts_and_name_no_rank(engine):
    """A merged dict speaks for every rank: counts are summed, a rank's identity is only under ``ranks`` (summed, two
    ranks' 0 + 1 read as rank 1), and what every rank says alike (the grammar backend) is kept."""
    stats = engine.get_stats()
    assert "data_parallel_rank" not in stats
    assert [rank["data_parallel_rank"] for rank in stats["ranks"]] == [0, 1]
    assert stats["num_free_kv_blocks"] == sum(rank["num_free_kv_blocks"] for rank in stats["ranks"])
    assert stats["structured_outputs_backend"] == "llguidance"
    assert stats["uptime_s"] == max(rank["uptime_s"] for rank in stats["ranks"])


def test_facade_methods_return_the_same_type_as_with_one_rank(engine):
    assert engine.ping() is True
    assert engine.reset_prefix_cache() is True  # idle: both ranks forgot their prefix cache
    assert isinstance(engine.get_stats(), dict)


def test_the_samples_of_one_prompt_stay_on_one_rank(engine):
    before = [rank["num_generated_tokens"] for rank in engine.get_stats()["ranks"]]
    prompt = "one prompt, four samples: " + "p" * 40  # three full blocks the samples share
    engine.generate(prompt, SamplingParams(n=4, max_tokens=10, temperature=0.8, seed=1))
    stats = engine.get_stats()["ranks"]
    grown = sorted(rank["num_generated_tokens"] - b for rank, b in zip(stats, before))
    assert grown == [0, 40]


def test_an_abort_follows_its_request_to_its_rank(engine):
    stream = engine.stream("abort me on my rank", LONG)
    first = next(stream)
    other = engine.stream("and me on the other", LONG)
    next(other)
    engine.abort([first.request_id])
    assert list(stream)[-1].outputs[0].finish_reason == "abort"
    other.close()
    stats = engine.call_utility("wait_idle")
    assert all(rank["num_free_kv_blocks"] == rank["num_kv_blocks"] for rank in stats)


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_a_dead_rank_is_the_engines_death_and_restart_brings_both_back(mode):
    engine = Engine("builtin", mode=mode, data_parallel_size=2, num_kv_blocks=64)
    try:
        pids = list(engine.client.engine_pids)
        worker, outcome = in_thread(lambda: engine.generate(PROMPTS[:4], LONG))
        wait_until_generating(engine)
        os.kill(pids[1], signal.SIGKILL)
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive(), "generate still waits after a rank died"
        with pytest.raises(
            EngineDeadError, match=rf"engine rank 1: the engine process died; .*pid {pids[1]}\) was killed"
        ):
            raise outcome[0]
        with pytest.raises(EngineDeadError, match="engine rank 1"):
            engine.call_utility("ping", rank=0)  # every rank's calls fail, not only the dead one's
        engine.restart()
        assert engine.call_utility("ping") == ["pong", "pong"]
        assert not set(engine.client.engine_pids) & set(pids)
        assert wait_gone([pids[0]]) == []  # the surviving rank was stopped by the restart
    finally:
        engine.shutdown()


def test_shutdown_leaves_no_process_thread_or_file_behind():
    Launcher.shared()
    before = snapshot()
    engine = Engine("builtin", mode="mp", data_parallel_size=2)
    pids, run_dir = engine.client.engine_pids, engine.client.sockets.run_dir
    engine.generate(PROMPTS[:4], GREEDY)
    engine.shutdown()
    assert wait_gone(pids) == [] and not os.path.exists(run_dir)
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


def test_external_load_balancing_starts_one_rank(reference):
    greedy, _ = reference
    with Engine("builtin", mode="mp", data_parallel_size=2, data_parallel_rank=1) as engine:
        assert len(engine.client.engines) == 1 and engine.client.ranks == [1]
        assert engine.client.engines[0].identity == b"engine-1"
        assert engine.call_utility("ping") == "pong"
        assert tokens(engine.generate(PROMPTS, GREEDY)) == greedy
        assert engine.get_stats()["data_parallel_rank"] == 1


@pytest.mark.parametrize(
    ("options", "mode", "message"),
    [
        ({"data_parallel_size": 0}, "mp", r"data_parallel_size must be at least 1, got 0"),
        (
            {"data_parallel_size": 2, "data_parallel_rank": 2},
            "mp",
            r"data_parallel_rank must be in \[0, data_parallel_size=2\), got 2",
        ),
        (
            {"data_parallel_size": 2, "data_parallel_rank": 0, "data_parallel_load_balancing": "internal"},
            "mp",
            r"data_parallel_rank=0 starts one rank, which needs external load balancing",
        ),
        (
            {"data_parallel_size": 2, "data_parallel_load_balancing": "external"},
            "mp",
            r"give data_parallel_rank",
        ),
        ({"data_parallel_size": 2}, "inproc", r"mode='inproc' runs one engine core in this process"),
        ({"data_parallel_size": 64}, "mp", r"data_parallel_size=64 needs a CPU core per rank"),
        ({"data_parallel_size": 2, "device": "cuda"}, "mp", r"data_parallel_size=2 needs 2 CUDA devices"),
    ],
)
def test_bad_data_parallel_options_fail_before_anything_starts(options, mode, message):
    with pytest.raises(ValueError, match=message):
        Engine("builtin", mode=mode, **options)
