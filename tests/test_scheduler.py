"""Scheduler: continuous batching, chunked prefill under the token budget, max_num_seqs, preemption."""

from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.request import Request, RequestStatus
from enginekit.core.scheduler import Scheduler
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import EngineCoreRequest, FinishReason

BLOCK = 4


def make(num_blocks=32, max_num_seqs=8, budget=64, prefix=False) -> Scheduler:
    cache = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    return Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def add(scheduler: Scheduler, request_id: str, num_tokens: int) -> Request:
    req = Request(
        EngineCoreRequest(request_id, list(range(1, num_tokens + 1)), SamplingParams()), detokenizer=None
    )
    scheduler.add_request(req)
    return req


def run(scheduler: Scheduler) -> dict[str, int]:
    """Schedule one step and apply it as the engine core would (one new token per finished prefill)."""
    output = scheduler.schedule()
    for req, num_new in output.scheduled:
        req.num_computed_tokens += num_new
        scheduler.kv_cache.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(7)
    return {req.request_id: num_new for req, num_new in output.scheduled}


def test_waiting_requests_join_and_running_ones_decode_one_token():
    scheduler = make()
    add(scheduler, "a", 5)
    assert run(scheduler) == {"a": 5}
    add(scheduler, "b", 3)
    assert run(scheduler) == {"a": 1, "b": 3}
    assert run(scheduler) == {"a": 1, "b": 1}


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget():
    scheduler = make(budget=8)
    add(scheduler, "long", 20)
    assert [run(scheduler) for _ in range(3)] == [{"long": 8}, {"long": 8}, {"long": 4}]
    assert run(scheduler) == {"long": 1}


def test_the_budget_is_shared_and_running_requests_come_first():
    scheduler = make(budget=6)
    add(scheduler, "a", 4)
    run(scheduler)
    add(scheduler, "b", 10)
    assert run(scheduler) == {"a": 1, "b": 5}


def test_max_num_seqs_bounds_the_running_set():
    scheduler = make(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 2)
    assert set(run(scheduler)) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_when_blocks_run_out_the_newest_running_request_is_preempted():
    scheduler = make(num_blocks=4, budget=64)
    first, second = add(scheduler, "first", 8), add(scheduler, "second", 7)  # 2 blocks each
    run(scheduler)
    assert scheduler.kv_cache.pool.num_free_blocks == 0
    scheduled = run(scheduler)  # "first" needs a third block: "second" gives its blocks back
    assert scheduled == {"first": 1}
    assert second.status is RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert scheduler.waiting[0] is second and scheduler.num_preemptions == 1
    assert first.status is RequestStatus.RUNNING


def test_finishing_a_request_frees_its_blocks_and_forgets_it():
    scheduler = make()
    req = add(scheduler, "a", 9)
    run(scheduler)
    scheduler.finish_request(req, FinishReason.ABORT)
    assert scheduler.kv_cache.pool.num_free_blocks == 32
    assert not scheduler.has_unfinished_requests() and req.is_finished
    scheduler.finish_request(req, FinishReason.ABORT)  # idempotent


def test_a_cached_prefix_is_not_computed_again():
    scheduler = make(prefix=True)
    add(scheduler, "a", 12)
    run(scheduler)
    b = add(scheduler, "b", 12)
    assert run(scheduler)["b"] == 4  # two of its three blocks were cached; the last is recomputed
    assert b.num_cached_tokens == 8


def test_a_longrope_sequence_past_the_original_length_is_computed_again():
    """With longrope, every token of a sequence longer than the original length reads the long factors: the step
    after one grows past it (here 8 tokens), its cache is computed again from the start, in the long hash chain."""
    cache = KVCacheManager(32, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64, long_rope_from=8)
    short = add(scheduler, "short", 7)
    assert run(scheduler) == {"short": 7}  # 8 tokens now: still short-rotated
    assert run(scheduler) == {"short": 1} and not short.rope_long  # 9 tokens now
    assert run(scheduler) == {"short": 9} and short.rope_long  # all of it again, long-rotated
    assert short.num_preemptions == 0 and scheduler.num_preemptions == 0
    assert run(scheduler) == {"short": 1}
    # The same first 7 tokens, short-rotated: the block "short" cached before it turned long fits (4 tokens)
    twin = add(scheduler, "twin", 7)
    assert run(scheduler) == {"short": 1, "twin": 3} and not twin.rope_long
    # 12 tokens, past the length from the start: long at once; the block "short" cached since fits (4 tokens)
    long = add(scheduler, "long", 12)
    assert run(scheduler) == {"short": 1, "twin": 1, "long": 8} and long.rope_long
    # Without the separate chains, "long" would have found the short-rotated block as well: the chains differ
    assert cache._block_hashes(twin, 1) != cache._block_hashes(long, 1)


def test_a_longrope_sequence_sent_back_can_be_aborted_while_it_waits():
    cache = KVCacheManager(32, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64, long_rope_from=4)
    req = add(scheduler, "a", 4)
    run(scheduler)
    scheduler.max_num_batched_tokens = 0  # nothing runs: the recomputed request stays in the queue
    scheduler.schedule()
    scheduler.max_num_batched_tokens = 64
    output = scheduler.schedule()
    assert [r.request_id for r, _ in output.scheduled] == ["a"] and req.status is RequestStatus.RUNNING
    scheduler.finish_request(req, FinishReason.ABORT)
    assert not scheduler.has_unfinished_requests()


def test_a_request_of_a_further_lora_adapter_waits_for_a_slot_and_requests_behind_it_go_on():
    from enginekit.core.lora import Adapter

    cache = KVCacheManager(32, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)
    adapters = [Adapter(None, None, key) for key in (1, 2, 3)]  # type: ignore[arg-type]
    for name, adapter in [("a", 0), ("b", 1), ("c", 2), ("d", None), ("e", 0)]:
        add(scheduler, name, 3).lora = adapters[adapter] if adapter is not None else None
    assert run(scheduler) == {"a": 3, "b": 3, "d": 3, "e": 3}  # c's adapter would be a third
    scheduler.finish_request(scheduler.requests["b"], FinishReason.STOP)
    assert run(scheduler) == {"a": 1, "d": 1, "e": 1, "c": 3}
