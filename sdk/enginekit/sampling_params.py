"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import msgspec

__all__ = ["SamplingParams"]

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """Sampling and stopping options of one request (vLLM-compatible names).

    Parameters
    ----------
    max_tokens
        Most tokens to generate.
    temperature
        ``0`` is greedy; higher is more random.
    top_p
        Keep the smallest set of tokens whose probability adds up to at least this.
    top_k
        Keep the ``top_k`` most likely tokens; ``0`` keeps all.
    seed
        Per-request seed: the same seed gives the same tokens whatever else is in the batch.
    stop
        Strings that end generation; the text is cut before the stop string.
    stop_token_ids
        Token ids that end generation (the token is kept in ``token_ids``).
    ignore_eos
        Keep generating past the end-of-sequence token.
    logprobs
        Return the log-probabilities of this many most likely tokens (plus the sampled one) per token.
    min_tokens
        Tokens to generate before EOS or stop token ids may end the request.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or positive, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
