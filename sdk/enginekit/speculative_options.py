"""``EngineConfig.speculative_config``: vLLM's dictionary, checked once and turned into ``SpeculativeConfig``.

Two methods propose the tokens a step verifies (``core/speculative/``):

- ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}``: the tokens
  that followed the latest earlier occurrence of the sequence's last n..m tokens, in its prompt and its own output;
- ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``: a smaller model with the target's
  vocabulary, run greedily for k tokens.

Both take ``"adaptive"`` (ours, default ``True``): each request proposes only as many tokens as its recent
acceptance makes worth their rows on this device (``core/speculative/plan.py``); ``False`` always proposes k, as
vLLM does. A key the method does not take is refused by name, with the keys it does take.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

import msgspec

METHODS = ("ngram", "draft_model")
_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"),
    "draft_model": ("method", "model", "num_speculative_tokens", "adaptive"),
}
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What ``speculative_config`` asked for, with the defaults filled in."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True


def parse_speculative_config(options: dict[str, Any]) -> SpeculativeConfig:
    """``options`` checked: a known method, only its keys, numbers in range; ``ValueError`` naming what is wrong."""
    if not isinstance(options, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(options).__name__}")
    method = options.get("method")
    if method not in METHODS:
        raise ValueError(
            f"speculative_config['method'] must be one of {', '.join(map(repr, METHODS))}, got {method!r}"
        )
    valid = _KEYS[method]
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"speculative_config has an unknown key {key!r} for method {method!r}{hint} "
                f"(it takes {', '.join(map(repr, valid))})"
            )
    if not isinstance(options.get("adaptive", True), bool):
        raise TypeError(f"speculative_config['adaptive'] must be a bool, got {options['adaptive']!r}")
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"speculative_config[{key!r}] must be an int, got {value!r}")
    if method == "draft_model":
        model = options.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(
                "speculative_config with method 'draft_model' needs 'model': a local Hugging Face folder, a "
                f".gguf file or a repo id of a model with the target's vocabulary, got {model!r}"
            )
    config = msgspec.convert(options, SpeculativeConfig)
    k = config.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    if method == "ngram":
        low, high = config.prompt_lookup_min, config.prompt_lookup_max
        if "prompt_lookup_min" not in options and "prompt_lookup_max" in options:
            low = config.prompt_lookup_min if high >= config.prompt_lookup_min else high
        if low < 1 or high < low:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={low}, prompt_lookup_max={high}"
            )
        config = msgspec.structs.replace(config, prompt_lookup_min=low)
    return config
