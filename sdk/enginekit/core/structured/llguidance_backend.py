"""The llguidance backend (the default): a small native library with no Python dependencies.

llguidance tokenizes the text a grammar forces (a JSON key, a fixed word) and allows only that tokenization, so
it needs the tokenizer itself, not just its tokens' bytes: a ``tokenizers`` tokenizer (a Hugging Face folder's,
a GGUF file's) is handed over whole, as its JSON, which llguidance reads natively (it knows, for instance, that a
SentencePiece tokenizer spells a word inside a text without the space it adds at the start). The built-in
byte tokenizer, whose one token per byte is its own tokenization, goes over as our vocabulary's bytes. A
compiled grammar is a matcher in its start state; each request gets a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from enginekit.core.structured.backend import bitmask_words
from enginekit.model.text.tokenizer import HFTokenizer, Tokenizer
from enginekit.model.text.vocabulary import Vocabulary, build_vocabulary
from enginekit.structured_outputs import MAX_JSON_WHITESPACE, GrammarKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

SPECIAL_MARK = b"\xff"  # llguidance's prefix for a special token's name


class _Tokens:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes, the special ones, and an encoder."""

    def __init__(self, vocabulary: Vocabulary, eos_token_ids: list[int], encode: Callable[[str], list[int]]):
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(vocabulary.special_ids)
        self.tokens = [
            SPECIAL_MARK + b"<[%d]>" % index if index in vocabulary.special_ids else piece
            for index, piece in enumerate(vocabulary.token_bytes)
        ]
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("the wrapper takes text")  # tells TokenizerWrapper to pass strings
        return self._encode(text)


class LLGuidanceMatcher:
    __slots__ = ("inner",)

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        return self.inner.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.inner.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def jump_forward_tokens(self) -> list[int]:
        return self.inner.compute_ff_tokens()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        if isinstance(tokenizer, HFTokenizer):
            described: str | llguidance.TokenizerWrapper = tokenizer.backend.to_str()
        else:
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            vocabulary = build_vocabulary(tokenizer, vocab_size)
            described = llguidance.TokenizerWrapper(_Tokens(vocabulary, eos_token_ids, encode))
        self._tokenizer = llguidance.LLTokenizer(described, n_vocab=vocab_size, eos_token=eos_token_ids)
        self._words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor()

    def compile(self, kind: GrammarKind, text: str, any_whitespace: bool) -> llguidance.LLMatcher:
        try:
            if kind in ("json", "json_object"):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults=json_options(any_whitespace)
                )
            else:
                grammar = llguidance.grammar_from("grammar" if kind == "grammar" else kind, text)
        except ValueError as error:
            raise ValueError(f"the {kind} constraint does not compile: {error}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {kind} constraint does not compile: {matcher.get_error().strip()}")
        return matcher

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())

    def fill_bitmask(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor) -> None:
        check_bitmask(bitmask, len(matchers), self._words)
        pairs = []
        for row, matcher in enumerate(matchers):
            if not isinstance(matcher, LLGuidanceMatcher):
                raise TypeError(f"matcher {row} is a {type(matcher).__name__}, not one this backend made")
            pairs.append((matcher.inner, row))
        rows, words = bitmask.shape
        # NOTE: llguidance writes row K at data_ptr + K * words * 4 bytes, through the raw pointer.
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)


def check_bitmask(bitmask: Any, num_rows: int, num_words: int) -> None:
    """Raise unless llguidance may write ``num_rows`` masks of ``num_words`` int32 words into ``bitmask``
    through its pointer: a CPU tensor of int32, rows of exactly ``num_words`` words one after another, at least
    ``num_rows`` of them. (Real exceptions, not asserts: ``python -O`` removes those, and the pointer would go
    unchecked.)"""
    if not isinstance(bitmask, torch.Tensor):
        raise TypeError(f"the bitmask must be a torch.Tensor, got {type(bitmask).__name__}")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"the bitmask must hold int32 words, got {bitmask.dtype}")
    if bitmask.device.type != "cpu":
        raise ValueError(
            f"the bitmask must be in CPU memory (llguidance writes it there), got {bitmask.device}"
        )
    if bitmask.dim() != 2 or bitmask.shape[1] != num_words:
        raise ValueError(
            f"the bitmask must be [rows, {num_words}] (one row of words per matcher), got {list(bitmask.shape)}"
        )
    if bitmask.shape[0] < num_rows:
        raise ValueError(f"the bitmask has {bitmask.shape[0]} rows for {num_rows} matchers")
    if not bitmask.is_contiguous():
        raise ValueError("the bitmask must be contiguous (its rows one after another in memory)")


def json_options(any_whitespace: bool) -> JsonCompileOptions:
    """llguidance's options for a JSON schema: compact separators, and bounded whitespace between tokens."""
    if not any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
