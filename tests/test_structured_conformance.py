"""Both grammar backends follow the same constraints with the same meaning (llguidance's, the reference), or
the xgrammar backend refuses the difference by name when the request is made.

Three proofs. The backends' masks, compared on the same texts through the built-in byte tokenizer (one token
per byte, so a mask decides each character), accept exactly the same texts for a regex. Generation with both
backends, on the built-in model and on real tokenizers (a tiny Hugging Face checkpoint, the default GGUF
model), gives outputs that satisfy their constraint, checked independently of both: JSON parsed and validated
with jsonschema, a regex with ``re.fullmatch`` on its Python spelling, a choice by membership. What xgrammar
cannot follow is refused before anything is sent, in-process and in a background process, and by the engine
for a request that comes another way, with the feature named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import regex as unicode_regex

import gguf_files
from enginekit import Engine, SamplingParams, StructuredOutputsParams
from enginekit.core.structured import xgrammar_form
from enginekit.core.structured.manager import load_backend
from enginekit.frontend.output_processor import RequestState
from enginekit.model.text.tokenizer import ByteTokenizer
from enginekit.wire.messages import EngineCoreRequest
from hf_checkpoints import build_checkpoint

BACKENDS = ["llguidance", "xgrammar"]


@dataclass(frozen=True)
class Case:
    name: str
    constraint: StructuredOutputsParams
    satisfied: Callable[[str], bool]  # the output follows the constraint (checked without either backend)
    xgrammar_refuses: str | None = None  # what the refusal names, if xgrammar cannot follow it

    def __str__(self) -> str:
        return self.name


def regex_case(name: str, rust: str, python: str, refuses: str | None = None) -> Case:
    return Case(
        name, StructuredOutputsParams(regex=rust), lambda text: bool(re.fullmatch(python, text)), refuses
    )


def choice_case(name: str, choices: list[str]) -> Case:
    return Case(name, StructuredOutputsParams(choice=choices), lambda text: text in choices)


def json_case(name: str, schema: dict[str, Any], refuses: str | None = None, python: Any = None) -> Case:
    """``python``: the same schema in Python's regex dialect, for jsonschema (default: ``schema`` itself)."""
    validator = jsonschema.Draft202012Validator(python or schema)
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return Case(name, constraint, lambda text: validator.is_valid(json.loads(text)), refuses)


def grammar_case(name: str, grammar: str, python: str, refuses: str | None = None) -> Case:
    return Case(
        name, StructuredOutputsParams(grammar=grammar), lambda text: bool(re.fullmatch(python, text)), refuses
    )


def record(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


CASES = [
    regex_case("POSIX class", "[[:alpha:]]{3}", "[A-Za-z]{3}"),
    regex_case(
        "POSIX classes in a class", "[[:digit:][:upper:]]{2,4}-[[:lower:]_]{1,3}", "[0-9A-Z]{2,4}-[a-z_]{1,3}"
    ),
    regex_case("case-insensitive flag", "(?i)(yes|no|maybe)", "(?i:yes|no|maybe)"),
    regex_case("dot-all flag", "(?s)<.{1,4}>", "(?s)<.{1,4}>"),
    Case(
        "Unicode script class",
        StructuredOutputsParams(regex=r"\p{Greek}{2,4}"),
        lambda text: bool(unicode_regex.fullmatch(r"\p{Greek}{2,4}", text)),
    ),
    regex_case("Unicode digits", r"\d{3}", r"\d{3}"),
    regex_case("class set operation", "[a-z&&[^aeiou]]{4}", "[b-df-hj-np-tv-z]{4}"),
    regex_case("escaped caret in a class", r"[\^a-c]{3}", r"[\^a-c]{3}"),
    regex_case("text anchors", r"\A[0-9]{2,3}\z", "[0-9]{2,3}"),
    regex_case("hex escapes", r"\x{1F642}|\u00e9{1,3}", "\U0001f642|\u00e9{1,3}"),
    regex_case("verbose flag", "(?x) [a-c]{2} - [0-9]  # two letters, a dash, a digit", "[a-c]{2}-[0-9]"),
    regex_case("bytes flag", "(?-u)[a-c]{2}", "[a-c]{2}", refuses=r"uses \(\?-u\)"),
    choice_case("emoji choice", ["🙂", "🙃"]),
    choice_case("choice of quotes, backslashes and CJK", ["東京", 'say "hi"', "back\\slash", "tab\there"]),
    choice_case("choices that prefix each other", ["a", "ab", "abc"]),
    json_case(
        "record",
        record(
            ok={"type": "boolean"},
            n={"type": "integer", "minimum": 1, "maximum": 9},
            tag={"enum": ["red", "green"], "type": "string", "title": "Tag"},
            code={"type": "string", "maxLength": 3},
        ),
    ),
    json_case(
        "pattern that needs JSON escapes", record(q={"type": "string", "pattern": '^say "[a-z]{1,4}"$'})
    ),
    json_case("string lengths", record(s={"type": "string", "minLength": 1, "maxLength": 4})),
    json_case(
        "POSIX class in a pattern",
        record(s={"type": "string", "pattern": "^[[:upper:]][[:digit:]]{2}$"}),
        python=record(s={"type": "string", "pattern": "^[A-Z][0-9]{2}$"}),
    ),
    json_case(
        "nullable reference",
        {
            "$defs": {"Size": {"enum": ["S", "M"], "type": "string"}},
            **record(size={"anyOf": [{"$ref": "#/$defs/Size"}, {"type": "null"}], "default": None}),
        },
    ),
    json_case(
        "pattern with maxLength",
        record(code={"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}),
        refuses=r"uses pattern with maxLength \(xgrammar drops the length\) at #/properties/code",
    ),
    json_case(
        "allOf of two schemas",
        record(v={"allOf": [{"type": "integer"}, {"minimum": 2, "maximum": 5}]}),
        refuses=r"uses allOf of more than one schema .* at #/properties/v",
    ),
    json_case(
        "$ref beside a keyword",
        {"$defs": {"s": {"type": "string"}}, **record(v={"$ref": "#/$defs/s", "maxLength": 2})},
        refuses=r"uses \$ref beside maxLength \(xgrammar follows \$ref alone\) at #/properties/v",
    ),
    json_case(
        "multipleOf of a number",
        record(v={"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3}),
        refuses=r"uses multipleOf on a number",
    ),
    grammar_case(
        "GBNF",
        'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-z] [0-9]?',
        r"\([a-z][0-9]?(,[a-z][0-9]?){0,2}\)",
    ),
    grammar_case("GBNF with non-ASCII", 'root ::= "é" [\u03b1-\u03c9]{2} "🙂"', "é[\u03b1-\u03c9]{2}🙂"),
    grammar_case(
        "Lark grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/', "x[0-9]{2}", refuses=r"a grammar in Lark form"
    ),
    grammar_case(
        "GBNF with any character",
        'root ::= "<" . ">"',
        "<.>",
        refuses=r"StructuredOutputsParams.grammar is not taken by the xgrammar backend .*EBNF parser error",
    ),
]
FOLLOWED = [case for case in CASES if case.xgrammar_refuses is None]
REFUSED = [case for case in CASES if case.xgrammar_refuses is not None]


def sampled(constraint: StructuredOutputsParams, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=128, temperature=0.9, seed=seed, n=3, structured_outputs=constraint)


def check_outputs(case: Case, engine: Engine, seed: int = 0) -> list[list[int]]:
    """Generate three samples and check each follows the constraint and ends with "stop"; their tokens."""
    samples = engine.generate("Write:", sampled(case.constraint, seed))[0].outputs
    for sample in samples:
        assert sample.finish_reason == "stop", (case.name, sample.text)
        assert case.satisfied(sample.text), (case.name, sample.text)
    return [sample.token_ids for sample in samples]


# ---- the masks, text by text ---------------------------------------------------------------------------------
PROBES = [
    *("a", "A", "z", "abc", "ABC", "aBc", "0", "9", "42", "٣", "_", " ", "\t", "\n", "\r", "é", "É", "ß"),
    *(
        "\u03b1",
        "\u03a9",
        "\u03bb\u03bc",
        "東",
        "🙂",
        "-",
        "]",
        "[",
        "^",
        "\\",
        ".",
        "!",
        "\x00",
        "\x7f",
        "\u00a0",
        "ab",
        "a\nb",
    ),
    *("a.b", "a4b", "", "aa", "yes", "YeS", "ac", "bc", "é\u0301"),
]
MASK_REGEXES = [
    *(
        "[[:alpha:]]",
        "[[:alnum:]_]+",
        "[[:^alpha:]]",
        "[x[:^alpha:]]",
        "[[:space:]]",
        "[[:punct:]]",
        "[[:word:]]",
    ),
    *(
        r"\d+",
        r"\w+",
        r"\s",
        r"\D",
        r"\W",
        r"\S",
        ".",
        "(?s).",
        "(?R).",
        "[^a]",
        r"\pL",
        r"\p{Greek}+",
        r"\P{L}",
    ),
    *("(?i)a", "(?i)yes", "(?i:a)b", "(?i)[a-c]", "[a-z&&[^aeiou]]", "[a-z--b]", "[[a-c][x-z]]", r"\x{41}"),
    *(
        "[]a]",
        "[^]a]",
        r"[\^]",
        "[a^]",
        r"[\]]",
        "[-a]",
        r"\Aa\z",
        "^(a|b)$",
        "(a|^b)c",
        "(?x) a # x\n b",
        "(?x)a\tb",
    ),
    *(
        "a{2}",
        "a{1,}",
        "a{2,3}?",
        "(a|)",
        "()",
        "(?P<x>a)",
        "(?<y>a)b",
        "[\\d]",
        "[^\\d]",
        "(?U)a+",
        r"\u{E9}",
    ),
]


@pytest.fixture(scope="module")
def byte_backends():
    tokenizer = ByteTokenizer()
    return {
        name: load_backend(name, tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
        for name in BACKENDS
    }


def matches(backend: Any, compiled: Any, text: str) -> bool:
    """Whether the backend's masks let ``text`` through, byte by byte, and then let it end."""
    matcher = backend.matcher(compiled)
    for token in ByteTokenizer().encode(text, add_special_tokens=False):
        if not allowed(backend, matcher, token) or not matcher.accept(token):
            return False
    return matcher.is_terminated() or allowed(backend, matcher, ByteTokenizer.eos_token_id)


def allowed(backend: Any, matcher: Any, token: int) -> bool:
    import torch

    bits = torch.zeros((1, (ByteTokenizer.vocab_size + 31) // 32), dtype=torch.int32)
    backend.fill_bitmask([matcher], bits)
    return bool((int(bits[0, token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("regex", MASK_REGEXES)
def test_both_backends_match_the_same_texts_for_a_regex(byte_backends, regex):
    spec = StructuredOutputsParams(regex=regex).spec
    found = {}
    for name, backend in byte_backends.items():
        compiled = backend.compile(*spec)
        found[name] = [text for text in PROBES if matches(backend, compiled, text)]
    assert found["xgrammar"] == found["llguidance"]


# A string's schema, and whether it needs an escaped character (then both backends take the same texts).
JSON_STRINGS = [
    *[
        ({"type": "string", "pattern": p}, False)
        for p in ("[[:alpha:]]+", r"^\d+$", r"^\w+$", "^.$", "^[^x]$")
    ],
    *[({"type": "string", "pattern": p}, False) for p in (r"^\p{Greek}$", "(?i)^a$", "a", "^a", "a$")],
    *[({"type": "string", "pattern": p}, True) for p in ('^x"y$', r"^x\\y$", "^a\\nb$")],
    ({"type": "string", "minLength": 1, "maxLength": 4}, False),
    ({"type": "string", "maxLength": 1}, False),
]
JSON_PROBES = [*PROBES, 'x"y', "x\\y", "xa", "ax", "xax", "12", "\u0661\u0662"]
UNESCAPED = [
    '"a\tb"',
    '"\x01"',
    '"a\nb"',
    '"\x00"',
    '"x"y"',
]  # not JSON: control characters or a quote as they are


@pytest.mark.parametrize(("schema", "needs_escape"), JSON_STRINGS, ids=lambda value: json.dumps(value))
def test_xgrammar_writes_json_strings_whose_text_llguidance_takes(byte_backends, schema, needs_escape):
    """For a JSON string with a pattern or a length, xgrammar writes no escape the pattern does not need
    (llguidance may): every string it writes, llguidance takes (in its own spelling: it escapes DEL), and both
    take each string written without escapes alike. A pattern that needs a quote, a backslash or a newline gets
    it, escaped; nothing that JSON escapes is written as it is."""
    spec = StructuredOutputsParams(json=schema).spec
    found = {}
    for name, backend in byte_backends.items():
        compiled = backend.compile(*spec)
        found[name] = {
            text for text in JSON_PROBES if any(matches(backend, compiled, j) for j in spellings(text))
        }
        assert not [text for text in UNESCAPED if matches(backend, compiled, text)], name
    assert found["xgrammar"] <= found["llguidance"]
    plain = {text for text in found["llguidance"] if spellings(text)[0][1:-1] == text}
    assert plain <= found["xgrammar"]
    if needs_escape:
        assert found["xgrammar"] == found["llguidance"] and found["xgrammar"]


def spellings(text: str) -> list[str]:
    """``text`` as a JSON string: escaped as JSON requires, and with DEL escaped too."""
    written = json.dumps(text, ensure_ascii=False)
    return [written, written.replace("\x7f", "\\u007f")]


# ---- generation on the built-in model --------------------------------------------------------------------------
@pytest.fixture(scope="module", params=BACKENDS)
def builtin_engine(request):
    with Engine("builtin", mode="inproc", structured_outputs_backend=request.param) as engine:
        yield engine


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_output_follows_its_constraint_or_xgrammar_refuses_it_by_name(builtin_engine, case):
    if builtin_engine.config.structured_outputs_backend == "xgrammar" and case.xgrammar_refuses:
        with pytest.raises(ValueError, match=case.xgrammar_refuses):
            builtin_engine.generate("Write:", sampled(case.constraint, 0))
        return
    check_outputs(case, builtin_engine)


def test_regexes_and_choices_give_the_same_tokens_with_either_backend():
    """With one token per byte the two backends' masks are the same, so the same seeds draw the same tokens."""
    same = [case for case in FOLLOWED if case.constraint.kind in ("regex", "choice")]
    found = {}
    for backend in BACKENDS:
        with Engine("builtin", mode="inproc", structured_outputs_backend=backend) as engine:
            found[backend] = [check_outputs(case, engine, seed=7) for case in same]
    assert found["xgrammar"] == found["llguidance"]


# ---- generation with real tokenizers ---------------------------------------------------------------------------
REAL = [
    case
    for case in CASES
    if case.name
    in (
        "emoji choice",
        "choice of quotes, backslashes and CJK",
        "POSIX class",
        "case-insensitive flag",
        "Unicode script class",
        "pattern that needs JSON escapes",
        "string lengths",
        "GBNF with non-ASCII",
    )
]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("conformance-hf") / "hf", "llama", vocab_size=400))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("conformance-gguf") / "tiny.gguf"
    gguf_files.write_tiny_gguf(path)
    return str(path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["tiny Hugging Face checkpoint", "tiny GGUF file"])
def test_outputs_follow_their_constraints_with_a_real_tokenizer(backend, source, tiny_hf, tiny_gguf):
    model = tiny_hf if source.startswith("tiny Hugging") else tiny_gguf
    with Engine(model, mode="inproc", structured_outputs_backend=backend) as engine:
        for case in REAL:
            check_outputs(case, engine)


# On the default model, the cases where its tokenizer's multi-byte and merged tokens matter.
DEFAULT_MODEL = [case for case in REAL if case.constraint.kind in ("choice", "json") or "POSIX" in case.name]


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_follow_their_constraints_on_the_default_model(backend):
    with Engine(mode="inproc", max_model_len=512, structured_outputs_backend=backend) as engine:
        for case in DEFAULT_MODEL:
            check_outputs(case, engine)


# ---- refusals, in every mode ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["inproc", "mp"])
def xgrammar_engine(request):
    with Engine("builtin", mode=request.param, structured_outputs_backend="xgrammar") as engine:
        yield engine


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_xgrammar_refuses_a_difference_before_anything_is_sent(xgrammar_engine, case):
    compiled = xgrammar_engine.get_stats()["grammars_compiled"]
    with pytest.raises(ValueError, match=case.xgrammar_refuses):
        xgrammar_engine.generate("Write:", sampled(case.constraint, 0))
    with pytest.raises(ValueError, match=case.xgrammar_refuses):
        xgrammar_engine.stream("Write:", sampled(case.constraint, 0))
    assert xgrammar_engine.call_utility("get_request_ids") == []
    assert xgrammar_engine.get_stats()["grammars_compiled"] == compiled


@pytest.mark.parametrize("case", REFUSED[:3], ids=str)
def test_the_engine_refuses_a_difference_that_comes_as_a_raw_message(xgrammar_engine, case):
    request_id = f"raw {case.name}"
    xgrammar_engine.client.add_request(EngineCoreRequest(request_id, [5, 6], sampled(case.constraint, 0)))
    state = RequestState(request_id, None, [], SamplingParams())
    xgrammar_engine._router.track(state)
    with pytest.raises(ValueError, match=case.xgrammar_refuses):
        xgrammar_engine._router.wait([state])
    assert xgrammar_engine.generate("still serving", SamplingParams(max_tokens=2))[0].finished


def test_a_refusal_in_a_batch_names_the_prompt_and_its_constraint(xgrammar_engine):
    fine = sampled(FOLLOWED[0].constraint, 0)
    refused = REFUSED[0]
    with pytest.raises(
        ValueError,
        match=r"^prompts\[1\] \(regex='\(\?-u\)\[a-c\]\{2\}'\): StructuredOutputsParams.regex "
        + refused.xgrammar_refuses,
    ):
        xgrammar_engine.generate(["one", "two", "three"], [fine, sampled(refused.constraint, 0), fine])
    assert xgrammar_engine.call_utility("get_request_ids") == []


def test_string_lengths_fall_back_to_a_pattern_when_xgrammar_writes_its_grammar_otherwise(monkeypatch):
    """Where an xgrammar version writes its length-limited strings' rule differently, the lengths become a
    pattern instead (slower to compile, as right): still no control character unescaped."""
    tokenizer = ByteTokenizer()
    backend = load_backend("xgrammar", tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    monkeypatch.setattr(xgrammar_form, "_LENGTH_LIMITED_CHARACTERS", re.compile("(?!)"))
    compiled = backend.compile(*StructuredOutputsParams(json={"type": "string", "maxLength": 3}).spec)
    assert [
        text for text in ('"ab"', '"a\\tb"', '"\t"', '"abcd"', '"é🙂"') if matches(backend, compiled, text)
    ] == [
        '"ab"',
        '"é🙂"',
    ]
