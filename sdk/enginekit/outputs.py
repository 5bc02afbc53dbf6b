"""RequestOutput, CompletionOutput, Logprob and RequestMetrics: what the facade returns (vLLM's shapes)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from enginekit.lora_request import LoRARequest

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]

RequestStatusName = Literal["waiting", "running", "preempted", "finished"]


@dataclass
class Logprob:
    """The log-probability of one token, its rank among all tokens (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes
    ----------
    index
        Position among the request's outputs (``0`` to ``n - 1``).
    text
        Generated text (cut before a stop string unless ``include_stop_str_in_output``).
    token_ids
        Generated token ids.
    finish_reason
        ``"stop"``, ``"length"``, ``"abort"``, or ``None`` while running.
    stop_reason
        The stop string or stop token id that ended the request, if any.
    logprobs
        Per generated token, ``{token_id: Logprob}`` for the sampled token and the top ``k``; ``None`` unless
        ``SamplingParams(logprobs=k)`` was given.
    cumulative_logprob
        The sum of the sampled tokens' log-probabilities (of all of them, in a ``DELTA`` stream too); ``None``
        unless ``SamplingParams(logprobs=k)`` was given (as in vLLM).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (``time.time()`` seconds), how often it was preempted, and what
    speculative decoding did for it: the proposals verified (``num_draft_tokens``), those accepted, and the
    forced tokens of its structured output taken without sampling (jump forward); summed over its samples."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forced_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """The share of the verified proposals that were accepted (``None``: none were proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first being scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the end (or to the last token, while running)."""
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request: its prompt and what has been generated so far.

    Attributes
    ----------
    request_id
        The request's id (the caller's, or one the engine made); pass it to ``engine.abort``.
    prompt
        The prompt text (for ``chat``: the rendered conversation; ``None`` for token-id or embedding prompts).
    prompt_token_ids
        The prompt's token ids.
    outputs
        One ``CompletionOutput`` per sample (``SamplingParams.n``).
    finished
        Whether the request has ended (every sample).
    num_cached_tokens
        Prompt tokens served from the prefix cache.
    prompt_logprobs
        With ``SamplingParams(prompt_logprobs=k)``: per prompt token, ``{token_id: Logprob}`` for the token and
        the top ``k`` at its position; the first entry is ``None``.
    metrics
        Timing and preemptions (``RequestMetrics``).
    status
        ``"waiting"`` (queued), ``"running"``, ``"preempted"`` (waiting to be recomputed) or ``"finished"``.
    messages
        For ``chat``: the conversation that was rendered into ``prompt``.
    lora_request
        The LoRA adapter the request ran with (``None``: the base model).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    status: RequestStatusName = "waiting"
    messages: list[dict[str, Any]] | None = None
    lora_request: LoRARequest | None = None

    @property
    def text(self) -> str:
        """Shortcut for ``outputs[0].text``."""
        return self.outputs[0].text if self.outputs else ""

    def __str__(self) -> str:
        out = self.outputs[0] if self.outputs else None
        state = f"finished ({out.finish_reason})" if out and out.finish_reason else self.status
        tokens = sum(len(o.token_ids) for o in self.outputs)
        return f"[{self.request_id}] {state}, {tokens} tokens: {self.prompt or ''!s}{self.text}"

    def _repr_html_(self) -> str:
        out = self.outputs[0] if self.outputs else None
        reason = html.escape(out.finish_reason or self.status) if out else self.status
        tokens = sum(len(o.token_ids) for o in self.outputs)
        prompt = html.escape(
            self.prompt if self.prompt is not None else f"<{len(self.prompt_token_ids)} tokens>"
        )
        texts = "".join(f"<div><b>{html.escape(o.text)}</b></div>" for o in self.outputs) or "<b></b>"
        return (
            "<div style='font-family:monospace;border-left:3px solid #4a90d9;padding-left:8px'>"
            f"<div style='color:#888'>{html.escape(self.request_id)} · {tokens} tokens · {reason}</div>"
            f"<span style='color:#888'>{prompt}</span>{texts}</div>"
        )
