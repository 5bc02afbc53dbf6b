"""KVCacheManager and BlockPool: block accounting, the prefix cache, eviction order."""

from enginekit.core.kv_cache import BlockPool, KVCacheManager
from enginekit.core.request import Request
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import EngineCoreRequest

BLOCK = 4


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(EngineCoreRequest(request_id, tokens, SamplingParams()), detokenizer=None)


def prefill(cache: KVCacheManager, req: Request) -> None:
    """Allocate and 'compute' the whole prompt, registering its full blocks."""
    computed = cache.get_computed_blocks(req)
    assert cache.allocate_slots(req, req.num_tokens - len(computed) * BLOCK, computed)
    req.num_computed_tokens = req.num_tokens
    cache.cache_full_blocks(req)


def test_allocation_rounds_up_to_whole_blocks_and_free_returns_them():
    cache = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    req = request("a", list(range(9)))
    assert cache.allocate_slots(req, 9)
    assert len(cache.block_ids["a"]) == 3 and cache.pool.num_free_blocks == 5
    cache.free(req)
    assert cache.pool.num_free_blocks == 8 and "a" not in cache.block_ids


def test_an_allocation_that_does_not_fit_changes_nothing():
    cache = KVCacheManager(2, BLOCK, enable_prefix_caching=False)
    req = request("a", list(range(12)))
    assert not cache.allocate_slots(req, 12)
    assert cache.pool.num_free_blocks == 2 and "a" not in cache.block_ids


def test_a_shared_prefix_reuses_full_blocks_only():
    cache = KVCacheManager(16, BLOCK, enable_prefix_caching=True)
    first = request("a", list(range(10)))  # two full blocks and a partial one
    prefill(cache, first)
    second = request("b", [*range(8), 99, 98, 97])
    hits = cache.get_computed_blocks(second)
    assert [b.block_id for b in hits] == cache.block_ids["a"][:2]
    assert cache.allocate_slots(second, second.num_tokens - 8, hits)
    assert all(block.ref_count == 2 for block in hits)
    assert cache.block_ids["b"][:2] == cache.block_ids["a"][:2]


def test_at_least_one_token_is_always_left_to_compute():
    cache = KVCacheManager(16, BLOCK, enable_prefix_caching=True)
    prefill(cache, request("a", list(range(8))))
    same = request("b", list(range(8)))
    assert len(cache.get_computed_blocks(same)) == 1  # the last block is recomputed to get a logit


def test_freed_blocks_keep_their_content_until_evicted_least_recently_freed_first():
    cache = KVCacheManager(4, BLOCK, enable_prefix_caching=True)
    old = request("old", list(range(8)))
    prefill(cache, old)
    cache.free(old)
    assert len(cache.get_computed_blocks(request("again", list(range(9))))) == 2  # still cached
    filler = request("filler", [50 + i for i in range(12)])
    assert cache.allocate_slots(filler, 12)  # the never-used blocks first, then the tail block of "old"
    assert len(cache.get_computed_blocks(request("again", list(range(9))))) == 1


def test_embedding_prompts_never_share_blocks():
    cache = KVCacheManager(8, BLOCK, enable_prefix_caching=True)
    req = Request(
        EngineCoreRequest("e", [0] * 8, SamplingParams(), prompt_embeds=object()),  # type: ignore[arg-type]
        detokenizer=None,
    )
    assert cache.get_computed_blocks(req) == []


def test_reset_prefix_cache_only_when_no_block_is_held():
    cache = KVCacheManager(8, BLOCK, enable_prefix_caching=True)
    req = request("a", list(range(8)))
    prefill(cache, req)
    assert not cache.pool.reset_prefix_cache()
    cache.free(req)
    assert cache.pool.reset_prefix_cache()
    assert cache.get_computed_blocks(request("b", list(range(9)))) == []


def test_used_blocks_are_a_prefix_of_the_block_ids():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and pool.num_used_blocks == 3
    pool.release(blocks)
    assert [b.block_id for b in pool.allocate(5)] == [3, 4, 5, 6, 7]  # never-used blocks before freed ones
    assert pool.num_used_blocks == 8
