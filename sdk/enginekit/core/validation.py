"""The one check of a request against the engine's limits, shared by the facade and the engine core.

The facade runs it before anything is sent; the engine core runs it again on every ADD it handles, because a
message on a socket is not trusted. Both raise the same exception with the same message, so a bad request
fails the same way in every mode and by every path.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from enginekit.core.structured.xgrammar_form import xgrammar_refusal
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import EngineCoreRequest

__all__ = ["RequestLimits", "sampling_params_error", "validate_request"]


class RequestLimits(msgspec.Struct, frozen=True):
    vocab_size: int
    hidden_size: int
    max_model_len: int
    structured_outputs_backend: str = "llguidance"
    enable_lora: bool = False


def validate_request(request: EngineCoreRequest, limits: RequestLimits) -> None:
    """Raise ``ValueError`` naming the problem unless the engine can serve ``request``."""
    token_ids = request.prompt_token_ids
    if not token_ids:
        raise ValueError("prompt has no tokens")
    if min(token_ids) < 0:
        raise ValueError(f"token ids must be non-negative integers, got {min(token_ids)}")
    if max(token_ids) >= limits.vocab_size:
        raise ValueError(f"token id {max(token_ids)} is outside the vocabulary (size {limits.vocab_size})")
    if len(token_ids) >= limits.max_model_len:
        raise ValueError(
            f"prompt is {len(token_ids)} tokens long; the longest allowed is {limits.max_model_len - 1} "
            f"(max_model_len={limits.max_model_len}, leaving room for one output token)"
        )
    embeds = request.prompt_embeds
    if embeds is not None:
        check_prompt_embeds(embeds, limits.hidden_size, num_tokens=len(token_ids))
    _check_token_ids(request.sampling_params, limits.vocab_size)
    _check_structured_outputs(request.sampling_params, limits.structured_outputs_backend)
    if request.lora_request is not None and not limits.enable_lora:
        raise ValueError(
            f"lora_request names adapter {request.lora_request.lora_name!r}, but LoRA is off in this engine: start "
            "it with enable_lora=True (Engine(..., enable_lora=True), or engine.restart(enable_lora=True))"
        )


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids of ``allowed_token_ids`` and ``logit_bias`` are in the vocabulary."""
    for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
        if ids and max(ids) >= vocab_size:
            raise ValueError(
                f"SamplingParams.{name} holds token id {max(ids)}, outside the vocabulary (size {vocab_size})"
            )


def _check_structured_outputs(params: SamplingParams, backend: str) -> None:
    """The engine's grammar backend follows the request's structured output as llguidance does (the reference:
    ``StructuredOutputsParams`` checked it with llguidance's compiler), or refuses it by name."""
    structured = params.structured_outputs
    if structured is not None and backend == "xgrammar":
        refusal = xgrammar_refusal(*structured.spec)
        if refusal is not None:
            raise ValueError(refusal)


def check_prompt_embeds(embeds: Any, hidden_size: int, *, num_tokens: int | None = None) -> None:
    rows = "num_tokens" if num_tokens is None else str(num_tokens)
    if (
        not isinstance(embeds, torch.Tensor)
        or embeds.dim() != 2
        or embeds.shape[1] != hidden_size
        or (num_tokens is not None and embeds.shape[0] != num_tokens)
    ):
        shape = list(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise ValueError(f"prompt_embeds must be a [{rows}, {hidden_size}] tensor, got {shape}")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must hold floating-point values, got {embeds.dtype}")
    finite = torch.isfinite(embeds).all(dim=1)  # one pass over the prompt; NaN rows would give token 0s
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0, 0])
        raise ValueError(f"prompt_embeds must hold finite values; row {row} holds nan or inf")


def sampling_params_error(raw: Any) -> BaseException | None:
    """The error ``SamplingParams`` raises for these raw wire values (an array in field order), if any.

    Used when an ADD failed typed decoding: building the params the way the facade does gives the same
    exception and message a caller of the facade would have seen.
    """
    if not isinstance(raw, list):
        return TypeError(f"sampling_params must be a SamplingParams, got {type(raw).__name__}")
    fields = SamplingParams.__struct_fields__
    if len(raw) > len(fields):
        return TypeError(f"SamplingParams has {len(fields)} fields, got {len(raw)} values")
    try:
        SamplingParams(**dict(zip(fields, raw)))
    except (TypeError, ValueError) as error:
        return error
    return None
