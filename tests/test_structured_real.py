"""Structured outputs on the default real model (SmolLM2-135M-Instruct, its GGUF file, as stored), in-process:
records extracted through ``chat()`` with a pydantic class parse and validate; regex, choice and grammar outputs
match; the end of the grammar gives "stop" and ``max_tokens`` first "length" with the partial text; ``n > 1``
seeded samples; a stream of deltas; free requests batched with constrained ones keep their own tokens; a
preempted constrained request recomputes to the same output."""

from __future__ import annotations

import json
import re

import pydantic
import pytest

from enginekit import Engine, RequestOutputKind, SamplingParams, StructuredOutputsParams

BACKENDS = ["llguidance", "xgrammar"]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=150)
    city: str = pydantic.Field(max_length=40)


TEXTS = [
    "Maria Lopez is 34 years old and lives in Madrid.",
    "Our new colleague, Tom Becker (age 51), moved here from Berlin.",
]
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Extract the person as JSON with name, age and city.\n{text}"}]


def constrained(max_tokens: int = 64, **options) -> SamplingParams:
    sampling = {k: options.pop(k) for k in ("temperature", "seed", "n", "output_kind") if k in options}
    sampling.setdefault("temperature", 0.0)
    return SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**options), **sampling
    )


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request):
    with Engine(mode="inproc", max_model_len=512, structured_outputs_backend=request.param) as engine:
        yield engine


def test_chat_extracts_records_that_validate_against_the_pydantic_class(engine):
    outputs = engine.chat([ask(text) for text in TEXTS], constrained(json=Person))
    people = [Person.model_validate_json(o.outputs[0].text) for o in outputs]
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop", "stop"]
    assert "Maria" in people[0].name and people[0].age == 34 and people[0].city == "Madrid"
    assert "Tom" in people[1].name and people[1].age == 51


def test_regex_choice_and_grammar_are_followed_and_end_with_stop(engine):
    prompts = ["The date of the moon landing was", "Is the sky green? Answer yes or no:", "Is 7 prime?"]
    params = [
        constrained(regex=DATE),
        constrained(choice=["yes", "no"]),
        constrained(grammar=GRAMMAR, temperature=0.8, seed=3),
    ]
    outs = [o.outputs[0] for o in engine.generate(prompts, params)]
    assert re.fullmatch(DATE, outs[0].text)
    assert outs[1].text in ("yes", "no")
    assert re.fullmatch(r"The answer is (yes|no)\.", outs[2].text)
    assert [o.finish_reason for o in outs] == ["stop"] * 3


def test_max_tokens_first_gives_length_and_the_start_of_the_full_output(engine):
    conversation = ask(TEXTS[0])
    full = engine.chat(conversation, constrained(json=Person))[0].outputs[0]
    cut = engine.chat(conversation, constrained(max_tokens=5, json=Person))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    assert cut.token_ids == full.token_ids[:5] and full.text.startswith(cut.text) and cut.text


def test_n_seeded_samples_each_follow_the_schema_and_repeat(engine):
    params = constrained(json=Person, temperature=1.0, seed=21, n=3)
    first = engine.chat(ask(TEXTS[1]), params)[0].outputs
    again = engine.chat(ask(TEXTS[1]), params)[0].outputs
    assert len(first) == 3 and all(Person.model_validate_json(s.text) for s in first)
    assert [s.token_ids for s in again] == [s.token_ids for s in first]


def test_a_stream_of_deltas_adds_up_to_the_record(engine):
    params = constrained(json=Person, output_kind=RequestOutputKind.DELTA)
    deltas = list(engine.stream_chat(ask(TEXTS[0]), params))
    text = "".join(d.outputs[0].text for d in deltas)
    assert text == engine.chat(ask(TEXTS[0]), constrained(json=Person))[0].outputs[0].text
    assert deltas[-1].outputs[0].finish_reason == "stop" and Person.model_validate_json(text)


def test_free_requests_keep_their_tokens_beside_constrained_ones(engine):
    # The reference is the same batch with free requests of the same lengths in the constrained ones' places:
    # the same rows in every step, so only the bitmask differs between the two runs. (A batch's row count picks
    # the kernel of the stored weights, int8 inputs at up to 16 rows, exact ones past that, so the same request
    # alone, or beside a prefill, may round a greedy tie the other way.) The grammar is compiled first, so that
    # the constrained requests start with the free ones instead of waiting for it.
    engine.generate("warm", constrained(max_tokens=2, json=Person))
    free = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True),
    ]
    prompts = ["The capital of France is", "Once upon a time,"] + [f"Person number {i}:" for i in range(4)]
    engine.call_utility("reset_prefix_cache")
    mixed = engine.generate(prompts, free + [constrained(max_tokens=24, json=Person)] * 4)
    lengths = [len(o.outputs[0].token_ids) for o in mixed[2:]]
    stand_ins = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    engine.call_utility("reset_prefix_cache")
    reference = engine.generate(prompts, free + stand_ins)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in reference[:2]]
    for out in mixed[2:]:  # a record, or its start when 24 tokens run out first
        sample = out.outputs[0]
        assert sample.text.startswith("{")
        if sample.finish_reason == "stop":
            assert set(json.loads(sample.text)) == {"name", "age", "city"}


def test_a_preempted_constrained_request_recomputes_to_the_same_output():
    conversations = [ask(text) for text in TEXTS * 2]
    params = constrained(max_tokens=48, json=Person)
    # quantization="none": weights kept as stored make a row's products depend on the step's size (int8 inputs
    # at up to 16 rows), and preemption changes the steps; the float reference does not.
    exact = {"mode": "inproc", "max_model_len": 192, "quantization": "none"}
    with Engine(**exact, num_kv_blocks=12, block_size=16) as tight:
        squeezed = tight.chat(conversations, params)
        assert tight.get_stats()["num_preemptions"] > 0
    with Engine(**exact) as roomy:
        expected = roomy.chat(conversations, params)
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in expected]
