"""StructuredOutputsParams and the token controls of SamplingParams: accepted forms, and every bad value fails at
construction with a message that names it."""

import msgspec
import pydantic
import pytest

from enginekit import SamplingParams, StructuredOutputsParams


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_a_pydantic_model_class_becomes_its_schema():
    params = StructuredOutputsParams(json=Person)
    assert params.json == Person.model_json_schema()
    assert params.kind == "json"


def test_the_same_schema_as_dict_or_text_has_one_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_text = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert StructuredOutputsParams(json=schema).spec == as_text.spec


def test_objects_are_closed_unless_the_schema_says_otherwise():
    closed = StructuredOutputsParams(json={"properties": {"a": {"type": "object"}}}).spec[1]
    assert (
        closed
        == '{"properties":{"a":{"type":"object","additionalProperties":false}},"additionalProperties":false}'
    )
    open_object = {"type": "object", "additionalProperties": True}
    assert (
        StructuredOutputsParams(json=open_object).spec[1] == '{"type":"object","additionalProperties":true}'
    )
    # json_object is any object.
    assert StructuredOutputsParams(json_object=True).spec == ("json_object", '{"type":"object"}', True)


def test_property_order_is_kept():
    schema = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "string"}}}
    text = StructuredOutputsParams(json=schema).spec[1]
    assert text.index("zeta") < text.index("alpha")


def test_params_cross_the_wire_unchanged():
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        logit_bias={5: 2.5},
        allowed_token_ids=[1, 2, 3],
        bad_words=["stop"],
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        truncate_prompt_tokens=8,
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert params.structured_outputs.choice == ("yes", "no")
    assert params.allowed_token_ids == (1, 2, 3) and params.bad_words == ("stop",)


def test_logit_bias_is_clamped_to_100():
    assert SamplingParams(logit_bias={1: 500, 2: -1e9, 3: 0.5}).logit_bias == {1: 100.0, 2: -100.0, 3: 0.5}


BAD = [
    ({}, ValueError, r"needs exactly one of json, regex, choice, grammar or json_object=True, got none"),
    ({"regex": "a", "choice": ["a"]}, ValueError, r"got regex and choice"),
    # A field given a falsy value of the wrong type is named, not taken for "no constraint".
    (
        {"json": False},
        TypeError,
        r"^StructuredOutputsParams.json must be a JSON schema: a dict, its JSON text or a pydantic model class, "
        r"got bool$",
    ),
    ({"json": 0}, TypeError, r"StructuredOutputsParams.json must be a JSON schema: .* got int$"),
    ({"regex": False}, TypeError, r"^StructuredOutputsParams.regex must be a string, got bool$"),
    ({"choice": False}, TypeError, r"^StructuredOutputsParams.choice must be a list of strings, got False$"),
    ({"json_object": 0}, TypeError, r"^StructuredOutputsParams.json_object must be True or False, got 0$"),
    ({"regex": "a", "json_object": False}, None, None),  # False is json_object's default: one constraint
    ({"choice": []}, ValueError, r"StructuredOutputsParams.choice is empty"),
    ({"choice": ["a", ""]}, ValueError, r"choice must hold non-empty strings"),
    ({"choice": "ab"}, TypeError, r"choice must be a list of strings"),
    (
        {"regex": "[a-z"},
        ValueError,
        r"(?s)StructuredOutputsParams.regex does not compile: .*unclosed character class",
    ),
    ({"regex": ""}, ValueError, r"StructuredOutputsParams.regex is an empty string"),
    ({"json": '{"type": "foo"}'}, ValueError, r"(?s)StructuredOutputsParams.json does not compile: .*foo"),
    ({"json": "{oops"}, ValueError, r"StructuredOutputsParams.json is not valid JSON"),
    ({"json": [1, 2]}, TypeError, r"StructuredOutputsParams.json must be a JSON schema"),
    ({"grammar": "root ::= undefined_rule"}, ValueError, r"StructuredOutputsParams.grammar does not compile"),
    ({"grammar": 'root ::= "a" ('}, ValueError, r"StructuredOutputsParams.grammar does not compile"),
    ({"json_object": "yes"}, TypeError, r"json_object must be True or False"),
]


@pytest.mark.parametrize(("options", "exception", "message"), BAD)
def test_bad_constraints_fail_at_construction(options, exception, message):
    if exception is None:
        assert StructuredOutputsParams(**options).kind == next(iter(options))
        return
    with pytest.raises(exception, match=message):
        StructuredOutputsParams(**options)


BAD_CONTROLS = [
    (
        {"structured_outputs": {"regex": "a"}},
        TypeError,
        r"structured_outputs must be a StructuredOutputsParams",
    ),
    ({"logit_bias": {"7": 1.0}}, TypeError, r"logit_bias must be a dict of token id \(an integer\) -> bias"),
    ({"logit_bias": [1]}, TypeError, r"logit_bias must be a dict of token id -> bias"),
    ({"logit_bias": {-1: 1.0}}, ValueError, r"logit_bias keys must be non-negative token ids, got -1"),
    ({"logit_bias": {1: float("nan")}}, ValueError, r"logit_bias must be a finite number"),
    ({"allowed_token_ids": []}, ValueError, r"allowed_token_ids is empty"),
    (
        {"allowed_token_ids": [3, -1]},
        ValueError,
        r"allowed_token_ids must hold non-negative integers, got -1",
    ),
    ({"allowed_token_ids": [1.5]}, TypeError, r"allowed_token_ids must be a list of integers"),
    ({"bad_words": [" "]}, ValueError, r"bad_words must hold words"),
    ({"bad_words": 3}, TypeError, r"bad_words must be a string or a list of strings"),
    ({"skip_special_tokens": 0}, TypeError, r"skip_special_tokens must be True or False"),
    ({"truncate_prompt_tokens": 0}, ValueError, r"truncate_prompt_tokens must be at least 1, or -1"),
]


@pytest.mark.parametrize(("options", "exception", "message"), BAD_CONTROLS)
def test_bad_token_controls_fail_at_construction(options, exception, message):
    with pytest.raises(exception, match=message):
        SamplingParams(**options)
