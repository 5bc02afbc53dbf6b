"""A structured output and token controls that together leave no token to sample: refused at submission where a
search with the engine's backend decides it, else a clear request error from the step that finds no token,
naming the structured output and the controls, in every mode."""

from __future__ import annotations

import pytest

from enginekit import Engine, SamplingParams, StructuredOutputsParams
from enginekit.core.structured import dead_ends
from enginekit.core.structured.dead_ends import DeadEnds, is_banned, no_token_left
from enginekit.model.text.tokenizer import ByteTokenizer

BACKENDS = ["llguidance", "xgrammar"]
PARIS = StructuredOutputsParams(choice=["Paris"])


def byte_ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text, add_special_tokens=False)


def constrained(constraint: StructuredOutputsParams, **controls) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.8, seed=3, structured_outputs=constraint, **controls)


@pytest.fixture(scope="module", params=[(mode, backend) for mode in ("inproc", "mp") for backend in BACKENDS])
def engine(request):
    mode, backend = request.param
    with Engine("builtin", mode=mode, structured_outputs_backend=backend) as engine:
        yield engine


@pytest.mark.parametrize(
    ("constraint", "controls", "message"),
    [
        (
            PARIS,
            {"bad_words": ["Paris"]},
            r"^the structured output \(choice='\[\"Paris\"\]'\) and SamplingParams.bad_words=\('Paris',\) together "
            r"leave no token to sample after 'Pari': every token the structured output allows there is banned",
        ),
        (
            PARIS,
            {"allowed_token_ids": byte_ids("Pari")},
            r"\(choice='\[\"Paris\"\]'\) and SamplingParams.allowed_token_ids=\(83, 100, 117, 108\) together "
            r"leave no token to sample after 'Pari'",
        ),
        (
            StructuredOutputsParams(regex="(yes|no)!"),
            {"bad_words": ["!"]},
            r"\(regex='\(yes\|no\)!'\) and SamplingParams.bad_words=\('!',\) together leave no token to sample "
            r"after '(yes|no)'",
        ),
        (
            StructuredOutputsParams(regex="[ab]{2}"),
            {"allowed_token_ids": byte_ids("xyz"), "bad_words": ["zz"]},
            r"and SamplingParams.allowed_token_ids=\(123, 124, 125\) and SamplingParams.bad_words=\('zz',\) "
            r"together leave no token to sample at its start",
        ),
    ],
    ids=["choice and bad_words", "choice and allowed_token_ids", "regex and bad_words", "both controls"],
)
def test_a_request_with_no_way_to_end_is_refused_before_it_is_sent(engine, constraint, controls, message):
    with pytest.raises(ValueError, match=message):
        engine.generate("The capital of France is", constrained(constraint, **controls))
    with pytest.raises(ValueError, match=message):  # asyncio's calls submit at the call too
        engine.agenerate("The capital of France is", constrained(constraint, **controls))
    assert engine.call_utility("get_request_ids") == []


def test_controls_that_leave_a_way_are_served(engine):
    params = [
        constrained(StructuredOutputsParams(choice=["Paris", "London"]), bad_words=["Paris"]),
        constrained(StructuredOutputsParams(regex="[a-c]{3}"), allowed_token_ids=byte_ids("ab")),
        constrained(PARIS, bad_words=["Pa", "Rome"], min_tokens=2),  # "P" then "a" is the banned "Pa"
    ]
    outputs = [o.outputs[0] for o in engine.generate(["one", "two"], params[:2])]
    assert outputs[0].text == "London" and outputs[0].finish_reason == "stop"
    assert set(outputs[1].text) <= set("ab") and len(outputs[1].text) == 3
    with pytest.raises(
        ValueError, match=r"SamplingParams.bad_words=\('Pa', 'Rome'\) and SamplingParams.min_tokens=2"
    ):
        engine.generate("three", params[2])


def test_a_dead_end_the_search_cannot_reach_fails_at_its_step_with_the_same_names(engine):
    # A stop string (which the search does not follow) leaves the decision to the step that finds no token.
    params = constrained(PARIS, bad_words=["Paris"], stop=["zzz"])
    message = (
        r"^prompts\[1\] \(choice='\[\"Paris\"\]'\): the structured output \(choice='\[\"Paris\"\]'\) and "
        r"SamplingParams.bad_words=\('Paris',\) together leave no token to sample after 'Pari'"
    )
    with pytest.raises(ValueError, match=message):
        engine.generate(["free", "paris"], [SamplingParams(max_tokens=4), params])
    assert engine.generate("still serving", SamplingParams(max_tokens=2))[0].finished


def test_a_search_past_its_budget_decides_nothing_and_the_step_names_the_dead_end(engine, monkeypatch):
    # 4**5 ways through [a-d]{5} before the banned z: more than the search may look at.
    params = constrained(StructuredOutputsParams(regex="[a-d]{5}z"), bad_words=["z"])
    monkeypatch.setattr(dead_ends, "MAX_MASKS", 64)
    with pytest.raises(
        ValueError, match=r"bad_words=\('z',\) together leave no token to sample after '[a-d]{5}'"
    ):
        engine.generate("deep", params)


def test_the_default_model_refuses_the_choice_its_tokenizer_writes_as_one_banned_token():
    # "Paris" is one token of SmolLM2's, and llguidance allows only the tokenization of a forced text.
    with Engine(mode="inproc", max_model_len=256) as engine:
        with pytest.raises(
            ValueError, match=r"bad_words=\('Paris',\) together leave no token to sample at its start"
        ):
            engine.generate("The capital of France is", constrained(PARIS, bad_words=["Paris"]))
        london = engine.generate("The capital of England is", constrained(PARIS, bad_words=["London"]))
        assert london[0].outputs[0].text == "Paris"


def test_the_search_is_built_once_and_names_only_the_controls_a_request_has():
    tokenizer = ByteTokenizer()
    search = DeadEnds("llguidance", tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,))
    search.check(constrained(PARIS, bad_words=["Rome"]))
    backend = search._backend
    with pytest.raises(ValueError, match=r"and SamplingParams.allowed_token_ids=\(83,\) together"):
        search.check(constrained(PARIS, allowed_token_ids=[83]))
    assert search._backend is backend and len(search._compiled) == 1
    assert no_token_left(constrained(PARIS), "") is None  # no control: not this kind of dead end
    assert is_banned(constrained(PARIS, allowed_token_ids=[5]), None, [], 6)
    assert is_banned(constrained(PARIS, bad_words=["ab"]), [[100, 101]], [100], 101)
    assert not is_banned(constrained(PARIS, bad_words=["ab"]), [[100, 101]], [99], 101)
