"""Chat: conversations rendered with the model's chat template into prompts, as vLLM's ``LLM.chat`` does.

``Engine.chat``, ``achat``, ``stream_chat`` and ``astream_chat`` call ``render_chat`` and hand what it returns to
their ``generate`` counterpart. The rendered text is tokenized without adding special tokens (the template
writes them), generation stops at the template's end-of-turn token too, and each prompt keeps its conversation
(``RequestOutput.messages``, which the live viewer shows as turns).

A message is ``{"role": ..., "content": ...}`` or a ``(role, content)`` pair. Content may be a list of parts in
the OpenAI format: a template that reads content as text gets the text parts joined by newlines; a part of
another type (an image) is refused, since the models here read text only. A role must be one the template
knows: one it names, or one of the usual ones (system, user, assistant, tool, developer) for a template that
passes roles through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from enginekit.frontend.prompts import ChatPrompt, normalize_params
from enginekit.model.loader import ModelSpec
from enginekit.model.text.chat_template import ChatTemplate
from enginekit.sampling_params import SamplingParams

USUAL_ROLES = ("system", "user", "assistant", "tool", "developer")
# A template that loops over a message's content expects the parts (OpenAI's format); others expect a string.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content)")
_ROLE_LITERAL = re.compile(
    r"role['\"]?\]?\s*(?:==|!=)\s*['\"](\w+)['\"]|['\"](\w+)['\"]\s*(?:==|!=)\s*\w+(?:\[['\"]|\.)role"
)


def render_chat(
    spec: ModelSpec,
    messages: Any,
    params: Any,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[ChatPrompt], list[SamplingParams]]:
    """The prompts of one conversation or a list of them, and their sampling params (one per conversation,
    stopping at the template's end-of-turn token as well). ``chat_template_kwargs``: more variables for the
    template (``tools``, ``enable_thinking``, ...), as transformers' ``apply_chat_template`` takes them."""
    if chat_template_kwargs is not None and not (
        isinstance(chat_template_kwargs, Mapping) and all(isinstance(k, str) for k in chat_template_kwargs)
    ):
        raise TypeError(
            f"chat_template_kwargs must be a dict of template variables by name, got {chat_template_kwargs!r}"
        )
    template = _template(spec, chat_template)
    conversations = [_conversation(c) for c in (messages if _is_batch(messages) else [messages])]
    roles = _known_roles(template)
    prompts = []
    for conversation in conversations:
        _check_roles(conversation, roles, template)
        text = template.render(
            _as_template_reads(conversation, template),
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
        # NOTE: the template writes the special tokens itself (a BOS too, if the model wants one).
        ids = spec.tokenizer.encode(text, add_special_tokens=False)
        prompts.append(ChatPrompt(text, ids, conversation))
    return prompts, _stop_at_end_of_turn(spec, normalize_params(params, len(prompts)))


def _template(spec: ModelSpec, source: str | None) -> ChatTemplate:
    if source is not None:
        return ChatTemplate(source, bos_token=None, eos_token=None, origin="the chat_template argument")
    if spec.chat_template is None:
        raise ValueError(
            f"model {spec.source.name!r} has no chat template; pass chat_template='...' (Jinja source), "
            "or build the prompt yourself and call generate"
        )
    return spec.chat_template


def _is_batch(messages: Any) -> bool:
    """A list of conversations (lists of messages), rather than one conversation."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return False
    first = messages[0]
    return isinstance(first, (list, tuple)) and not _is_pair(first)


def _is_pair(message: Any) -> bool:
    return isinstance(message, tuple) and len(message) == 2 and all(isinstance(item, str) for item in message)


def _conversation(conversation: Any) -> list[dict[str, Any]]:
    """Plain dict copies of the messages; (role, content) pairs become dicts. The template checks the rest."""
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, (list, tuple)):
        raise TypeError(
            "messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a list of "
            f"conversations, got {type(conversation).__name__}"
        )
    if not conversation:
        raise ValueError(
            "the conversation is empty: give at least one message, e.g. [{'role': 'user', 'content': 'Hi'}]"
        )
    messages = []
    for index, message in enumerate(conversation):
        if _is_pair(message):
            message = {"role": message[0], "content": message[1]}
        elif not isinstance(message, Mapping):
            raise TypeError(
                f"message {index} is a {type(message).__name__}; a message is a dict "
                "{'role': ..., 'content': ...} or a (role, content) pair of strings"
            )
        messages.append(dict(message))
    return messages


def _known_roles(template: ChatTemplate) -> set[str]:
    named = {a or b for a, b in _ROLE_LITERAL.findall(template.source)}
    return named | set(USUAL_ROLES)


def _check_roles(conversation: list[dict[str, Any]], roles: set[str], template: ChatTemplate) -> None:
    for index, message in enumerate(conversation):
        role = message.get("role")
        if isinstance(role, str) and role and role not in roles:
            raise ValueError(
                f"message {index} has role {role!r}, which the chat template from {template.origin} does not "
                f"know; use one of {', '.join(sorted(roles))}"
            )


def _as_template_reads(conversation: list[dict[str, Any]], template: ChatTemplate) -> list[dict[str, Any]]:
    """Content lists flattened to their text for a template that reads content as a string; any part that is
    not text refused."""
    keeps_parts = bool(_LOOPS_OVER_CONTENT.search(template.source))
    messages = []
    for index, message in enumerate(conversation):
        content = message.get("content")
        if isinstance(content, list):
            texts = [_text_of(index, part) for part in content]
            if not keeps_parts:
                message = {**message, "content": "\n".join(texts)}
        messages.append(message)
    return messages


def _text_of(index: int, part: Any) -> str:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise TypeError(f"message {index} content parts are dicts with a 'type', got {part!r}")
    if part["type"] != "text":
        raise ValueError(
            f"message {index} has a content part of type {part['type']!r}; this engine's models read text only: "
            "give {'type': 'text', 'text': ...} parts or a string"
        )
    if not isinstance(part.get("text"), str):
        raise TypeError(f"message {index} has a text part without a 'text' string: {part!r}")
    return part["text"]


def _stop_at_end_of_turn(spec: ModelSpec, params: list[SamplingParams]) -> list[SamplingParams]:
    """Stop at the template's end-of-turn token too, where it is not already an end-of-sequence token."""
    extra = tuple(i for i in spec.end_of_turn_token_ids if i not in spec.config.eos_token_ids)
    if not extra:
        return params
    return [
        p if p.ignore_eos else msgspec.structs.replace(p, stop_token_ids=p.stop_token_ids + extra)
        for p in params
    ]
