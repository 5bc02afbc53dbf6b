"""Chat templates: render a conversation into a prompt the way transformers' ``apply_chat_template`` does.

A template is Jinja source shipped with the model (``chat_template.jinja``, ``tokenizer_config.json`` or a GGUF's
``tokenizer.chat_template``). It runs in Jinja's immutable sandbox with transformers' conventions: blocks trimmed,
``loopcontrols``, ``raise_exception``, ``strftime_now`` and a ``tojson`` that leaves non-ASCII text as it is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from enginekit.errors import EngineStartupError

_PROBE = "ENGINEKIT_END_OF_TURN_PROBE"


class ChatTemplate:
    """A compiled chat template.

    Parameters
    ----------
    source
        The Jinja source.
    bos_token, eos_token
        The texts the template sees as ``bos_token`` and ``eos_token``.
    origin
        Where the source came from, for error messages (a file path, or a GGUF key).

    Raises
    ------
    EngineStartupError
        The source does not compile; the message names the origin, Jinja's error and its line.
    """

    def __init__(
        self, source: str, *, bos_token: str | None, eos_token: str | None, origin: str = "chat template"
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as error:
            raise EngineStartupError(
                f"chat template from {origin} does not compile: {error.message} (template line {error.lineno})",
                phase="model load",
            ) from error

    def render(
        self, conversation: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation into prompt text.

        Parameters
        ----------
        conversation
            Messages, each ``{"role": str, "content": str}``; content may also be a list of parts such as
            ``{"type": "text", "text": str}``, and an assistant message with ``tool_calls`` may omit it.
        add_generation_prompt
            End with the header of an assistant turn, so the model answers.
        **kwargs
            More variables for the template (``tools``, ``documents``, ``enable_thinking``, ...).

        Raises
        ------
        TypeError, ValueError
            The conversation is malformed (TypeError for a wrong type, ValueError for a missing or empty field),
            or the template rejected it (ValueError carrying the template's message).
        """
        messages = _validated(conversation)
        context = {"tools": None, "documents": None, "bos_token": self.bos_token, "eos_token": self.eos_token}
        context |= kwargs | {"messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except (jinja2.TemplateError, TypeError) as error:
            raise ValueError(f"chat template from {self.origin} failed: {error}") from error


def chat_template_from_folder(folder: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face model folder, or None when it has none.

    Parameters
    ----------
    folder
        Looked up in order: ``chat_template.jinja``, ``chat_template.json``, then the ``chat_template`` of
        ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` where ``"default"`` is used).
        ``bos_token`` and ``eos_token`` come from ``tokenizer_config.json``.

    Raises
    ------
    EngineStartupError
        A file is not valid JSON, the named templates have no ``"default"``, or the template does not compile.
    """
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    jinja_path, json_path = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja_path.is_file():
        source, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    elif json_path.is_file():
        source, origin = _read_json(json_path).get("chat_template"), str(json_path)
    else:
        source, origin = config.get("chat_template"), f"{config_path} (chat_template)"
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        if "default" not in named:
            raise EngineStartupError(
                f"{origin} has named chat templates {sorted(map(str, named))} but none called 'default'",
                phase="model load",
            )
        source = named["default"]
    if not source:
        return None
    return ChatTemplate(
        source,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        origin=origin,
    )


def end_of_turn_token_ids(template: ChatTemplate, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The special token that closes an assistant turn in this template, so generation can stop there.

    Renders a one-message assistant turn (after a user turn if the template insists) and picks the special
    token of the vocabulary that comes first after the message text, e.g. ``<|im_end|>`` or ``<|eot_id|>``.

    Returns
    -------
    tuple[int, ...]
        That token's id, or an empty tuple when no special token follows the message.
    """
    tail = _text_after_assistant_message(template)
    if tail is None:
        return ()
    special = {
        token.content: token_id
        for token_id, token in tokenizer.get_added_tokens_decoder().items()
        if token.special and token.content
    }
    found = [(tail.find(text), -len(text), token_id) for text, token_id in special.items() if text in tail]
    return (min(found)[2],) if found else ()


def _text_after_assistant_message(template: ChatTemplate) -> str | None:
    answer = {"role": "assistant", "content": _PROBE}
    for conversation in ([answer], [{"role": "user", "content": "hello"}, answer]):
        try:
            rendered = template.render(conversation, add_generation_prompt=False)
        except ValueError:
            continue
        if _PROBE in rendered:
            return rendered[rendered.rindex(_PROBE) + len(_PROBE) :]
    return None


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _validated(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain copies of the messages, so the template never sees (or changes) the caller's objects."""
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise TypeError(f"a conversation is a list of message dicts, got {type(conversation).__name__}")
    messages = []
    for index, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise TypeError(
                f"message {index} is a {type(message).__name__}, expected a dict with role and content"
            )
        role, content = message.get("role"), message.get("content")
        if role is None or role == "":
            raise ValueError(f"message {index} has no 'role' (user, assistant, system, ...)")
        if not isinstance(role, str):
            raise TypeError(f"message {index} role is a {type(role).__name__}, expected a string")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"message {index} ({role}) has no 'content'")
        if content is not None:
            _check_content(index, content)
        try:
            messages.append(
                json.loads(json.dumps({key: value for key, value in message.items() if value is not None}))
            )
        except (TypeError, ValueError) as error:
            raise TypeError(f"message {index} holds a value that is not plain JSON data: {error}") from None
    return messages


def _check_content(index: int, content: Any) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise TypeError(
            f"message {index} content is a {type(content).__name__}, expected a string or a list of parts"
        )
    for part in content:
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise TypeError(f"message {index} content parts are dicts with a 'type', got {part!r}")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise TypeError(f"message {index} has a text part without a 'text' string: {part!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise EngineStartupError(f"cannot read {path}: {error}", phase="model load") from error


def _token_text(token: Any) -> str | None:
    """A special token in tokenizer_config.json is its text, or a serialized AddedToken with the text as content."""
    return token.get("content") if isinstance(token, Mapping) else token
