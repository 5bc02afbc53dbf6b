"""The engine core through the facade, in-process, on the built-in tiny model."""

import asyncio

import pytest
import torch

from enginekit import Engine, RequestOutput, SamplingParams
from process_support import HANG_GUARD_S

PROMPTS = ["Hello, world", "The quick brown fox jumps", "a", "Paged attention keeps KV in blocks"]


@pytest.fixture(scope="module")
def engine():
    with Engine("builtin", mode="inproc", num_kv_blocks=512) as engine:
        yield engine


def free_blocks(engine):
    stats = engine.get_stats()
    return stats["num_free_kv_blocks"], stats["num_kv_blocks"]


def test_generate_accepts_every_prompt_form(engine, greedy):
    text = engine.generate("Hello", greedy(4))
    ids = engine.tokenizer.encode("Hello")
    assert len(text) == 1 and isinstance(text[0], RequestOutput)
    by_ids = engine.generate(ids, greedy(4))
    by_dict = engine.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], greedy(4))
    expected = text[0].outputs[0].token_ids
    assert len(expected) == 4
    assert by_ids[0].outputs[0].token_ids == expected
    assert [o.outputs[0].token_ids for o in by_dict] == [expected, expected]
    assert text[0].prompt == "Hello" and by_ids[0].prompt is None
    assert text[0].prompt_token_ids == ids


def test_batch_results_are_in_prompt_order_and_equal_to_single_runs(engine, greedy):
    batch = engine.generate(PROMPTS, greedy(12))
    singles = [engine.generate(p, greedy(12))[0] for p in PROMPTS]
    assert [o.prompt for o in batch] == PROMPTS
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in singles]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in batch)


def test_one_params_per_prompt(engine, greedy):
    outs = engine.generate(["a", "b"], [greedy(2), greedy(5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]


def test_stream_yields_growing_outputs_then_a_finished_one(engine, greedy):
    chunks = list(engine.stream("Stream me", greedy(6)))
    assert [len(c.outputs[0].token_ids) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert [c.finished for c in chunks] == [False] * 5 + [True]
    assert chunks[-1].text == engine.generate("Stream me", greedy(6))[0].text
    assert all(chunks[i].text.startswith(chunks[i - 1].text) for i in range(1, 6))


def test_abort_mid_stream_finishes_with_abort_and_frees_blocks(engine, greedy):
    stream = engine.stream("Abort me please", greedy(200))
    first = next(stream)
    engine.abort(first.request_id)
    rest = list(stream)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 200
    free, total = free_blocks(engine)
    assert free == total
    engine.abort(first.request_id)  # idempotent: an unknown/finished id is ignored


def test_leaving_a_stream_early_aborts_the_request(engine, greedy):
    for _ in engine.stream("Leave early", greedy(100)):
        break
    engine.generate("x", greedy(1))  # runs a step, which delivers the abort
    assert engine.call_utility("get_request_ids") == []
    assert free_blocks(engine)[0] == free_blocks(engine)[1]


def test_stop_token_ids_end_generation_and_keep_the_token(engine, greedy):
    tokens = engine.generate(PROMPTS[1], greedy(16))[0].outputs[0].token_ids
    stop_token = tokens[5]
    out = engine.generate(PROMPTS[1], greedy(16, stop_token_ids=[stop_token]))[0].outputs[0]
    first = tokens.index(stop_token)
    assert out.token_ids == tokens[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)


def test_stop_string_cuts_text_before_it(engine, greedy):
    full = engine.generate(PROMPTS[0], greedy(24))[0].text
    stop = full[8:10]
    out = engine.generate(PROMPTS[0], greedy(24, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    streamed = list(engine.stream(PROMPTS[0], greedy(24, stop=[stop])))
    assert all(stop not in chunk.text for chunk in streamed)
    assert streamed[-1].text == out.text


def test_min_tokens_delays_stop_token(engine, greedy):
    tokens = engine.generate(PROMPTS[1], greedy(16))[0].outputs[0].token_ids
    first = tokens.index(tokens[0])
    out = engine.generate(PROMPTS[1], greedy(16, stop_token_ids=[tokens[0]], min_tokens=3))[0].outputs[0]
    assert first == 0 and len(out.token_ids) >= 3


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate("Seeded prompt", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(3)]
    others += [SamplingParams(max_tokens=7, temperature=1.2)]
    batch = engine.generate(
        ["Other one", "Seeded prompt", "x y z", "More", "Last"],
        [others[0], seeded, others[1], others[2], others[3]],
    )
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=99)
    assert engine.generate("Seeded prompt", different_seed)[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(engine, greedy):
    expected = engine.generate(PROMPTS[0], greedy(10))[0].outputs[0].token_ids
    top_k = engine.generate(PROMPTS[0], SamplingParams(max_tokens=10, top_k=1, seed=3))
    top_p = engine.generate(PROMPTS[0], SamplingParams(max_tokens=10, top_p=1e-6, seed=3))
    assert top_k[0].outputs[0].token_ids == expected
    assert top_p[0].outputs[0].token_ids == expected


def test_top_k_restricts_the_sampled_tokens(engine):
    params = SamplingParams(max_tokens=1, top_k=3, temperature=5.0, logprobs=3)
    for seed in range(10):
        out = engine.generate("k", SamplingParams(**{**_as_dict(params), "seed": seed}))[0].outputs[0]
        (entry,) = out.logprobs
        assert entry[out.token_ids[0]].rank <= 3


def _as_dict(params):
    import msgspec

    return msgspec.structs.asdict(params)


def test_logprobs_per_token(engine, greedy):
    out = engine.generate("Logprobs", greedy(5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert all(e.logprob <= 0 for e in entry.values())
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert entry[token].logprob == max(e.logprob for e in entry.values())
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
        assert all(e.decoded_token == engine.tokenizer.decode([t]) for t, e in entry.items())
    assert engine.generate("Logprobs", greedy(5))[0].outputs[0].logprobs is None


def test_prompt_embeds_match_token_prompt(engine, greedy):
    ids = engine.tokenizer.encode("Embed me")
    weight = engine.client.core.runner.model.embed_tokens.weight
    embeds = weight[torch.tensor(ids)].clone()
    by_embeds = engine.generate({"prompt_embeds": embeds}, greedy(8))[0]
    assert by_embeds.outputs[0].token_ids == engine.generate(ids, greedy(8))[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ("", None, ValueError, "prompt is an empty string"),
        ([], None, ValueError, "prompts is empty"),
        ([[]], None, ValueError, "prompt has no tokens"),
        ("x" * 5000, None, ValueError, r"prompt is 5001 tokens long; the longest allowed is 4095"),
        ([[1, -2]], None, ValueError, "token ids must be non-negative integers"),
        ([[1, 100000]], None, ValueError, r"token id 100000 is outside the vocabulary \(size 259\)"),
        (["a", "b"], [SamplingParams()], ValueError, "got 1 SamplingParams for 2 prompts"),
        (
            {"prompt_embeds": torch.zeros(3, 5)},
            None,
            ValueError,
            r"prompt_embeds must be a \[3, 128\] tensor, got \[3, 5\]",
        ),
        ({"text": "hi"}, None, ValueError, "a dict prompt needs exactly one of"),
        (42, None, TypeError, "prompts must be a string"),
    ],
)
def test_bad_input_raises_before_reaching_the_engine(engine, prompt, params, error, message):
    steps = engine.get_stats()["num_steps"]
    with pytest.raises(error, match=message):
        engine.generate(prompt, params)
    assert engine.call_utility("get_request_ids") == []
    assert engine.get_stats()["num_steps"] == steps


def test_unknown_utility_is_a_clear_error(engine):
    from enginekit import UtilityCallError

    with pytest.raises(UtilityCallError, match="unknown utility method 'no_such_method'"):
        engine.call_utility("no_such_method")
    assert engine.ping()


def test_all_blocks_return_to_the_pool(engine, greedy):
    engine.generate(PROMPTS * 3, greedy(20))
    free, total = free_blocks(engine)
    assert free == total


def test_prefix_cache_hit_is_reused_and_counted(greedy):
    with Engine("builtin", mode="inproc", num_kv_blocks=64, block_size=16) as engine:
        prefix = "A shared system prompt that is long enough to fill several KV blocks. " * 2
        first = engine.generate(prefix + "First question?", greedy(8))[0]
        second = engine.generate(prefix + "Second one!", greedy(8))[0]
        stats = engine.get_stats()
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens >= 16 * (len(engine.tokenizer.encode(prefix)) // 16) - 16
        assert second.num_cached_tokens > 0 and stats["prefix_cache_hits"] == second.num_cached_tokens
        uncached = Engine("builtin", mode="inproc", enable_prefix_caching=False)
        try:
            expected = uncached.generate(prefix + "Second one!", greedy(8))[0]
        finally:
            uncached.shutdown()
        assert second.outputs[0].token_ids == expected.outputs[0].token_ids


def test_chunked_prefill_gives_the_same_tokens(greedy):
    prompt = "Chunked prefill splits a long prompt over several steps. " * 3
    with Engine("builtin", mode="inproc", max_num_batched_tokens=16) as chunked:
        small = chunked.generate([prompt, "short"], greedy(10))
        steps = chunked.get_stats()["num_steps"]
    with Engine("builtin", mode="inproc") as whole:
        big = whole.generate([prompt, "short"], greedy(10))
    assert steps > len(prompt) // 16
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]


def test_preemption_recomputes_to_the_same_output(greedy):
    prompts = [f"Request number {i} asks for a long answer" for i in range(6)]
    with Engine("builtin", mode="inproc", num_kv_blocks=24, block_size=16, max_model_len=256) as tight:
        squeezed = tight.generate(prompts, greedy(60))
        stats = tight.get_stats()
    with Engine("builtin", mode="inproc") as roomy:
        expected = roomy.generate(prompts, greedy(60))
    assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in expected]


def test_max_model_len_ends_with_length(greedy):
    with Engine("builtin", mode="inproc", max_model_len=32) as engine:
        out = engine.generate("0123456789", greedy(100))[0]
        assert out.outputs[0].finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32


def test_repr_and_str(engine, greedy):
    out = engine.generate("Hi", greedy(3))[0]
    assert "finished (length)" in str(out)
    assert "3 tokens" in out._repr_html_()
    assert "inproc" in repr(engine)


def test_outputs_of_steps_run_for_a_utility_call_are_not_lost(engine, greedy):
    stream = engine.stream("Wait for me", greedy(10))
    first = next(stream)
    stats = engine.call_utility("wait_idle")  # in-process, this runs steps until the request is done
    rest = list(stream)
    assert stats["num_running_requests"] == 0
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 10
    assert rest[-1].outputs[0].token_ids[:1] == first.outputs[0].token_ids


def test_several_threads_share_one_inprocess_engine(engine, greedy):
    import concurrent.futures

    prompts = [f"thread {i}" for i in range(8)]
    expected = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy(6))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: engine.generate(p, greedy(6))[0].outputs[0].token_ids, prompts))
    assert results == expected


@pytest.mark.parametrize("call", ["astream", "astream_chat"])
def test_astream_yields_token_by_token_and_break_stops_the_generation(call):
    # One engine per case: the token counter then counts this stream's tokens alone.
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with Engine("builtin", mode="inproc", num_kv_blocks=256) as engine:
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

        async def first_two():
            if call == "astream":
                stream = engine.astream("stream me", params)
            else:
                stream = engine.astream_chat(
                    [{"role": "user", "content": "hi"}], params, chat_template=template
                )
            seen = []
            async for output in stream:
                seen.append(len(output.outputs[0].token_ids))
                if len(seen) == 2:
                    break
            del stream  # abandoned: the loop closes it, and its clean-up aborts the request
            deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
            while engine._router.processor.states:
                assert asyncio.get_running_loop().time() < deadline, "the abandoned stream was never closed"
                await asyncio.sleep(0.001)  # a poll: the loop runs the clean-up meanwhile
            return seen

        seen = asyncio.run(first_two())
        assert seen[0] < seen[1] < 300  # yielded while the request ran, not once at its end
        assert engine.call_utility("get_request_ids") == []
        assert engine.get_stats()["num_generated_tokens"] < 300  # the break stopped it


def test_max_tokens_inside_a_multibyte_character_drops_the_partial_character(engine):
    # The built-in model's tokens are bytes: cut a seeded output just after a multi-byte character's lead byte
    # (a seeded request samples the same tokens whatever its max_tokens).
    seeded = {"temperature": 1.0, "seed": 3, "ignore_eos": True}
    long = engine.generate("bytes", SamplingParams(max_tokens=400, **seeded))[0]
    leads = [i for i, token in enumerate(long.outputs[0].token_ids) if 0xC2 <= token - 3 <= 0xF4]
    assert leads, "no multi-byte lead byte in 400 sampled tokens"
    params = SamplingParams(max_tokens=leads[0] + 1, **seeded)
    out = engine.generate("bytes", params)[0].outputs[0]
    assert out.finish_reason == "length" and not out.text.endswith("\ufffd")
    pieces = [o.outputs[0].text for o in engine.stream("bytes", params)]
    assert not pieces[-1].endswith("\ufffd") and pieces[-1] == out.text
