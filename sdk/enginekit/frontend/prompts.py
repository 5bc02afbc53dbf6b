"""Turn what the user passed to ``generate`` into validated engine requests, before anything is sent."""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from enginekit.config import EngineConfig
from enginekit.core.structured.dead_ends import DeadEnds, has_token_controls
from enginekit.core.validation import RequestLimits, check_prompt_embeds, validate_request
from enginekit.lora_request import LoRARequest
from enginekit.model.loader import ModelSpec
from enginekit.model.lora.adapter import inspect_adapter
from enginekit.model.text.tokenizer import Tokenizer
from enginekit.sampling_params import RequestOutputKind, SamplingParams
from enginekit.wire.messages import EngineCoreRequest


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered by a chat template (``frontend/chat.py``): its text, its token ids, and the
    messages themselves, which its output keeps."""

    prompt: str
    prompt_token_ids: list[int]
    messages: list[dict[str, Any]]


PromptInput = str | list[int] | dict[str, Any] | ChatPrompt
MAX_LABEL_TEXT = 60  # characters of a constraint an error message shows


def normalize_prompts(prompts: Any) -> list[PromptInput]:
    """A single prompt (text, token ids, dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict, ChatPrompt)):
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


def normalize_lora_requests(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """``lora_request=``: one ``LoRARequest`` (or ``None``) for every prompt, or a list with one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(
            f"lora_request must be a LoRARequest, None, or a list of them (one per prompt), "
            f"not {type(lora_request).__name__}"
        )
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts")
    for item in lora_request:
        if item is not None and not isinstance(item, LoRARequest):
            raise TypeError(f"lora_request must hold LoRARequest or None, not {type(item).__name__}")
    return list(lora_request)


def prepare_request(
    prompt: PromptInput,
    params: SamplingParams,
    request_id: str,
    tokenizer: Tokenizer,
    limits: RequestLimits,
    arrival_time: float,
    lora_request: LoRARequest | None = None,
) -> tuple[EngineCoreRequest, str | None]:
    """The engine request for one prompt, checked exactly as the engine checks it; and the prompt text."""
    text, token_ids, embeds = _tokens(prompt, tokenizer, limits.hidden_size)
    keep = params.truncate_prompt_tokens
    if keep is not None:  # the last ``keep`` tokens; -1: as many as leave room for one output token
        keep = limits.max_model_len - 1 if keep == -1 else keep
        token_ids = token_ids[-keep:]
        embeds = embeds[-keep:] if embeds is not None else None
    if params.max_tokens is None:  # vLLM's meaning: as many as the context has room for
        params = msgspec.structs.replace(params, max_tokens=max(1, limits.max_model_len - len(token_ids)))
    request = EngineCoreRequest(
        request_id, token_ids, params, arrival_time, embeds, lora_request=lora_request
    )
    validate_request(request, limits)
    return request, text


def _tokens(prompt: PromptInput, tokenizer: Tokenizer, hidden_size: int) -> tuple[str | None, list[int], Any]:
    if isinstance(prompt, str):
        return _text(prompt, tokenizer)
    if isinstance(prompt, ChatPrompt):
        return prompt.prompt, prompt.prompt_token_ids, None
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


@dataclass
class PreparedRequest:
    """One prompt's request, checked: its engine requests (one per sample) and what its output shows."""

    request_id: str
    text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    engine_requests: list[EngineCoreRequest]
    messages: list[dict[str, Any]] | None = None
    lora_request: LoRARequest | None = None
    label: str = ""  # in a batch: which prompt, for the message of an error it gets


class RequestBuilder:
    """Makes the engine requests of one engine's calls: ids, tokenization, the same checks the engine runs."""

    def __init__(self, spec: ModelSpec, limits: RequestLimits, max_lora_rank: int = 0) -> None:
        self.spec = spec
        self.limits = limits
        self.max_lora_rank = max_lora_rank
        self._dead_ends: DeadEnds | None = None  # built at the first request that needs it
        self._prefix = uuid.uuid4().hex[:6]
        self._counter = itertools.count()

    @classmethod
    def for_engine(cls, spec: ModelSpec, config: EngineConfig, max_model_len: int) -> RequestBuilder:
        """The builder of an engine of ``config`` serving ``spec`` with contexts of up to ``max_model_len``."""
        model = spec.config
        limits = RequestLimits(
            model.vocab_size,
            model.hidden_size,
            max_model_len,
            config.structured_outputs_backend,
            config.enable_lora,
        )
        return cls(spec, limits, config.max_lora_rank if config.enable_lora else 0)

    def build(
        self,
        prompts: Any,
        params: Any,
        *,
        single: str = "",
        request_id: Any = None,
        final_only: bool | None = None,
        lora_request: Any = None,
    ) -> list[PreparedRequest]:
        """One checked request per prompt (``single`` names a method that takes exactly one). ``final_only``:
        the caller needs only each request's end (``None``: if its ``output_kind`` is ``FINAL_ONLY``).
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (each checked against the model)."""
        items = normalize_prompts(prompts)
        if single and len(items) != 1:
            raise ValueError(f"{single} takes one prompt; use generate for a batch")
        all_params = normalize_params(params, len(items))
        adapters = normalize_lora_requests(lora_request, len(items))
        ids = self._request_ids(request_id, len(items))
        self._check_adapters(adapters)
        tokenizer, now, prepared = self.spec.tokenizer, time.time(), []
        for index, (item, item_params, rid, adapter) in enumerate(zip(items, all_params, ids, adapters)):
            label = _label(index, len(items), item_params)
            try:
                request, text = prepare_request(item, item_params, rid, tokenizer, self.limits, now, adapter)
                if has_token_controls(request.sampling_params):
                    self._dead_end_search().check(request.sampling_params)
            except (TypeError, ValueError) as error:
                if not label:
                    raise
                raise type(error)(label + str(error)) from None
            if item_params.max_tokens is None:  # the output shows the limit the request got
                item_params = request.sampling_params
            only_end = item_params.output_kind is RequestOutputKind.FINAL_ONLY
            request.final_only = only_end if final_only is None else final_only
            conversation = item.messages if isinstance(item, ChatPrompt) else None
            samples = _samples(request) if item_params.n > 1 else [request]
            prepared.append(
                PreparedRequest(
                    rid,
                    text,
                    request.prompt_token_ids,
                    item_params,
                    samples,
                    conversation,
                    adapter,
                    label,
                )
            )
        return prepared

    def _check_adapters(self, adapters: list[LoRARequest | None]) -> None:
        """Each adapter's folder, config and shapes against the model, before anything is sent (the engine reads
        the weights, and checks them again)."""
        if self.max_lora_rank:  # else validate_request refuses them: LoRA is off
            for adapter in dict.fromkeys(a for a in adapters if a is not None):
                inspect_adapter(adapter, self.spec.config, self.max_lora_rank)

    def _dead_end_search(self) -> DeadEnds:
        if self._dead_ends is None:
            limits = self.limits
            self._dead_ends = DeadEnds(
                limits.structured_outputs_backend,
                self.spec.tokenizer,
                limits.vocab_size,
                self.spec.config.eos_token_ids,
            )
        return self._dead_ends

    def _request_ids(self, request_id: Any, count: int) -> list[str]:
        if request_id is None:
            return [f"{self._prefix}-{next(self._counter)}" for _ in range(count)]
        ids = [request_id] if isinstance(request_id, str) else request_id
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) and i for i in ids):
            raise TypeError(
                f"request_id must be a non-empty string (one prompt) or a list of them (a batch), got {request_id!r}"
            )
        if len(ids) != count:
            raise ValueError(f"got {len(ids)} request ids for {count} prompts")
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids must be unique, got {list(ids)!r}")
        return list(ids)


def _label(index: int, count: int, params: SamplingParams) -> str:
    """How an error names the prompt it concerns in a batch (``""`` for a single prompt): its index, and its
    structured output if it has one (what most often fails there)."""
    if count == 1:
        return ""
    structured = params.structured_outputs
    if structured is None:
        return f"prompts[{index}]: "
    kind, text, _ = structured.spec
    shown = text if len(text) <= MAX_LABEL_TEXT else text[: MAX_LABEL_TEXT - 3] + "..."
    return f"prompts[{index}] ({kind}={shown!r}): "


def _samples(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The ``n`` engine requests of one prompt: ids ``"{i}_{request_id}"``; with a seed, sample i uses seed + i."""
    params = request.sampling_params
    requests = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        sample = msgspec.structs.replace(params, n=1, seed=seed)
        if index:  # only one sample scores the prompt
            sample = msgspec.structs.replace(sample, prompt_logprobs=None)
        requests.append(
            msgspec.structs.replace(
                request,
                request_id=f"{index}_{request.request_id}",
                sampling_params=sample,
                parent_request_id=request.request_id,
            )
        )
    return requests
