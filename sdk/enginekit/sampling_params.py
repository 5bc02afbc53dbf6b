"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import difflib
import enum
import math
import numbers
import operator
from typing import Any

import msgspec

from enginekit.structured_outputs import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams"]

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What a stream yields (vLLM's names): the whole output so far, only what is new, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class _StrictOptions(msgspec.StructMeta):
    """Construction takes keyword options only; an unknown one names the class, the closest option and all."""

    def __call__(cls, *args: Any, **options: Any) -> Any:
        if args:
            raise TypeError(f"{cls.__name__} takes keyword options only, e.g. {cls.__name__}(max_tokens=32)")
        fields = cls.__struct_fields__
        for name in options:
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else "."
                raise TypeError(
                    f"{cls.__name__} got an unknown option {name!r}{hint} Its options are: {', '.join(fields)}"
                )
        return super().__call__(**options)


class SamplingParams(
    msgspec.Struct, metaclass=_StrictOptions, frozen=True, kw_only=True, array_like=True, omit_defaults=True
):
    """Sampling and stopping options of one request (vLLM-compatible names).

    Every option is keyword-only and type-checked: ``top_k=2.0``, ``temperature=True`` or ``stop=5`` raise
    ``TypeError``; values out of range raise ``ValueError``.

    Parameters
    ----------
    max_tokens
        Most tokens to generate; ``None``: as many as the context has room for (``max_model_len`` less the
        prompt), as in vLLM.
    temperature
        ``0`` is greedy; higher is more random.
    top_p
        Keep the smallest set of tokens whose probability adds up to at least this.
    top_k
        Keep the ``top_k`` most likely tokens; ``0`` keeps all.
    seed
        Per-request seed: the same seed gives the same random draws whatever else is in the batch (the same
        tokens too, unless the model's products depend on the batch's size: GGUF weights kept as stored).
    stop
        A string or strings that end generation; the text is cut before the stop string. ``None`` (vLLM's
        default): none.
    stop_token_ids
        Token ids that end generation (the token is kept in ``token_ids``). ``None`` (vLLM's default): none.
    ignore_eos
        Keep generating past the end-of-sequence token.
    logprobs
        Return the log-probabilities of this many most likely tokens (plus the sampled one) per token.
    min_tokens
        Tokens to generate before EOS or stop token ids may end the request: until then EOS (unless
        ``ignore_eos``) and ``stop_token_ids`` cannot be sampled (their logits are set to ``-inf``), as vLLM and
        transformers' ``min_new_tokens`` do.
    n
        Independent samples of the prompt (``RequestOutput.outputs`` has ``n`` entries); they share the
        prompt's KV blocks. With a ``seed``, sample ``i`` uses ``seed + i``.
    repetition_penalty
        Divides the logits (multiplies the negative ones) of every token already in the prompt or the output;
        ``1`` is off (transformers' and vLLM's definition).
    presence_penalty
        Subtracted from the logit of every token already generated; in [-2, 2].
    frequency_penalty
        Subtracted from a token's logit once per time it was already generated; in [-2, 2].
    min_p
        Keep tokens whose probability is at least ``min_p`` times the most likely one's; ``0`` is off.
    prompt_logprobs
        Return the log-probabilities of each prompt token (and this many most likely tokens at its position);
        the first entry is ``None``.
    include_stop_str_in_output
        Keep the stop string that ended the request at the end of the text.
    output_kind
        What ``stream`` yields: ``RequestOutputKind.CUMULATIVE`` (the output so far), ``DELTA`` (only what is
        new since the last yield) or ``FINAL_ONLY`` (just the finished output).
    structured_outputs
        A ``StructuredOutputsParams``: the output follows a JSON schema, a regex, a choice or a grammar.
    logit_bias
        Token id -> a bias added to its logit before sampling (and before greedy's argmax), each clamped to
        [-100, 100]: -100 practically bans a token, 100 practically forces it.
    allowed_token_ids
        Only these token ids may be sampled.
    bad_words
        Words that must not be generated: each is tokenized as it starts the text and after a space, and the
        last token of each form is banned whenever the output so far ends with the tokens before it.
        ``None``: none.
    skip_special_tokens
        Leave special tokens (such as ``<|im_end|>``) out of the text (``token_ids`` always has them).
    spaces_between_special_tokens
        With ``skip_special_tokens=False``: put a space between a special token and the text around it.
    truncate_prompt_tokens
        Keep only the last this many prompt tokens (``-1``: as many as ``max_model_len`` allows).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("top_k", "min_tokens", "n"):
            self._set(name, _integer(name, getattr(self, name)))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._set(name, _integer(name, getattr(self, name)))
        for name in (
            "temperature",
            "top_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
        ):
            self._set(name, _real(name, getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _type_error(name, getattr(self, name), "True or False")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self._set("output_kind", RequestOutputKind(self.output_kind))
            except ValueError:
                raise _type_error("output_kind", self.output_kind, "a RequestOutputKind") from None
        self._set("stop", _strings("stop", self.stop))
        self._set("stop_token_ids", _integers("stop_token_ids", self.stop_token_ids))
        self._check_ranges()
        self._check_token_controls()

    def _set(self, name: str, value: Any) -> None:
        if value is not getattr(self, name):
            msgspec.structs.force_setattr(self, name, value)

    def _check_ranges(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be at least 1 or None, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"SamplingParams.temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be at least 1, got {self.n}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be positive, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"SamplingParams.prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )

    def _check_token_controls(self) -> None:
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise _type_error("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        if self.logit_bias is not None:
            self._set("logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = _integers("allowed_token_ids", self.allowed_token_ids)
            if not ids:
                raise ValueError("SamplingParams.allowed_token_ids is empty: give at least one token id")
            if min(ids) < 0:
                raise ValueError(
                    f"SamplingParams.allowed_token_ids must hold non-negative integers, got {min(ids)}"
                )
            self._set("allowed_token_ids", ids)
        self._set("bad_words", _strings("bad_words", self.bad_words))
        if any(not word.strip() for word in self.bad_words):
            raise ValueError(f"SamplingParams.bad_words must hold words, got {self.bad_words!r}")
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _type_error(name, getattr(self, name), "True or False")
        if self.truncate_prompt_tokens is not None:
            self._set(
                "truncate_prompt_tokens", _integer("truncate_prompt_tokens", self.truncate_prompt_tokens)
            )
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(
                    "SamplingParams.truncate_prompt_tokens must be at least 1, or -1 (up to max_model_len), "
                    f"got {self.truncate_prompt_tokens}"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _type_error(name: str, value: Any, expected: str) -> TypeError:
    return TypeError(f"SamplingParams.{name} must be {expected}, got {value!r} ({type(value).__name__})")


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _type_error(name, value, "an integer")
    try:
        value = value if type(value) is int else operator.index(value)  # numpy integers too, never floats
    except TypeError:
        raise _type_error(name, value, "an integer") from None
    if not -(2**63) <= value < 2**63:  # NOTE: what crosses to the engine process; checked here in every mode
        raise ValueError(f"SamplingParams.{name} must fit in a signed 64-bit integer, got {value}")
    return value


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(name, value, "a number")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value}")
    return float(value)


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if value is None:  # vLLM's default for its optional lists: none
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return value if type(value) is tuple else tuple(value)
    raise _type_error(name, value, "a string or a list of strings")


def _logit_bias(value: Any) -> dict[int, float]:
    """Token id -> bias, each bias clamped to [-100, 100]."""
    if not isinstance(value, dict):
        raise _type_error("logit_bias", value, "a dict of token id -> bias")
    bias = {}
    for token, amount in value.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise _type_error("logit_bias", value, "a dict of token id (an integer) -> bias")
        token = int(token)
        if token < 0:
            raise ValueError(f"SamplingParams.logit_bias keys must be non-negative token ids, got {token}")
        amount = _real("logit_bias", amount)
        if amount != amount:
            raise ValueError(f"SamplingParams.logit_bias of token {token} is not a number")
        bias[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, amount))
    return value if bias == value and all(type(k) is int for k in value) else bias


def _integers(name: str, value: Any) -> tuple[int, ...]:
    if value is None:  # vLLM's default for its optional lists: none
        return ()
    if isinstance(value, (list, tuple)):
        try:
            items = tuple(_integer(name, item) for item in value)
        except TypeError:
            raise _type_error(name, value, "a list of integers") from None
        return value if type(value) is tuple and items == value else items
    raise _type_error(name, value, "a list of integers")
