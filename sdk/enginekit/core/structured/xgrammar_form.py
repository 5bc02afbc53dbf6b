"""What the xgrammar backend compiles for a constraint, so that it follows it as llguidance does; or why it cannot.

Both backends take the constraints the API documents, with llguidance's meaning (llguidance is the reference:
``StructuredOutputsParams`` is checked with its compiler). xgrammar gets each constraint in a form that makes
it follow that meaning, found by comparing the two backends' masks on the same texts:

- a choice becomes an EBNF grammar of its strings, written as they are (UTF-8): xgrammar reads a ``\\uXXXX``
  escape as one code point, so an emoji's surrogate pair became two lone surrogates;
- a regex, and each ``pattern`` of a JSON schema, is rewritten by ``regex_form.py`` (POSIX and Unicode
  classes, flags, ``.``, JSON escapes);
- a JSON schema is compiled through xgrammar's own grammar of it (``json_grammar``), with the class of its
  length-limited strings' characters narrowed to what JSON writes unescaped (it let control characters
  through, which is not JSON);
- the JSON-schema combinations xgrammar would silently drop part of (it follows a ``$ref``, ``const``, ``enum``
  or ``anyOf`` alone and ignores what stands beside it; ``allOf`` of several schemas; ``pattern`` or
  ``format`` with a length; ``multipleOf`` of a number, or of an integer with a one-sided or wide range) are
  refused by name, as are a grammar in Lark form and the regex features ``regex_form.py`` refuses.

``xgrammar_refusal`` is what the facade and the engine core check when a request is made, with xgrammar's own
reader besides, so a constraint xgrammar does not take fails before anything is sent.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from llguidance.gbnf_to_lark import is_lark_syntax

from enginekit.core.structured.regex_form import NotFollowed, json_string_of_length, xgrammar_regex
from enginekit.structured_outputs import MAX_JSON_WHITESPACE, GrammarKind

__all__ = ["NotFollowed", "xgrammar_form", "xgrammar_refusal"]

MAX_INTEGER_MULTIPLE_OF = 1024  # xgrammar ignores a larger multipleOf of an integer
MAX_MULTIPLE_OF_RANGE = 10_000  # ... and one within a wider range

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "deprecated"}
    | {"readOnly", "writeOnly", "$defs", "definitions"}
)
# Where a schema holds schemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SCHEMAS_ALSO = ("not", "if", "then", "else", "contains")
# xgrammar follows the first of these a schema has, and nothing beside it.
_ALONE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_LENGTHS = ("minLength", "maxLength")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# xgrammar's rule for one character of a string with minLength or maxLength, and what it must be instead.
_LENGTH_LIMITED_CHARACTERS = re.compile(r'^(\S+ ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
_JSON_CHARACTER = r"[^\0-\x1f\"\\]"
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+\.(cc|h):\d+:\s*")
_JSON_TYPES = {str: "string", bool: "boolean", type(None): "null", list: "array", dict: "object"}


@functools.lru_cache(maxsize=256)
def xgrammar_form(kind: GrammarKind, text: str) -> str:
    """What xgrammar compiles for the constraint ``(kind, text)`` (``StructuredOutputsParams.spec``): a JSON
    schema (``json``, ``json_object``), a regex (``regex``) or an EBNF grammar (``choice``, ``grammar``).
    Raises ``NotFollowed`` naming what xgrammar cannot be made to follow, with where in a schema."""
    if kind == "regex":
        return xgrammar_regex(text)
    if kind == "choice":
        return "root ::= " + " | ".join(_ebnf_string(choice) for choice in json.loads(text))
    if kind == "grammar":
        if is_lark_syntax(text):
            raise NotFollowed("a grammar in Lark form (xgrammar reads GBNF only)")
        return text
    return _schema_form(text, lengths_as_patterns=False)


def json_grammar(text: str, any_whitespace: bool) -> str:
    """The EBNF grammar xgrammar compiles for the JSON schema ``text`` (a ``json`` or ``json_object`` spec's):
    xgrammar's own grammar of the schema's form, with its length-limited strings kept from writing control
    characters unescaped (its class of their characters lets everything but quotes, backslashes and line
    breaks through). ``NotFollowed`` as ``xgrammar_form``."""
    import xgrammar

    form = xgrammar_form("json", text)
    grammar = str(xgrammar.Grammar.from_json_schema(form, **json_options(any_whitespace)))
    patched, count = _LENGTH_LIMITED_CHARACTERS.subn(
        lambda found: found[1] + _JSON_CHARACTER + found[2], grammar
    )
    if count or _schema_form(text, lengths_as_patterns=True) == form:
        return patched
    # NOTE: an xgrammar whose grammar reads otherwise: the lengths as patterns, as right but slower to compile
    # (xgrammar unrolls a pattern's repetition).
    return str(
        xgrammar.Grammar.from_json_schema(
            _schema_form(text, lengths_as_patterns=True), **json_options(any_whitespace)
        )
    )


@functools.lru_cache(maxsize=256)
def _schema_form(text: str, *, lengths_as_patterns: bool) -> str:
    return json.dumps(_schema(json.loads(text), "#", lengths_as_patterns), separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def xgrammar_refusal(kind: GrammarKind, text: str, any_whitespace: bool) -> str | None:
    """Why the xgrammar backend refuses this constraint (a difference from llguidance, or what its own reader
    finds wrong), as the message of the ``ValueError`` its request gets; ``None`` if it takes it."""
    try:
        form = xgrammar_form(kind, text)
    except NotFollowed as difference:
        return (
            f"StructuredOutputsParams.{kind} uses {difference}, which the xgrammar backend "
            "(structured_outputs_backend='xgrammar') does not follow as llguidance does: use the llguidance "
            f"backend (the default), or write the {kind} without it"
        )
    import xgrammar  # NOTE: deferred: it imports transformers, seconds at the first constrained request

    try:
        if kind == "regex":
            xgrammar.Grammar.from_regex(form)
        elif kind in ("choice", "grammar"):
            xgrammar.Grammar.from_ebnf(form)
        else:
            xgrammar.Grammar.from_json_schema(form, **json_options(any_whitespace))
    except (RuntimeError, ValueError) as error:
        return (
            f"StructuredOutputsParams.{kind} is not taken by the xgrammar backend "
            f"(structured_outputs_backend='xgrammar'): {clean_message(error)}. The llguidance backend (the "
            "default) takes it"
        )
    return None


def json_options(any_whitespace: bool) -> dict[str, Any]:
    """xgrammar's options for a JSON schema: compact separators, bounded whitespace between tokens."""
    return {
        "any_whitespace": any_whitespace,
        "separators": (",", ":"),
        "max_whitespace_cnt": MAX_JSON_WHITESPACE,
    }


def clean_message(error: BaseException) -> str:
    """xgrammar's message without the log prefix its C++ side adds (``[20:17:05] /project/cpp/x.cc:94: ``)."""
    return _LOCATION.sub("", str(error).strip())


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal: its characters as they are, but quotes, backslashes and control
    characters escaped."""
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    spelled = (
        escapes.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x20 or ord(char) == 0x7F else char)
        for char in text
    )
    return '"' + "".join(spelled) + '"'


# ---- JSON schemas --------------------------------------------------------------------------------------------
def _schema(schema: Any, path: str, lengths_as_patterns: bool) -> Any:
    """``schema`` (at ``path``) in xgrammar's form, subschemas included; what it would not follow is refused,
    this schema's own keywords before its subschemas'."""
    if not isinstance(schema, dict):
        return schema
    form = dict(schema)
    constraints = set(schema) - _ANNOTATIONS
    alone = next((key for key in _ALONE if key in schema), None)
    types = schema.get("type")
    names = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
    if alone is not None:
        _check_alone(schema, alone, constraints - {alone}, path)
    elif not names and constraints - {"type"} and not _is_object_or_array(schema):
        keywords = ", ".join(sorted(constraints))
        raise _difference(f"{keywords} without a type (xgrammar then takes any value)", path)
    elif "string" in names:
        _string(schema, form, path, lengths_as_patterns)
    if alone is None and "multipleOf" in schema and ("integer" in names or "number" in names):
        _multiple_of(schema, names, path)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            form[key] = {
                name: _schema(value, f"{path}/{key}/{name}", lengths_as_patterns)
                for name, value in schema[key].items()
            }
    if isinstance(schema.get("patternProperties"), dict):
        form["patternProperties"] = {
            _pattern(name, f"{path}/patternProperties"): _schema(
                value, f"{path}/patternProperties/{name}", lengths_as_patterns
            )
            for name, value in schema["patternProperties"].items()
        }
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            form[key] = [
                _schema(value, f"{path}/{key}/{index}", lengths_as_patterns)
                for index, value in enumerate(schema[key])
            ]
    for key in _SCHEMAS + _SCHEMAS_ALSO:
        if key in schema:
            form[key] = _schema(schema[key], f"{path}/{key}", lengths_as_patterns)
    return form


def _is_object_or_array(schema: dict[str, Any]) -> bool:
    """Whether xgrammar reads a schema without a type as an object or an array (from the keywords it has)."""
    keys = (
        "properties",
        "additionalProperties",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
    )
    return any(key in schema for key in keys)


def _check_alone(schema: dict[str, Any], alone: str, beside: set[str], path: str) -> None:
    if alone in ("const", "enum") and beside <= {"type"}:
        values = [schema["const"]] if alone == "const" else schema["enum"]
        allowed = schema.get("type")
        allowed = {allowed} if isinstance(allowed, str) else set(allowed or ())
        if not allowed or all(_json_type(value) & allowed for value in values):
            return
        raise _difference(f"{alone} values that are not of its type {schema['type']!r}", path)
    if alone == "allOf" and len(schema["allOf"]) > 1:
        raise _difference("allOf of more than one schema (xgrammar follows none of them)", path)
    if beside:
        keywords = ", ".join(sorted(beside))
        raise _difference(f"{alone} beside {keywords} (xgrammar follows {alone} alone)", path)


def _json_type(value: Any) -> set[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {_JSON_TYPES.get(type(value), "object")}
    return {"number", "integer"} if float(value).is_integer() else {"number"}


def _string(schema: dict[str, Any], form: dict[str, Any], path: str, lengths_as_patterns: bool) -> None:
    lengths = [key for key in _LENGTHS if key in schema]
    for shaped in ("pattern", "format"):
        if shaped in schema and lengths:
            raise _difference(f"{shaped} with {' and '.join(lengths)} (xgrammar drops the length)", path)
    if "pattern" in schema and "format" in schema:
        raise _difference("pattern with format (xgrammar drops the pattern)", path)
    if "pattern" in schema:
        form["pattern"] = _pattern(schema["pattern"], path)
    elif lengths and lengths_as_patterns:
        for key in lengths:
            del form[key]
        form["pattern"] = json_string_of_length(schema.get("minLength", 0), schema.get("maxLength"))


def _pattern(pattern: str, path: str) -> str:
    try:
        return xgrammar_regex(pattern, json_string=True)
    except NotFollowed as difference:
        raise _difference(f"{difference} in the pattern {pattern!r}", path) from None


def _multiple_of(schema: dict[str, Any], names: list[str], path: str) -> None:
    step = schema["multipleOf"]
    if "number" in names:
        raise _difference("multipleOf on a number (xgrammar drops it)", path)
    if not float(step).is_integer() or step > MAX_INTEGER_MULTIPLE_OF:
        raise _difference(
            f"multipleOf {step} (xgrammar takes whole numbers up to {MAX_INTEGER_MULTIPLE_OF})", path
        )
    low = max(schema.get("minimum", -math.inf), schema.get("exclusiveMinimum", -math.inf) + 1)
    high = min(schema.get("maximum", math.inf), schema.get("exclusiveMaximum", math.inf) - 1)
    bounded = any(key in schema for key in _BOUNDS)
    if bounded and not high - low <= MAX_MULTIPLE_OF_RANGE:
        raise _difference(
            f"multipleOf with a range that is one-sided or wider than {MAX_MULTIPLE_OF_RANGE} (xgrammar drops it)",
            path,
        )


def _difference(feature: str, path: str) -> NotFollowed:
    return NotFollowed(f"{feature} at {path}")
