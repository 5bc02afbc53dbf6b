"""Turn what the user passed to ``generate`` into validated prompts, before anything reaches the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from enginekit.model.tokenizer import Tokenizer
from enginekit.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]
    embeds: torch.Tensor | None = None


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
        f"prompts must be a string, a list of token ids, a dict or a list of these, "
        f"not {type(prompts).__name__}"
    )


def prepare_prompt(
    prompt: PromptInput, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, hidden_size: int
) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is an empty string")
        result = Prompt(prompt, tokenizer.encode(prompt))
    elif isinstance(prompt, dict):
        result = _from_dict(prompt, tokenizer, vocab_size, hidden_size)
    elif isinstance(prompt, (list, tuple)):
        result = Prompt(None, _token_ids(prompt, vocab_size))
    else:
        raise TypeError(f"a prompt must be a string, a token-id list or a dict, not {type(prompt).__name__}")
    if not result.token_ids:
        raise ValueError("prompt has no tokens")
    if len(result.token_ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(result.token_ids)} tokens long; the longest allowed is "
            f"{max_model_len - 1} (max_model_len={max_model_len}, leaving room for one output token)"
        )
    return result


def _from_dict(prompt: dict[str, Any], tokenizer: Tokenizer, vocab_size: int, hidden_size: int) -> Prompt:
    keys = set(prompt)
    unknown = keys - {"prompt", "prompt_token_ids", "prompt_embeds"}
    if unknown or len(keys) != 1:
        raise ValueError(
            "a dict prompt needs exactly one of 'prompt', 'prompt_token_ids' or 'prompt_embeds', "
            f"got {sorted(keys)}"
        )
    if "prompt" in prompt:
        return prepare_text(prompt["prompt"], tokenizer)
    if "prompt_token_ids" in prompt:
        return Prompt(None, _token_ids(prompt["prompt_token_ids"], vocab_size))
    embeds = prompt["prompt_embeds"]
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise ValueError(f"prompt_embeds must be a [num_tokens, {hidden_size}] tensor, got {shape}")
    if embeds.shape[0] == 0:
        raise ValueError("prompt_embeds has no rows")
    embeds = embeds.detach().to("cpu").contiguous()
    return Prompt(None, [0] * embeds.shape[0], embeds)


def prepare_text(text: Any, tokenizer: Tokenizer) -> Prompt:
    if not isinstance(text, str) or not text:
        raise ValueError("prompt must be a non-empty string")
    return Prompt(text, tokenizer.encode(text))


def _token_ids(ids: Any, vocab_size: int | None) -> list[int]:
    ids = list(ids)
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"token ids must be non-negative integers, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(f"token id {token} is outside the vocabulary (size {vocab_size})")
    return ids


def normalize_params(
    params: SamplingParams | list[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params must be SamplingParams, not {type(p).__name__}")
    return params
