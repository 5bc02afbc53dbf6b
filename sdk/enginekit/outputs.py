"""RequestOutput and CompletionOutput: what the facade returns, built up from engine deltas."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes
    ----------
    index
        Position among the request's outputs (always 0: one sequence per request).
    text
        Generated text (cut before a stop string).
    token_ids
        Generated token ids.
    finish_reason
        ``"stop"``, ``"length"``, ``"abort"``, or ``None`` while running.
    stop_reason
        The stop string or stop token id that ended the request, if any.
    logprobs
        Per generated token, ``{token_id: logprob}`` for the sampled token and the top ``k``; ``None`` unless
        ``SamplingParams(logprobs=k)`` was given.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and what has been generated so far.

    Attributes
    ----------
    request_id
        Engine-wide unique id; pass it to ``engine.abort``.
    prompt
        The prompt text (``None`` for token-id or embedding prompts).
    prompt_token_ids
        The prompt's token ids.
    outputs
        One ``CompletionOutput``.
    finished
        Whether the request has ended.
    num_cached_tokens
        Prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        """Shortcut for ``outputs[0].text``."""
        return self.outputs[0].text if self.outputs else ""

    def __str__(self) -> str:
        out = self.outputs[0] if self.outputs else None
        state = f"finished ({out.finish_reason})" if out and out.finish_reason else "running"
        tokens = len(out.token_ids) if out else 0
        return f"[{self.request_id}] {state}, {tokens} tokens: {self.prompt or ''!s}{self.text}"

    def _repr_html_(self) -> str:
        out = self.outputs[0] if self.outputs else None
        reason = html.escape(out.finish_reason or "running") if out else "running"
        tokens = len(out.token_ids) if out else 0
        prompt = html.escape(
            self.prompt if self.prompt is not None else f"<{len(self.prompt_token_ids)} tokens>"
        )
        text = html.escape(self.text)
        return (
            "<div style='font-family:monospace;border-left:3px solid #4a90d9;padding-left:8px'>"
            f"<div style='color:#888'>{html.escape(self.request_id)} · {tokens} tokens · {reason}</div>"
            f"<span style='color:#888'>{prompt}</span><b>{text}</b></div>"
        )
