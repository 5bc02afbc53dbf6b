"""StructuredOutputsParams: constrain what a request may generate to a JSON schema, a regex, a choice or a grammar."""

from __future__ import annotations

import functools
import json as jsonlib
from typing import Any, Literal

import msgspec

__all__ = ["MAX_JSON_WHITESPACE", "GrammarKind", "StructuredOutputsParams"]

MAX_JSON_WHITESPACE = 20

GrammarKind = Literal["json", "regex", "choice", "grammar", "json_object"]
_KINDS: tuple[GrammarKind, ...] = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """What a request may generate (vLLM's name and fields); give exactly one of the constraints.

    The engine compiles the constraint once per engine (and caches it by its text), then masks the logits of
    every step so that only tokens the constraint allows can be sampled. The request ends with
    ``finish_reason="stop"`` when the constraint is complete and nothing more can follow (a JSON object closed,
    a choice made), or when the model ends it where it may end; ``max_tokens`` reached first gives
    ``"length"`` and the partial text.

    Parameters
    ----------
    json
        A JSON schema: a dict, its JSON text, or a pydantic model class (its ``model_json_schema()``). An object
        schema that does not say ``additionalProperties`` takes only its listed properties, and an array with
        ``prefixItems`` but no ``items`` only those items (as xgrammar's strict mode, vLLM's default): write
        ``"additionalProperties": true`` to allow others.
    regex
        A regular expression the whole output matches (Rust ``regex`` syntax: no look-around or backreferences).
    choice
        A list of strings: the output is exactly one of them.
    grammar
        An EBNF grammar in the GBNF form of llama.cpp and xgrammar: rules ``name ::= ...``, starting at
        ``root``. The llguidance backend also takes its Lark form (``start: ...``).
    json_object
        ``True``: any JSON object.
    disable_any_whitespace
        JSON without whitespace between its tokens. By default up to ``MAX_JSON_WHITESPACE`` (20) whitespace
        characters may go between two tokens: enough to indent nine levels, too few for a small model to
        lose itself in blank lines.

    Raises
    ------
    ValueError
        No constraint or more than one, an empty choice list, or a schema, regex or grammar that does not
        compile (checked here with the llguidance compiler, without a tokenizer).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar or json_object=True, "
                f"got {' and '.join(given) if given else 'none'}"
            )
        model_json_schema = getattr(self.json, "model_json_schema", None)
        if isinstance(self.json, type) and callable(model_json_schema):  # a pydantic model class
            msgspec.structs.force_setattr(self, "json", model_json_schema())
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"StructuredOutputsParams.{name} must be True or False, got {getattr(self, name)!r}"
                )
        kind = given[0]
        check = {"json": _check_json, "choice": _check_choice}.get(kind, _check_text)
        check(self, kind)
        message = _compile_error(*self.spec)
        if message:
            raise ValueError(f"StructuredOutputsParams.{kind} does not compile: {message}")

    def _given(self) -> list[GrammarKind]:
        """The constraints given: every field that is not its default (``json=False`` is a schema given
        wrongly, not a schema left out)."""
        return [
            kind for kind in _KINDS if getattr(self, kind) is not (False if kind == "json_object" else None)
        ]

    @property
    def kind(self) -> GrammarKind:
        return self._given()[0]

    @property
    def spec(self) -> tuple[GrammarKind, str, bool]:
        """``(kind, text, any_whitespace)``: what a backend compiles, and the key compiled grammars are cached by.
        A schema's text is its compact JSON (in its own key order, which is the order properties are generated
        in), so the same schema given as a dict or a string compiles once; a choice's text is the JSON list of
        its strings."""
        kind = self.kind
        if kind == "json":
            schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
            text = jsonlib.dumps(_closed(schema), separators=(",", ":"))
        elif kind == "choice":
            text = jsonlib.dumps(list(self.choice or ()))
        elif kind == "json_object":
            text = '{"type":"object"}'
        else:
            text = getattr(self, kind)
        return kind, text, not self.disable_any_whitespace


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` where objects without ``additionalProperties`` take no other properties, and arrays
    with ``prefixItems`` but no ``items`` no other items."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed(value) for name, value in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [_closed(value) for value in schema[key]]
    for key in _SCHEMAS:
        if key in schema:
            closed[key] = _closed(schema[key])
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        closed["additionalProperties"] = False
    if "prefixItems" in schema and "items" not in schema and "unevaluatedItems" not in schema:
        closed["items"] = False
    return closed


def _check_json(params: StructuredOutputsParams, kind: str) -> None:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as error:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise TypeError(
            "StructuredOutputsParams.json must be a JSON schema: a dict, its JSON text or a pydantic model class, "
            f"got {type(params.json).__name__}"
        )
    try:
        jsonlib.dumps(schema)
    except (TypeError, ValueError) as error:
        raise TypeError(f"StructuredOutputsParams.json holds a value JSON cannot write: {error}") from None


def _check_choice(params: StructuredOutputsParams, kind: str) -> None:
    choice = params.choice
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise TypeError(f"StructuredOutputsParams.choice must be a list of strings, got {choice!r}")
    if not choice:
        raise ValueError("StructuredOutputsParams.choice is empty: give at least one string to choose from")
    if not all(isinstance(item, str) and item for item in choice):
        raise ValueError(f"StructuredOutputsParams.choice must hold non-empty strings, got {list(choice)!r}")
    if type(choice) is not tuple:
        msgspec.structs.force_setattr(params, "choice", tuple(choice))


def _check_text(params: StructuredOutputsParams, kind: str) -> None:
    value = getattr(params, kind)
    if kind == "json_object":
        return
    if not isinstance(value, str):
        raise TypeError(f"StructuredOutputsParams.{kind} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"StructuredOutputsParams.{kind} is an empty string")


@functools.lru_cache(maxsize=256)
def _compile_error(kind: GrammarKind, text: str, any_whitespace: bool) -> str:
    """What the llguidance compiler finds wrong with a constraint (no tokenizer needed), or ``""``."""
    try:
        from llguidance import LLMatcher, grammar_from
    except ImportError:  # the engine's own backend checks it when the request arrives
        return ""
    try:
        if kind in ("json", "json_object"):
            grammar = LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": any_whitespace}
            )
        else:
            grammar = grammar_from("grammar" if kind == "grammar" else kind, text)
    except ValueError as error:
        return str(error)
    return LLMatcher.validate_grammar(grammar).strip()
