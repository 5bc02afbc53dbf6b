"""Structured outputs in the engine (the built-in model, in-process): every constraint is followed by both
backends, ends as it should, and composes with n, seeds, preemption, the prefix cache, streams and free requests
in the same batch; grammars compile once, off the step loop."""

import json
import re
import threading

import pytest

from enginekit import Engine, RequestOutputKind, SamplingParams, StructuredOutputsParams
from enginekit.core.structured.manager import StructuredOutputManager
from enginekit.frontend.output_processor import RequestState
from enginekit.model.text.tokenizer import ByteTokenizer
from enginekit.wire.messages import EngineCoreRequest
from process_support import HANG_GUARD_S

BACKENDS = ["llguidance", "xgrammar"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "count", "tag"],
}
REGEX = r"[0-9]{4}-[a-c]{1,3}\."
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z] [0-9]?'


def constrained(max_tokens=48, **options):
    names = ("temperature", "seed", "n", "output_kind", "logit_bias")
    sampling = {key: options.pop(key) for key in names if key in options}
    sampling.setdefault("temperature", 0.0)
    return SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**options), **sampling
    )


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request):
    with Engine("builtin", mode="inproc", structured_outputs_backend=request.param) as engine:
        yield engine


def test_each_constraint_is_followed_and_ends_with_stop(engine):
    params = [
        constrained(json=SCHEMA, disable_any_whitespace=True),
        constrained(regex=REGEX),
        constrained(choice=["alpha", "beta", "gamma"]),
        constrained(grammar=GRAMMAR, temperature=0.7, seed=1),
        # The random model would write one long key: a bias towards quotes and braces ends its strings.
        constrained(
            json_object=True, temperature=0.7, seed=2, logit_bias={ord('"') + 3: 4.0, ord("}") + 3: 4.0}
        ),
    ]
    outs = [o.outputs[0] for o in engine.generate(["a", "b", "c", "d", "e"], params)]
    record = json.loads(outs[0].text)
    assert set(record) == {"ok", "count", "tag"} and record["tag"] in ("red", "green")
    assert re.fullmatch(REGEX, outs[1].text)
    assert outs[2].text in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"\([a-z][0-9]?(,[a-z][0-9]?)*\)", outs[3].text)
    assert isinstance(json.loads(outs[4].text), dict)
    assert [o.finish_reason for o in outs] == ["stop"] * 5


def test_max_tokens_first_gives_length_and_the_partial_text(engine):
    out = engine.generate("x", constrained(max_tokens=3, regex=r"[a-z]{10}"))[0].outputs[0]
    assert out.finish_reason == "length"
    assert re.fullmatch(r"[a-z]{3}", out.text) and len(out.token_ids) == 3


def test_free_requests_keep_their_own_tokens_beside_constrained_ones(engine):
    free = [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=24, temperature=0.9, seed=5),
    ]
    alone = engine.generate(["free one", "free two"], free)
    mixed = engine.generate(
        ["free one", "json", "free two", "regex"],
        [free[0], constrained(json=SCHEMA), free[1], constrained(regex=REGEX, temperature=0.8, seed=3)],
    )
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [o.outputs[0].token_ids for o in alone]


def test_n_samples_follow_the_constraint_with_seed_plus_i(engine):
    params = constrained(regex=REGEX, temperature=1.0, seed=11, n=3)
    samples = engine.generate("n", params)[0].outputs
    assert len(samples) == 3 and all(re.fullmatch(REGEX, s.text) for s in samples)
    second = constrained(regex=REGEX, temperature=1.0, seed=12)
    assert engine.generate("n", second)[0].outputs[0].token_ids == samples[1].token_ids


def test_a_stream_of_deltas_adds_up_to_the_output(engine):
    params = constrained(regex=REGEX, output_kind=RequestOutputKind.DELTA)
    deltas = list(engine.stream("stream", params))
    text = "".join(d.outputs[0].text for d in deltas)
    assert re.fullmatch(REGEX, text) and deltas[-1].outputs[0].finish_reason == "stop"
    assert text == engine.generate("stream", constrained(regex=REGEX))[0].outputs[0].text


def test_a_cached_prefix_changes_nothing(engine):
    prompt = "A shared prefix long enough to fill a few KV blocks of sixteen tokens each. " * 2
    first, second = (engine.generate(prompt, constrained(json=SCHEMA))[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_each_grammar_compiles_once(engine):
    before = engine.get_stats()
    params = constrained(choice=["one grammar", "compiled once"])
    engine.generate(["p", "q", "r"], [params] * 3)
    after = engine.get_stats()
    assert after["grammars_compiled"] - before["grammars_compiled"] == 1
    assert after["grammar_cache_hits"] - before["grammar_cache_hits"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_preempted_constrained_request_recomputes_to_the_same_output(backend):
    prompts = [f"Request number {i} asks for a long answer" for i in range(6)]
    params = [constrained(max_tokens=60, regex=r"[a-z ]{20,80}")] * 3 + [
        SamplingParams(max_tokens=60, temperature=0)
    ] * 3
    options = {"mode": "inproc", "structured_outputs_backend": backend}
    with Engine("builtin", num_kv_blocks=24, block_size=16, max_model_len=256, **options) as tight:
        squeezed = tight.generate(prompts, params)
        assert tight.get_stats()["num_preemptions"] > 0
    with Engine("builtin", **options) as roomy:
        expected = roomy.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in expected]
    assert all(re.fullmatch(r"[a-z ]{20,80}", o.outputs[0].text) for o in squeezed[:3])


def test_a_request_waits_for_its_grammar_while_the_batch_goes_on():
    with Engine("builtin", mode="inproc") as engine:
        manager = engine.client.core.structured
        compile_grammar, release = manager._compile, threading.Event()

        def held_compile(spec):  # the real compile, once the test lets it run
            release.wait(HANG_GUARD_S)
            return compile_grammar(spec)

        manager._compile = held_compile
        free = engine.stream("free", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        waiting = engine.stream("json", constrained(regex=REGEX))
        assert next(free).outputs[0].token_ids  # the free request generates while the grammar is held
        free_out = list(free)[-1]
        assert free_out.finished and len(free_out.outputs[0].token_ids) == 6
        assert engine.get_stats()["num_waiting_requests"] == 1
        release.set()
        assert re.fullmatch(REGEX, list(waiting)[-1].outputs[0].text)


def test_a_grammar_xgrammar_does_not_take_is_refused_before_it_is_sent_and_by_the_engine():
    # llguidance takes an empty alternative; xgrammar's reader does not.
    params = constrained(grammar='root ::= "yes" |')
    message = r"StructuredOutputsParams.grammar is not taken by the xgrammar backend .*: EBNF parser error"
    with Engine("builtin", mode="inproc", structured_outputs_backend="xgrammar") as engine:
        with pytest.raises(ValueError, match=message):
            engine.generate("bad", params)
        assert engine.get_stats()["grammars_compiled"] == 0  # refused before anything was sent
        # The same request from another front end (a raw message): the engine refuses it the same way.
        engine.client.add_request(EngineCoreRequest("raw", [5, 6], params))
        state = RequestState("raw", None, [], params)
        engine._router.track(state)
        with pytest.raises(ValueError, match=message):
            engine._router.wait([state])
        assert engine.generate("fine", constrained(choice=["ok"]))[0].outputs[0].text == "ok"


def test_a_constraint_that_does_not_compile_fails_at_once_the_second_time():
    # A failed compile is cached: the same mistake fails at once, without compiling again. (Reached when a
    # backend's compile with the tokenizer refuses what its reader took.)
    tokenizer = ByteTokenizer()
    manager = StructuredOutputManager("xgrammar", tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    params = StructuredOutputsParams(grammar='root ::= "yes" |')
    try:
        for _ in range(2):
            grammar = manager.request_grammar(params)
            manager.wait([grammar], timeout=30)
            assert manager.resolve(grammar) and grammar.matcher is None
            assert re.search(
                r"the grammar constraint does not compile: .*EBNF parser error", str(grammar.error)
            )
        assert (manager.num_compiled, manager.num_cache_hits) == (0, 1)
    finally:
        manager.shutdown()


def test_the_xgrammar_backend_needs_its_package(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "xgrammar" else find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'enginekit\[xgrammar\]'"):
        Engine("builtin", mode="inproc", structured_outputs_backend="xgrammar")
