"""Structured outputs and token controls give the same outputs in every mode and with two data-parallel ranks,
and bad input fails the same way everywhere without harming the engine."""

import asyncio

import pytest

from enginekit import Engine, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
}
PROMPTS = [
    "json please",
    "a regex",
    "pick one",
    "free greedy",
    "free seeded",
    "biased",
    "allowed",
    "no words",
]
PARAMS = [
    SamplingParams(
        max_tokens=32,
        temperature=0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    ),
    SamplingParams(
        max_tokens=16,
        temperature=0.9,
        seed=4,
        n=2,
        structured_outputs=StructuredOutputsParams(regex=r"[a-f]{3,9}"),
    ),
    SamplingParams(
        max_tokens=8, temperature=0.5, seed=1, structured_outputs=StructuredOutputsParams(choice=["x", "y"])
    ),
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=7),
    SamplingParams(max_tokens=12, temperature=0, logit_bias={ord("q") + 3: 100}),
    SamplingParams(max_tokens=12, temperature=0.9, seed=2, allowed_token_ids=[ord(c) + 3 for c in "abc "]),
    SamplingParams(max_tokens=12, temperature=0, bad_words=["ab", "z"]),
]
# llguidance takes an empty alternative; xgrammar's reader refuses it, before the request is sent.
BAD_GRAMMAR = SamplingParams(
    max_tokens=4, structured_outputs=StructuredOutputsParams(grammar='root ::= "a" |')
)
NOT_TAKEN = r"StructuredOutputsParams.grammar is not taken by the xgrammar backend .*EBNF parser error"
SETUPS = {
    "mp": {"mode": "mp", "structured_outputs_backend": "xgrammar"},
    "async": {"mode": "async", "structured_outputs_backend": "xgrammar"},
    "mp, two ranks": {"mode": "mp", "data_parallel_size": 2, "num_kv_blocks": 128},
    "async, two ranks": {"mode": "async", "data_parallel_size": 2, "num_kv_blocks": 128},
}


def run_workload(engine):
    outputs = {
        "generate": engine.generate(PROMPTS, PARAMS),
        "agenerate": asyncio.run(engine.agenerate(PROMPTS[:3], PARAMS[:3])),
        "stream": [list(engine.stream(PROMPTS[1], PARAMS[1]))[-1]],
    }
    return {
        key: [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
        for key, outs in outputs.items()
    }


@pytest.fixture(scope="module")
def references():
    found = {}
    for backend in ("llguidance", "xgrammar"):
        with Engine("builtin", mode="inproc", structured_outputs_backend=backend) as engine:
            found[backend] = run_workload(engine)
    return found


def test_the_workload_follows_its_constraints(references):
    for results in references.values():
        outs = results["generate"]
        assert outs[5][0][1] == "q" * 12
        assert set(outs[6][0][1]) <= set("abc ")
        assert "ab" not in outs[7][0][1] and "z" not in outs[7][0][1]
        assert all(sample[2] == "stop" for sample in outs[0] + outs[1] + outs[2])


@pytest.mark.parametrize("setup", list(SETUPS))
def test_every_mode_gives_the_in_process_outputs_and_refuses_bad_input_alike(setup, references):
    options = SETUPS[setup]
    backend = options.get("structured_outputs_backend", "llguidance")
    with Engine("builtin", **options) as engine:
        assert run_workload(engine) == references[backend]
        for params, message in [
            (
                SamplingParams(logit_bias={300: 1.0}),
                r"logit_bias holds token id 300, outside the vocabulary \(size 259\)",
            ),
            (
                SamplingParams(allowed_token_ids=[5, 259]),
                r"allowed_token_ids holds token id 259, outside the vocabulary",
            ),
        ]:
            with pytest.raises(ValueError, match=message):
                engine.generate("oov", params)
            with pytest.raises(ValueError, match=message):
                asyncio.run(engine.agenerate("oov", params))
        if backend == "xgrammar":
            with pytest.raises(ValueError, match=NOT_TAKEN):
                engine.generate("bad grammar", BAD_GRAMMAR)
            with pytest.raises(ValueError, match=NOT_TAKEN):
                asyncio.run(engine.agenerate("bad grammar", BAD_GRAMMAR))
        assert (
            engine.generate(PROMPTS[:1], PARAMS[:1])[0].outputs[0].token_ids
            == references[backend]["generate"][0][0][0]
        )


def test_bad_input_in_process_fails_as_in_the_other_modes():
    with Engine("builtin", mode="inproc", structured_outputs_backend="xgrammar") as engine:
        with pytest.raises(
            ValueError, match=r"logit_bias holds token id 300, outside the vocabulary \(size 259\)"
        ):
            engine.generate("oov", SamplingParams(logit_bias={300: 1.0}))
        with pytest.raises(ValueError, match=NOT_TAKEN):
            engine.generate("bad grammar", BAD_GRAMMAR)
        assert engine.ping()
