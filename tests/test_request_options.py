"""The request options a vLLM user reaches for, each checked in every mode (and against a reference where one
exists): n samples, penalties, min_p, prompt logprobs, logprob objects, include_stop_str_in_output, output
kinds, metrics, caller-chosen request ids and vLLM's keyword spellings."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
import torch

from enginekit import Engine, Logprob, RequestOutputKind, SamplingParams
from hf_checkpoints import build_checkpoint, hf_greedy, hf_prompt_logprobs

MODES = ["inproc", "mp", "async"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog, again and again, " * 3  # several full blocks


@pytest.fixture(scope="module", params=MODES)
def engine(request):
    with Engine("builtin", mode=request.param, block_size=8) as engine:
        yield engine


def seeded(seed: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, seed=seed, **options)


def texts(output) -> list[str]:
    return [c.text for c in output.outputs]


def token_lists(output) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


# ---- n samples ------------------------------------------------------------------------------------------
def test_n_samples_are_the_seeded_requests_one_by_one(engine):
    [out] = engine.generate(LONG_PROMPT, seeded(7, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    alone = [engine.generate(LONG_PROMPT, seeded(7 + i))[0].outputs[0].token_ids for i in range(3)]
    assert token_lists(out) == alone  # sample i uses seed + i, whatever runs beside it
    assert len({tuple(t) for t in alone}) > 1  # the samples really differ
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_n_samples_share_the_prompt_blocks_through_the_prefix_cache(engine):
    engine.reset_prefix_cache()
    before = engine.get_stats()
    prompt_len = len(engine.tokenizer.encode(LONG_PROMPT))
    [out] = engine.generate(LONG_PROMPT, SamplingParams(n=4, max_tokens=4, temperature=0.8, seed=1))
    after = engine.get_stats()
    full_blocks = prompt_len // 8 * 8
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 3 * full_blocks
    assert out.num_cached_tokens >= full_blocks - 8  # later samples found the first one's blocks


def test_n_greedy_samples_are_identical_and_stream_together(engine):
    params = SamplingParams(n=2, max_tokens=6, temperature=0)
    [out] = engine.generate("same", params)
    assert token_lists(out)[0] == token_lists(out)[1]
    last = list(engine.stream("same", params))[-1]
    assert last.finished and token_lists(last) == token_lists(out)


def test_n_abort_ends_every_sample(engine):
    stream = engine.stream("abort us", SamplingParams(n=3, max_tokens=400, temperature=0, ignore_eos=True))
    first = next(stream)
    engine.abort(first.request_id)
    last = list(stream)[-1]
    assert [c.finish_reason for c in last.outputs] == ["abort"] * 3
    stats = engine.call_utility("wait_idle")
    assert stats["num_running_requests"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


# ---- penalties and min_p --------------------------------------------------------------------------------
def test_penalties_change_greedy_output_and_no_penalty_is_plain_greedy(engine):
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = engine.generate(LONG_PROMPT, plain)[0].outputs[0].token_ids
    neutral = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.0, presence_penalty=0.0
    )
    assert engine.generate(LONG_PROMPT, neutral)[0].outputs[0].token_ids == base
    for option in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **option)
        tokens = engine.generate(LONG_PROMPT, penalized)[0].outputs[0].token_ids
        assert tokens != base, option
        # Fewer repeats than plain greedy: the point of a penalty.
        assert len(set(tokens)) >= len(set(base)), option


def test_min_p_keeps_only_tokens_near_the_most_likely(engine):
    min_p = 0.3
    for seed in range(6):
        params = SamplingParams(max_tokens=6, temperature=1.0, min_p=min_p, seed=seed, logprobs=1)
        out = engine.generate("Choose", params)[0].outputs[0]
        for token, entry in zip(out.token_ids, out.logprobs):
            best = max(e.logprob for e in entry.values())
            assert entry[token].logprob >= best + math.log(min_p) - 1e-4
    greedy = engine.generate("Choose", SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    only_top = engine.generate("Choose", SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=3))
    assert only_top[0].outputs[0].token_ids == greedy


# ---- min_tokens -----------------------------------------------------------------------------------------
def test_min_tokens_bans_eos_and_stop_tokens_until_reached_even_when_biased_to_the_top(engine):
    eos, stop = engine.tokenizer.eos_token_id, ord("q") + 3
    pushed = SamplingParams(max_tokens=12, temperature=0, min_tokens=5, logit_bias={eos: 100})
    out = engine.generate("at least five", pushed)[0].outputs[0]
    assert eos not in out.token_ids[:5] and out.token_ids[5:] == [eos]  # then EOS, the biased top, at once
    assert out.finish_reason == "stop" and "\ufffd" not in out.text
    seeded = SamplingParams(
        max_tokens=12, temperature=0.8, seed=3, min_tokens=4, stop_token_ids=[stop], logit_bias={stop: 100}
    )
    out = engine.generate("at least four", seeded)[0].outputs[0]
    assert out.token_ids[4:] == [stop] and stop not in out.token_ids[:4]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    ignoring = SamplingParams(
        max_tokens=6, temperature=0, min_tokens=3, ignore_eos=True, logit_bias={eos: 100}
    )
    assert engine.generate("eos is a token", ignoring)[0].outputs[0].token_ids == [eos] * 6


# ---- logprobs -------------------------------------------------------------------------------------------
def test_logprobs_are_objects_with_rank_and_decoded_token(engine):
    out = engine.generate("Rank", SamplingParams(max_tokens=4, temperature=1.0, seed=5, logprobs=2))[0]
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert all(isinstance(e, Logprob) for e in entry.values())
        assert entry[token].decoded_token == engine.tokenizer.decode([token])
        ranks = sorted(e.rank for t, e in entry.items() if t != token or e.rank <= 2)
        assert ranks[:2] == [1, 2]
        by_rank = sorted(entry.values(), key=lambda e: e.rank)
        assert [e.logprob for e in by_rank] == sorted((e.logprob for e in by_rank), reverse=True)


def test_prompt_logprobs_match_the_logprobs_of_generating_the_same_tokens(engine):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    generated = engine.generate("Once upon a time", greedy)[0]
    prompt = generated.prompt_token_ids + generated.outputs[0].token_ids
    scored = engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None
    for position, token in enumerate(prompt[1:], start=1):
        entry = scored.prompt_logprobs[position]
        assert token in entry and 1 <= len(entry) <= 2
        assert entry[token].decoded_token == engine.tokenizer.decode([token])
    tail = [scored.prompt_logprobs[len(generated.prompt_token_ids) + i] for i in range(6)]
    for entry, token, expected in zip(tail, generated.outputs[0].token_ids, generated.outputs[0].logprobs):
        assert entry[token].logprob == pytest.approx(expected[token].logprob, abs=1e-4)
        assert entry[token].rank == 1  # greedy tokens are the most likely ones


def test_prompt_logprobs_of_a_one_token_prompt_and_a_cached_prompt(engine):
    [one] = engine.generate([5], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert one.prompt_logprobs == [None]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    first, second = (engine.generate(LONG_PROMPT, params)[0] for _ in range(2))
    assert second.num_cached_tokens == 0  # prompt logprobs need every position: no cached blocks
    assert [e and {t: round(v.logprob, 4) for t, v in e.items()} for e in second.prompt_logprobs] == [
        e and {t: round(v.logprob, 4) for t, v in e.items()} for e in first.prompt_logprobs
    ]


# ---- output control -------------------------------------------------------------------------------------
def test_include_stop_str_in_output(engine):
    plain = engine.generate("Stop here", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    text = plain.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = text.index(stop)
    excluded = engine.generate("Stop here", SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    included = engine.generate(
        "Stop here",
        SamplingParams(max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert excluded.text == text[:cut] and included.text == text[: cut + len(stop)]
    assert included.outputs[0].stop_reason == excluded.outputs[0].stop_reason == stop
    streamed = list(
        engine.stream(
            "Stop here",
            SamplingParams(max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True),
        )
    )
    assert streamed[-1].text == included.text


def test_delta_streaming_adds_up_to_the_cumulative_output(engine):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    full = engine.generate("Stream me", params)[0]
    delta = SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, logprobs=1, output_kind=RequestOutputKind.DELTA
    )
    chunks = list(engine.stream("Stream me", delta))
    assert chunks[-1].finished and len(chunks) > 1
    assert "".join(c.outputs[0].text for c in chunks) == full.text
    assert [t for c in chunks for t in c.outputs[0].token_ids] == full.outputs[0].token_ids
    assert sum(len(c.outputs[0].logprobs) for c in chunks) == 20

    async def collect():
        return [c async for c in engine.astream("Stream me", delta)]

    async_chunks = asyncio.run(collect())
    assert "".join(c.outputs[0].text for c in async_chunks) == full.text


def test_delta_streaming_with_n_samples(engine):
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    full = engine.generate("two streams", params)[0]
    delta = SamplingParams(
        n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    chunks = list(engine.stream("two streams", delta))
    for index in range(2):
        assert [t for c in chunks for t in c.outputs[index].token_ids] == full.outputs[index].token_ids
        assert "".join(c.outputs[index].text for c in chunks) == full.outputs[index].text


def test_final_only_yields_one_finished_output(engine):
    params = SamplingParams(max_tokens=12, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = list(engine.stream("Only the end", params))
    assert len(outputs) == 1 and outputs[0].finished
    assert (
        outputs[0].text
        == engine.generate("Only the end", SamplingParams(max_tokens=12, temperature=0))[0].text
    )


def _count_batches(engine, monkeypatch) -> list[int]:
    """Count the batches of outputs the front end applies (one per engine message), for every mode."""
    counts = [0]
    process = engine._router.processor.process

    def counting(batch):
        counts[0] += any(output.request_id.endswith("watched") for output in batch.outputs)
        process(batch)

    monkeypatch.setattr(engine._router.processor, "process", counting)
    return counts


def test_generate_gets_one_message_per_request_end_and_what_a_stream_gets(engine, monkeypatch):
    params = SamplingParams(
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=5,
        logprobs=2,
        prompt_logprobs=1,
        stop=["zz"],
        ignore_eos=True,
    )
    counts = _count_batches(engine, monkeypatch)
    engine.reset_prefix_cache()  # both calls compute the whole prompt: the same numbers
    [final] = engine.generate(LONG_PROMPT, params, request_id="g-watched")
    generated = counts[0]
    assert generated <= 4  # the two samples' starts and ends, nothing per step
    engine.reset_prefix_cache()
    [*_, streamed] = engine.stream(LONG_PROMPT, params, request_id="s-watched")
    assert counts[0] - generated >= 12  # a stream gets a delta per step
    for got, want in zip(final.outputs, streamed.outputs):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert len(got.logprobs) == len(got.token_ids) == len(want.logprobs)
        for mine, theirs in zip(got.logprobs, want.logprobs):  # the batch's make-up may move the last bits
            assert mine.keys() == theirs.keys()
            assert all(math.isclose(mine[t].logprob, theirs[t].logprob, abs_tol=1e-4) for t in mine)
    assert final.prompt_logprobs == streamed.prompt_logprobs and final.prompt_logprobs[1] is not None
    m = final.metrics
    assert (
        m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    )


@pytest.mark.parametrize("mode", MODES)
def test_stream_interval_sends_a_streams_tokens_every_nth_step_and_loses_none(mode, monkeypatch):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    delta = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, logprobs=1, output_kind=RequestOutputKind.DELTA
    )
    with Engine("builtin", mode=mode, stream_interval=4) as engine:
        counts = _count_batches(engine, monkeypatch)
        chunks = list(engine.stream("every fourth step", delta, request_id="s-watched"))
        # The first token at once, then the tokens of every fourth step together, then the end: at most 8.
        assert 3 <= counts[0] <= 2 + 24 // 4
        assert len(chunks) <= counts[0] and len(chunks[0].outputs[0].token_ids) == 1
        [full] = engine.generate("every fourth step", params)
        [*_, last] = engine.stream("every fourth step", params)
    tokens = [t for c in chunks for t in c.outputs[0].token_ids]
    assert tokens == full.outputs[0].token_ids == last.outputs[0].token_ids and len(tokens) == 24
    assert "".join(c.outputs[0].text for c in chunks) == full.outputs[0].text == last.outputs[0].text
    logprobs = [row for c in chunks for row in c.outputs[0].logprobs]
    assert [max(row, key=lambda t: row[t].logprob) for row in logprobs] == tokens
    assert last.finished and last.outputs[0].finish_reason == "length"


def test_a_generate_aborted_while_it_runs_returns_what_it_generated():
    with Engine("builtin", mode="mp") as engine:
        params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        result = []
        thread = threading.Thread(
            target=lambda: result.extend(engine.generate("go on", params, request_id="long"))
        )
        thread.start()
        deadline = time.monotonic() + 60
        while engine.get_stats()["num_generated_tokens"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.abort("long")
        thread.join(60)
        [out] = result
        assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) >= 20
        assert out.outputs[0].text == engine.tokenizer.decode(out.outputs[0].token_ids)
        assert (
            engine.generate("go on", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
            .outputs[0]
            .token_ids
            == out.outputs[0].token_ids[:20]
        )


def test_metrics_are_ordered_and_count_preemptions():
    with Engine("builtin", mode="inproc", block_size=8, num_kv_blocks=12, max_model_len=96) as engine:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        outputs = engine.generate([f"short {i}" for i in range(4)], params)
        assert engine.get_stats()["num_preemptions"] > 0
    for out in outputs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.last_token_time <= m.finished_time
        assert m.time_in_queue >= 0 and m.time_to_first_token >= m.time_in_queue and m.latency > 0
        assert out.status == "finished"
    assert sum(out.metrics.num_preemptions for out in outputs) > 0


def test_metrics_in_every_mode(engine):
    out = engine.generate("time me", SamplingParams(max_tokens=4, temperature=0))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_preemptions == 0 and out.status == "finished"


# ---- request ids and vLLM's spellings ----------------------------------------------------------------------
def test_caller_chosen_request_ids(engine):
    [one] = engine.generate("mine", SamplingParams(max_tokens=2), request_id="my-id")
    assert one.request_id == "my-id"
    outs = engine.generate(["a", "b"], SamplingParams(max_tokens=2), request_id=["id-a", "id-b"])
    assert [o.request_id for o in outs] == ["id-a", "id-b"]
    assert list(engine.stream("s", SamplingParams(max_tokens=2), request_id="st"))[-1].request_id == "st"

    async def both():
        [a] = await engine.agenerate("x", SamplingParams(max_tokens=2), request_id="as-1")
        last = [o async for o in engine.astream("y", SamplingParams(max_tokens=2), request_id="as-2")][-1]
        return a.request_id, last.request_id

    assert asyncio.run(both()) == ("as-1", "as-2")
    # An id is free again once its request finished.
    assert engine.generate("again", SamplingParams(max_tokens=2), request_id="my-id")[0].request_id == "my-id"


def test_bad_and_duplicate_request_ids_are_clear_errors(engine):
    with pytest.raises(ValueError, match=r"request ids must be unique, got \['x', 'x'\]"):
        engine.generate(["a", "b"], request_id=["x", "x"])
    with pytest.raises(ValueError, match="got 1 request ids for 2 prompts"):
        engine.generate(["a", "b"], request_id=["x"])
    with pytest.raises(TypeError, match="request_id must be a non-empty string"):
        engine.generate("a", request_id=5)
    stream = engine.stream("busy", SamplingParams(max_tokens=400, ignore_eos=True), request_id="busy")
    next(stream)
    with pytest.raises(ValueError, match="request id 'busy' is already in use by an unfinished request"):
        engine.generate("other", request_id="busy")
    with pytest.raises(ValueError, match="already in use"):
        engine.stream("other", request_id="busy")
    stream.close()  # aborts it; the id is free again
    assert engine.generate("free", SamplingParams(max_tokens=1), request_id="busy")[0].finished
    assert engine.call_utility("get_request_ids") == []


def test_vllm_keyword_spellings_and_aliases(engine):
    params = SamplingParams(max_tokens=4, temperature=0)
    expected = engine.generate("spell", params)[0].text
    assert engine.generate("spell", sampling_params=params, use_tqdm=False)[0].text == expected
    assert engine.generate("spell", params=params, progress=False)[0].text == expected
    assert list(engine.stream("spell", sampling_params=params))[-1].text == expected
    assert asyncio.run(engine.agenerate("spell", sampling_params=params, use_tqdm=False))[0].text == expected
    with pytest.raises(TypeError, match="got both 'sampling_params' and its alias 'params'"):
        engine.generate("spell", sampling_params=params, params=params)
    with pytest.raises(TypeError, match="got both 'use_tqdm' and its alias 'progress'"):
        engine.generate("spell", use_tqdm=False, progress=False)


# ---- references: transformers on a tiny checkpoint --------------------------------------------------------
class OutputPenalties:
    """Presence and frequency penalties on the generated tokens, as vLLM defines them (transformers has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.prompt_len :]
        counts = torch.bincount(output, minlength=scores.shape[1])[: scores.shape[1]].to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("options") / "llama", "llama")


@pytest.mark.parametrize("mode", MODES)
def test_penalties_and_prompt_logprobs_match_the_references(checkpoint, mode):
    from transformers import LogitsProcessorList

    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompt = [(i * 37 + 11) % (vocab_size - 2) + 2 for i in range(45)] + [7, 7, 9, 7]
    expected_rep = hf_greedy(checkpoint, [prompt], 24, repetition_penalty=1.5)[0]
    processor = LogitsProcessorList([OutputPenalties(len(prompt), 0.7, 0.9)])
    expected_out = hf_greedy(checkpoint, [prompt], 24, logits_processor=processor)[0]
    expected_prompt = hf_prompt_logprobs(checkpoint, prompt)
    options = {"block_size": 8, "num_kv_blocks": 32, "max_model_len": 128, "max_num_batched_tokens": 16}
    with Engine(str(checkpoint), mode=mode, **options) as engine:
        greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        rep, out, scored = engine.generate(
            [prompt] * 3,
            [
                SamplingParams(**greedy, repetition_penalty=1.5),
                SamplingParams(**greedy, presence_penalty=0.7, frequency_penalty=0.9),
                SamplingParams(max_tokens=1, prompt_logprobs=0),  # chunked: 49 tokens, 16 per step
            ],
        )
    assert rep.outputs[0].token_ids == expected_rep
    assert out.outputs[0].token_ids == expected_out
    assert expected_rep != hf_greedy(checkpoint, [prompt], 24)[0]  # the penalty mattered
    got = [entry[token].logprob for entry, token in zip(scored.prompt_logprobs[1:], prompt[1:])]
    assert got == pytest.approx(expected_prompt, abs=1e-4)
