"""Turn what the user passed to ``generate`` into validated engine requests, before anything is sent."""

from __future__ import annotations

from typing import Any

import torch

from enginekit.core.validation import RequestLimits, check_prompt_embeds, validate_request
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
    keys = set(prompt)
    if len(keys) != 1 or not keys <= {"prompt", "prompt_token_ids", "prompt_embeds"}:
        raise ValueError(
            "a dict prompt needs exactly one of 'prompt', 'prompt_token_ids' or 'prompt_embeds', "
            f"got {sorted(map(str, keys))}"
        )
    if "prompt" in prompt:
        return _text(prompt["prompt"], tokenizer)
    if "prompt_token_ids" in prompt:
        return None, _token_ids(prompt["prompt_token_ids"]), None
    embeds = prompt["prompt_embeds"]
    check_prompt_embeds(embeds, hidden_size)
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
