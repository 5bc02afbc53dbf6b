"""Speculative decoding: n-gram proposals verified in one pass, jump forward over a grammar's forced tokens.

Greedy requests get token for token what they get without speculation (with ``batch_invariant=True`` a row's
numbers do not depend on how many rows its step has, so the comparison is exact), with every request option, in
every mode, under data and tensor parallelism; sampled requests keep the target distribution (a statistical test
on the builtin model); the proposals' KV slots go back and the prefix cache never holds a rejected token.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from enginekit import Engine, SamplingParams
from enginekit.config import EngineConfig
from enginekit.core.speculative.ngram import lookup
from enginekit.core.speculative.plan import only_token
from enginekit.sampling_params import RequestOutputKind
from enginekit.structured_outputs import StructuredOutputsParams

# Correctness tests propose whenever the lookup finds something (not only when it pays), to verify many proposals.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
# Prompts whose continuations repeat them (the builtin model's random weights fall into loops), so that proposals
# are made, and some accepted.
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "abc abc abc abc abc abc abc",
    "Hello world, hello world, hello",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _run(params: SamplingParams, speculative: dict | None, *, prompts=PROMPTS, mode="inproc", **options):
    with Engine(
        "builtin", mode=mode, batch_invariant=True, speculative_config=speculative, **options
    ) as engine:
        outputs = engine.generate(prompts, params)
        return outputs, engine.get_stats()


# ---- the config -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "medusa"}, "must be one of 'ngram', 'draft_model'"),
        (
            {"method": "ngram", "num_speculative_token": 3},
            "unknown key 'num_speculative_token'.*did you mean",
        ),
        ({"method": "ngram", "model": "x"}, "unknown key 'model' for method 'ngram'"),
        ({"method": "draft_model", "prompt_lookup_max": 3, "model": "x"}, "unknown key 'prompt_lookup_max'"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"method": "ngram", "adaptive": "yes"}, "must be a bool"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"must be in \[1, 16\]"),
        (
            {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min <= prompt_lookup_max",
        ),
    ],
)
def test_a_bad_speculative_config_is_refused_by_name(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EngineConfig(speculative_config=options)


def test_speculative_decoding_refuses_overlapped_steps():
    with pytest.raises(ValueError, match="async_scheduling=True cannot be used with speculative_config"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)


def test_the_config_fills_vllm_defaults():
    config = EngineConfig(speculative_config={"method": "ngram", "prompt_lookup_max": 1}).speculative
    assert config is not None
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (8, 1, 1)
    assert config.adaptive


# ---- the n-gram lookup and the forced tokens ------------------------------------------------------------------------
def test_ngram_lookup_takes_the_longest_suffix_at_its_latest_occurrence():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, 4, 2) == [4, 5, 1]
    # the 3-token suffix [9, 2, 3] never occurred; its 2-token suffix did, latest at the end of [8, 2, 3]
    assert lookup([2, 3, 7, 8, 2, 3, 6, 9, 2, 3], 2, 3, 2) == [6, 9]
    assert lookup([1, 2, 3, 4, 5, 9, 3], 3, 4, 2) == []  # only a one-token match, below prompt_lookup_min
    assert lookup([1, 2, 3, 4, 5, 9, 3], 3, 4, 1) == [4, 5, 9]
    assert lookup([1, 2, 1, 2], 5, 2, 2) == [1, 2]  # never past the end of the sequence
    assert lookup([5], 3, 2, 1) == [] and lookup([1, 1], 0, 2, 1) == []


def test_only_token_reads_a_packed_mask():
    import torch

    words = torch.zeros(4, dtype=torch.int32)
    assert only_token(words) is None
    words[2] = 1 << 5
    assert only_token(words) == 2 * 32 + 5
    words[2] = -(1 << 31)  # bit 31 of word 2
    assert only_token(words) == 2 * 32 + 31
    words[0] = 1
    assert only_token(words) is None


# ---- greedy exactness, every option -------------------------------------------------------------------------------
CASES = {
    "plain": SamplingParams(temperature=0, max_tokens=30),
    "logprobs": SamplingParams(temperature=0, max_tokens=30, logprobs=2),
    "max_tokens mid-run": SamplingParams(temperature=0, max_tokens=7),
    "penalties": SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2),
    "min_tokens": SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[65, 99]),
    "bad_words": SamplingParams(temperature=0, max_tokens=30, bad_words=["at", "bc"]),
    "final only": SamplingParams(temperature=0, max_tokens=30, output_kind=RequestOutputKind.FINAL_ONLY),
}


def test_greedy_tokens_and_every_option_are_the_same_with_proposals():
    without, with_ = {}, {}
    for results, speculative in ((without, None), (with_, NGRAM)):
        with Engine("builtin", mode="inproc", batch_invariant=True, speculative_config=speculative) as engine:
            for name, params in CASES.items():
                results[name] = engine.generate(PROMPTS, params)
            stats = engine.get_stats()
    assert (
        stats["spec_num_draft_tokens"] > 50
        and 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    )
    assert stats["spec_acceptance_rate"] == stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    for name in CASES:
        for plain, speculated in zip(without[name], with_[name]):
            a, b = plain.outputs[0], speculated.outputs[0]
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), name
            if a.logprobs is not None:
                assert b.logprobs is not None and len(b.logprobs) == len(a.logprobs)
                for row_a, row_b in zip(a.logprobs, b.logprobs):
                    assert {t: p.logprob for t, p in row_a.items()} == {
                        t: p.logprob for t, p in row_b.items()
                    }
    accepted = [o.metrics.num_accepted_tokens for o in with_["plain"]]
    assert (
        all(o.metrics.num_draft_tokens >= n for o, n in zip(with_["plain"], accepted)) and sum(accepted) > 0
    )
    assert (
        with_["plain"][0].metrics.acceptance_rate == accepted[0] / with_["plain"][0].metrics.num_draft_tokens
    )
    assert [len(o.outputs[0].token_ids) for o in with_["max_tokens mid-run"]] == [7, 7, 7]


def test_a_stop_string_inside_an_accepted_run_cuts_it_there():
    full, _ = _run(SamplingParams(temperature=0, max_tokens=30), NGRAM)
    text = full[0].outputs[0].text
    stop = text[12:15]  # inside the loop the proposals copy
    without, _ = _run(SamplingParams(temperature=0, max_tokens=30, stop=[stop]), None, prompts=PROMPTS[:1])
    with_, stats = _run(SamplingParams(temperature=0, max_tokens=30, stop=[stop]), NGRAM, prompts=PROMPTS[:1])
    a, b = without[0].outputs[0], with_[0].outputs[0]
    assert b.finish_reason == "stop" and b.stop_reason == stop
    assert (b.text, b.token_ids) == (a.text, a.token_ids)
    assert stop not in b.text and stats["spec_num_accepted_tokens"] > 0


def test_streamed_tokens_arrive_as_they_are_accepted():
    params = SamplingParams(temperature=0, max_tokens=30, output_kind=RequestOutputKind.DELTA)
    with Engine("builtin", mode="inproc", batch_invariant=True, speculative_config=NGRAM) as engine:
        deltas = [len(out.outputs[0].token_ids) for out in engine.stream(PROMPTS[0], params)]
    assert sum(deltas) == 30
    assert max(deltas) > 1  # a step that accepted proposals sent them together


def test_a_stream_interval_sends_accepted_runs_together():
    params = SamplingParams(temperature=0, max_tokens=30)
    without, _ = _run(params, None, stream_interval=3)
    with_, _ = _run(params, NGRAM, stream_interval=3)
    assert [o.outputs[0].token_ids for o in with_] == [o.outputs[0].token_ids for o in without]
    assert [o.outputs[0].text for o in with_] == [o.outputs[0].text for o in without]


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_greedy_tokens_are_the_same_in_the_engine_process(mode):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    without, _ = _run(params, None, mode=mode)
    with_, stats = _run(params, NGRAM, mode=mode)
    assert stats["spec_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in with_] == [o.outputs[0].token_ids for o in without]
    assert sum(o.metrics.num_accepted_tokens for o in with_) == stats["spec_num_accepted_tokens"]


def test_greedy_tokens_are_the_same_under_data_and_tensor_parallelism():
    params = SamplingParams(temperature=0, max_tokens=20)
    reference, _ = _run(params, None)
    expected = [o.outputs[0].token_ids for o in reference]
    dp, dp_stats = _run(params, NGRAM, mode="mp", data_parallel_size=2, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in dp] == expected and dp_stats["spec_num_accepted_tokens"] > 0
    tp, tp_stats = _run(params, NGRAM, mode="mp", tensor_parallel_size=2, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in tp] == expected and tp_stats["spec_num_accepted_tokens"] > 0


def test_speculation_survives_a_restart():
    params = SamplingParams(temperature=0, max_tokens=20)
    with Engine("builtin", mode="mp", batch_invariant=True, speculative_config=NGRAM) as engine:
        first = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
        engine.restart()
        assert engine.config.speculative_config == NGRAM
        second = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
        assert second == first and engine.get_stats()["spec_num_accepted_tokens"] > 0


# ---- how many to propose ---------------------------------------------------------------------------------------
def _speculation(**options):
    from enginekit.core.speculative.ngram import NgramProposer
    from enginekit.core.speculative.plan import Speculation

    return Speculation(NgramProposer(max_n=4, min_n=2), None, num_speculative_tokens=8, **options)  # type: ignore[arg-type]


class _Request:
    spec_hits = spec_trials = 0.0


def test_a_row_pays_at_a_lower_acceptance_with_fewer_requests_beside_it():
    speculation = _speculation(row_cost=0.3)
    assert speculation.threshold(1) == pytest.approx(0.3)
    assert speculation.threshold(1) < speculation.threshold(4) < speculation.threshold(16) < 1
    assert speculation.threshold(16) == pytest.approx(4.8 / 5.5)


def test_a_request_proposes_as_many_as_its_acceptance_makes_worth_their_rows():
    speculation, request = _speculation(row_cost=0.3), _Request()
    threshold = speculation.threshold(1)
    assert (
        speculation._worth(request, threshold) == 4
    )  # three in four before anything is known: 0.75**4 >= 0.3
    request.spec_hits, request.spec_trials = 40.0, 41.0  # it copies: all k
    assert speculation._worth(request, threshold) == 8
    assert speculation._worth(request, speculation.threshold(16)) < 8  # beside 15 others: fewer
    request.spec_hits, request.spec_trials = (
        0.5,
        8.0,
    )  # it rarely takes one: none, until its estimate recovers
    tried = [speculation._worth(request, threshold) for _ in range(40)]
    assert tried[0] == 0 and 1 in tried
    assert _speculation(adaptive=False)._worth(_Request(), 0.99) == 8


def test_adaptive_proposals_skip_what_does_not_pay_and_keep_the_tokens():
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = ["Zq8 !Wv lo;P", "k9 uu#a Lm,2 bb"]  # little for the lookup to find
    fixed, fixed_stats = _run(params, NGRAM, prompts=prompts)
    adaptive, adaptive_stats = _run(params, {"method": "ngram", "num_speculative_tokens": 4}, prompts=prompts)
    assert [o.outputs[0].token_ids for o in adaptive] == [o.outputs[0].token_ids for o in fixed]
    assert adaptive_stats["spec_acceptance_rate"] >= fixed_stats["spec_acceptance_rate"]
    wasted = fixed_stats["spec_num_draft_tokens"] - fixed_stats["spec_num_accepted_tokens"]
    assert adaptive_stats["spec_num_draft_tokens"] - adaptive_stats["spec_num_accepted_tokens"] < wasted


# ---- preemption and abort -------------------------------------------------------------------------------------
def test_preemption_mid_run_loses_nothing():
    """A cache too small for every request at once: requests are preempted (with proposals scheduled) and
    recomputed, and get the same tokens as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    options = {"num_kv_blocks": 10, "block_size": 8}
    without, _ = _run(params, None, **options)
    with_, stats = _run(params, NGRAM, **options)
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in with_] == [o.outputs[0].token_ids for o in without]
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_an_abort_mid_run_leaves_the_others_and_the_cache_whole(mode):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference, _ = _run(params, None, prompts=PROMPTS[1:])
    with Engine("builtin", mode=mode, batch_invariant=True, speculative_config=NGRAM) as engine:
        stream = engine.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        for output in stream:
            if len(output.outputs[0].token_ids) > 8:
                break
        stream.close()  # aborts its request, mid-run
        others = engine.generate(PROMPTS[1:], params)
        stats = engine.call_utility("wait_idle")
        assert stats["spec_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in others] == [o.outputs[0].token_ids for o in reference]
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


# ---- the KV cache ----------------------------------------------------------------------------------------------
def test_rejected_proposals_give_their_blocks_back_and_are_never_cached():
    from enginekit.core.engine_core import EngineCore
    from enginekit.wire.messages import EngineCoreRequest

    core = EngineCore(EngineConfig(model="builtin", block_size=4, num_kv_blocks=64, speculative_config=NGRAM))
    try:
        prompt = core.tokenizer.encode(PROMPTS[1])
        params = SamplingParams(temperature=0, max_tokens=40)
        core.handle(EngineCoreRequest("r", prompt, params, arrival_time=0.0))
        request = core.scheduler.requests["r"]
        proposals_seen = 0
        while core.has_work():
            core.step()
            if "r" not in core.scheduler.requests:
                break
            # after each step: no block past the known tokens (the next step's proposals get their own)
            held = len(core.kv_cache.block_ids["r"])
            assert held <= -(-request.num_tokens // 4), (held, request.num_tokens)
            proposals_seen += request.num_draft_tokens
            # every cached block holds the request's own tokens (never a proposal that was not accepted)
            for index, block_hash in enumerate(request.block_hashes):
                block = core.kv_cache.pool.lookup(block_hash)
                if block is not None and block.block_id in core.kv_cache.block_ids["r"]:
                    assert core.kv_cache.block_ids["r"][index] == block.block_id
        assert proposals_seen and core.speculation.num_draft_tokens > core.speculation.num_accepted_tokens > 0
        assert core.kv_cache.pool.num_free_blocks == 64
    finally:
        core.shutdown()


def test_a_cached_prefix_holds_only_accepted_tokens():
    """A second request with the first one's output as its prompt hits the cache for exactly the blocks whose
    tokens it shares, and gets the same continuation as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=40)
    with Engine(
        "builtin", mode="inproc", batch_invariant=True, speculative_config=NGRAM, block_size=4
    ) as engine:
        first = engine.generate(PROMPTS[1], params)[0]
        follow = PROMPTS[1] + first.outputs[0].text
        again = engine.generate(follow, SamplingParams(temperature=0, max_tokens=16))[0]
        assert first.metrics.num_accepted_tokens > 0
        assert again.num_cached_tokens > len(first.prompt_token_ids)  # blocks of the first one's output too
    reference, _ = _run(SamplingParams(temperature=0, max_tokens=16), None, prompts=[follow])
    assert again.outputs[0].token_ids == reference[0].outputs[0].token_ids


# ---- jump forward ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["alone", "with ngram"])
def test_forced_tokens_come_without_sampling_and_change_nothing(backend, speculative):
    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA), logprobs=1
    )
    options = {"structured_outputs_backend": backend}
    reference, reference_stats = _run(params, None, jump_forward=False, **options)
    assert reference_stats["spec_num_forced_tokens"] == 0
    jumped, stats = _run(params, speculative, **options)
    assert stats["spec_num_forced_tokens"] > 0
    assert [o.metrics.num_forced_tokens for o in jumped] == [
        o.metrics.num_forced_tokens for o in jumped if True
    ]
    assert sum(o.metrics.num_forced_tokens for o in jumped) == stats["spec_num_forced_tokens"]
    for a, b in zip(reference, jumped):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert [list(row) for row in b.outputs[0].logprobs] == [list(row) for row in a.outputs[0].logprobs]


def test_proposals_under_a_grammar_without_jump_forward_keep_the_tokens():
    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    reference, _ = _run(params, None, jump_forward=False)
    speculated, stats = _run(params, NGRAM, jump_forward=False)
    assert stats["spec_num_forced_tokens"] == 0 and stats["spec_num_draft_tokens"] > 0
    assert [o.outputs[0].token_ids for o in speculated] == [o.outputs[0].token_ids for o in reference]


# ---- sampling keeps the target distribution ---------------------------------------------------------------------
def test_sampled_tokens_keep_the_target_distribution():
    """Each position's token distribution with proposals matches the one without: 4,000 eight-token samples each
    way of a prompt whose proposals the model takes about half the time (top_k=2), every token's share at every
    position compared by a two-proportion z-test at z = 5.5 (two-sided p ~ 4e-8 each, under 1e-5 for all of
    them together). Taking the proposals as accepted (a wrong verification) fails it by far."""
    samples = 4000
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=8, ignore_eos=True)
    counts = {}
    for method in (None, NGRAM):
        with Engine("builtin", mode="inproc", speculative_config=method, max_num_seqs=256) as engine:
            outputs = engine.generate([PROMPTS[1]] * samples, params, use_tqdm=False)
            stats = engine.get_stats()
        counts[method is not None] = [Counter(o.outputs[0].token_ids[j] for o in outputs) for j in range(8)]
    assert stats["spec_num_accepted_tokens"] > samples // 4  # the proposals were verified, often accepted
    assert stats["spec_acceptance_rate"] < 0.9  # and often rejected: the test sees both
    for j in range(1, 8):
        plain, speculated = counts[False][j], counts[True][j]
        for token in set(plain) | set(speculated):
            p, q = plain[token] / samples, speculated[token] / samples
            pooled = (p + q) / 2
            bound = 5.5 * math.sqrt(max(pooled * (1 - pooled), 1 / samples) * 2 / samples)
            assert abs(p - q) <= bound, (j, token, p, q, bound)


def test_a_seeded_request_samples_the_same_tokens_again():
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=30, seed=11)
    first, _ = _run(params, NGRAM)
    second, stats = _run(params, NGRAM)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert stats["spec_num_draft_tokens"] > 0


# ---- the default model -------------------------------------------------------------------------------------------
PASSAGE = (
    "The Norwegian explorer Roald Amundsen led the first expedition to reach the South Pole, arriving on 14 "
    "December 1911. His team used sled dogs and skis, and they returned safely to their base at the Bay of Whales."
)
CONVERSATIONS = [
    [{"role": "user", "content": PASSAGE + "\nRepeat the passage above word for word."}],
    [{"role": "user", "content": PASSAGE + "\nWhich sentence mentions sled dogs? Quote it exactly."}],
    [
        {
            "role": "user",
            "content": "Write a Python function that adds two numbers, then again with type hints.",
        }
    ],
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.mark.parametrize(
    ("options", "modes"),
    [({"batch_invariant": True}, ["inproc", "mp", "async"]), ({"quantization": "none"}, ["inproc"])],
    ids=["batch_invariant", "quantization none"],
)
def test_the_default_models_greedy_tokens_are_the_same_with_proposals(options, modes):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with Engine(mode="inproc", **options) as engine:
        expected = [o.outputs[0].token_ids for o in engine.chat(CONVERSATIONS, params, use_tqdm=False)]
    for mode in modes:
        with Engine(mode=mode, speculative_config=NGRAM, **options) as engine:
            outputs = engine.chat(CONVERSATIONS, params, use_tqdm=False)
            stats = engine.get_stats()
        assert [o.outputs[0].token_ids for o in outputs] == expected, mode
        assert stats["spec_num_accepted_tokens"] > 48, mode  # the copying answers took proposals
