"""Turn what the user passed to ``generate`` into validated engine requests, before anything is sent."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import msgspec
import torch

from enginekit.core.validation import RequestLimits, check_prompt_embeds, validate_request
from enginekit.model.chat_template import ChatTemplate
from enginekit.model.loader import ModelSpec
from enginekit.model.tokenizer import Tokenizer
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import EngineCoreRequest

PromptInput = str | list[int] | dict[str, Any]


def normalize_prompts(prompts: Any) -> list[PromptInput]:
    """A single prompt (text, token ids, dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty: pass a string, a list of strings or token-id lists")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(
        f"prompts must be a string, a list of token ids, a dict or a list of these, not {type(prompts).__name__}"
    )


def normalize_params(params: Any, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"params must be SamplingParams or a list of them, not {type(params).__name__}")
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params must be SamplingParams, not {type(p).__name__}")
    return list(params)


def prepare_request(
    prompt: PromptInput,
    params: SamplingParams,
    request_id: str,
    tokenizer: Tokenizer,
    limits: RequestLimits,
    arrival_time: float,
) -> tuple[EngineCoreRequest, str | None]:
    """The engine request for one prompt, checked exactly as the engine checks it; and the prompt text."""
    text, token_ids, embeds = _tokens(prompt, tokenizer, limits.hidden_size)
    request = EngineCoreRequest(request_id, token_ids, params, arrival_time, embeds)
    validate_request(request, limits)
    return request, text


def _tokens(prompt: PromptInput, tokenizer: Tokenizer, hidden_size: int) -> tuple[str | None, list[int], Any]:
    if isinstance(prompt, str):
        return _text(prompt, tokenizer)
    if isinstance(prompt, dict):
        return _from_dict(prompt, tokenizer, hidden_size)
    if isinstance(prompt, (list, tuple)):
        return None, _token_ids(prompt), None
    raise TypeError(f"a prompt must be a string, a token-id list or a dict, not {type(prompt).__name__}")


def _text(text: Any, tokenizer: Tokenizer) -> tuple[str, list[int], None]:
    if not isinstance(text, str):
        raise TypeError(f"a text prompt must be a string, not {type(text).__name__}")
    if not text:
        raise ValueError("prompt is an empty string")
    return text, tokenizer.encode(text), None


def _from_dict(
    prompt: dict[str, Any], tokenizer: Tokenizer, hidden_size: int
) -> tuple[str | None, list[int], Any]:
    keys = set(prompt) - ({"prompt"} if "prompt_token_ids" in prompt else set())
    if len(keys) != 1 or not keys <= {"prompt", "prompt_token_ids", "prompt_embeds"}:
        raise ValueError(
            "a dict prompt needs exactly one of 'prompt', 'prompt_token_ids' or 'prompt_embeds', "
            f"got {sorted(map(str, prompt))}"
        )
    if "prompt_token_ids" in prompt:  # with an optional "prompt": the text the ids stand for, for display
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None, _token_ids(prompt["prompt_token_ids"]), None
    if "prompt" in prompt:
        return _text(prompt["prompt"], tokenizer)
    embeds = prompt["prompt_embeds"]
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
        check_prompt_embeds(embeds, hidden_size)  # raises: without rows there are no tokens to count
    # The rest (width, dtype) is checked with the request, as the engine checks it.
    # NOTE: a copy, so that the caller changing its tensor after submission cannot change the request.
    embeds = embeds.detach().to("cpu", copy=True).contiguous()
    return None, [0] * embeds.shape[0], embeds


def _token_ids(ids: Any) -> list[int]:
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    ids = list(ids)
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise TypeError(f"token ids must be integers, got {token!r} ({type(token).__name__})")
    return ids


class RequestBuilder:
    """Makes the engine requests of one engine's calls: ids, tokenization, the same checks the engine runs."""

    def __init__(self, spec: ModelSpec, limits: RequestLimits) -> None:
        self.spec = spec
        self.limits = limits
        self._prefix = uuid.uuid4().hex[:6]
        self._counter = itertools.count()

    def build(
        self, prompts: Any, params: Any, *, single: str = ""
    ) -> list[tuple[EngineCoreRequest, str | None]]:
        """One checked request per prompt (``single`` names a method that takes exactly one)."""
        items = normalize_prompts(prompts)
        if single and len(items) != 1:
            raise ValueError(f"{single} takes one prompt; use generate for a batch")
        all_params = normalize_params(params, len(items))
        tokenizer, now = self.spec.tokenizer, time.time()
        return [
            prepare_request(
                item, item_params, f"{self._prefix}-{next(self._counter)}", tokenizer, self.limits, now
            )
            for item, item_params in zip(items, all_params)
        ]

    def chat(
        self, conversations: Any, params: Any, *, chat_template: str | None, add_generation_prompt: bool
    ) -> tuple[list[dict[str, Any]], Any]:
        """The prompts and params ``generate`` needs for a conversation or a list of them."""
        template = self._template(chat_template)
        batch = conversations if _is_batch(conversations) else [conversations]
        prompts = []
        for conversation in batch:
            text = template.render(conversation, add_generation_prompt=add_generation_prompt)
            # NOTE: the template writes the special tokens itself (a BOS too, if the model wants one).
            prompts.append(
                {
                    "prompt_token_ids": self.spec.tokenizer.encode(text, add_special_tokens=False),
                    "prompt": text,
                }
            )
        return prompts, self._stop_at_end_of_turn(normalize_params(params, len(prompts)))

    def _template(self, source: str | None) -> ChatTemplate:
        if source is not None:
            return ChatTemplate(source, bos_token=None, eos_token=None, origin="the chat_template argument")
        if self.spec.chat_template is None:
            raise ValueError(
                f"model {self.spec.source.name!r} has no chat template; pass chat_template='...' (Jinja source), "
                "or build the prompt yourself and call generate"
            )
        return self.spec.chat_template

    def _stop_at_end_of_turn(self, params: list[SamplingParams]) -> list[SamplingParams]:
        extra = tuple(i for i in self.spec.end_of_turn_token_ids if i not in self.spec.config.eos_token_ids)
        if not extra:
            return params
        return [
            p if p.ignore_eos else msgspec.structs.replace(p, stop_token_ids=p.stop_token_ids + extra)
            for p in params
        ]


def _is_batch(conversations: Any) -> bool:
    """A list of conversations (lists of messages), rather than one conversation."""
    return (
        isinstance(conversations, (list, tuple))
        and bool(conversations)
        and isinstance(conversations[0], (list, tuple))
    )
