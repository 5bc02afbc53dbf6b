"""The wire's version: what a remote rank and its front end compare before anything else crosses.

Two processes of one installation always speak the same wire; a remote rank (``runtime/remote_rank.py``) may
run another release. Its join therefore opens with the version it speaks, and the front end refuses a peer
whose version is not its own before it decodes anything else, with an error naming both versions.

A version has two parts:

- ``PROTOCOL``: a number bumped by hand when the meaning of a message changes (a field reused, a channel
  added). The unversioned wire of the releases before it counts as protocol 1.
- ``SCHEMA``: a fingerprint of the shape of every message, computed at import: field names, their order and
  types, tags, enums. Any field added to a message, to ``SamplingParams`` or to ``EngineConfig`` (which travels
  whole, inside ``EngineProcArgs``) changes it, so a release with a new option never meets one without it
  silently: the whole config travels, and only between peers of the same schema. Defaults and docstrings are
  left out: changing them does not change what decodes.

What must never change, so that any two releases can tell each other apart: the first three fields of
``RankHello`` (tag ``"hello"``: protocol, schema, rank), ``JoinRefused`` (the answer to a peer of another
version), and the unversioned ``"join"`` (``LegacyRankJoin``) that protocol 1 sent.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any

import msgspec
import msgspec.inspect as mi

from enginekit.wire import messages

__all__ = ["PROTOCOL", "SCHEMA", "WireVersion", "this_version", "wire_schema"]

PROTOCOL = 2


class WireVersion(msgspec.Struct, frozen=True):
    protocol: int
    schema: str

    def __str__(self) -> str:
        return f"wire protocol {self.protocol} (schema {self.schema})"


def wire_schema() -> list[Any]:
    """The shape of every message, as plain data (what ``SCHEMA`` is the fingerprint of)."""
    roots = (
        messages.EngineProcArgs,
        messages.EngineRequest,
        messages.EngineOutput,
        messages.StartupReport,
        messages.RankMessage,
        messages.JoinReply,
    )
    return [_shape(info, set()) for info in mi.multi_type_info(roots)]


def _shape(node: Any, seen: set[type]) -> Any:
    if isinstance(node, mi.StructType):
        name = node.cls.__qualname__
        if node.cls in seen:
            return name
        seen.add(node.cls)
        config = node.cls.__struct_config__
        return [
            name,
            config.tag,
            node.array_like,
            node.forbid_unknown_fields,
            [[field.encode_name, field.required, _shape(field.type, seen)] for field in node.fields],
        ]
    if isinstance(node, mi.EnumType):
        return ["enum", node.cls.__qualname__, [member.value for member in node.cls]]
    if isinstance(node, mi.CustomType):
        return ["custom", f"{node.cls.__module__}.{node.cls.__qualname__}"]
    if isinstance(node, mi.Type):
        parts: list[Any] = [type(node).__name__]
        for field in node.__struct_fields__:
            parts.append(_shape(getattr(node, field), seen))
        return parts
    if isinstance(node, tuple):
        return [_shape(item, seen) for item in node]
    if isinstance(node, enum.Enum):
        return node.value
    if isinstance(node, type):
        return node.__qualname__
    return node


SCHEMA = hashlib.sha256(msgspec.json.encode(wire_schema())).hexdigest()[:12]


def this_version() -> WireVersion:
    return WireVersion(PROTOCOL, SCHEMA)
