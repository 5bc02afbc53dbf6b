"""The xgrammar backend (optional: ``pip install 'enginekit[xgrammar]'``).

It compiles each constraint in its xgrammar form (``xgrammar_form.py``), which makes xgrammar follow it as
llguidance does, and refuses by name what it cannot.

Its tokenizer info is our vocabulary as raw bytes, special tokens empty (xgrammar never allows an empty token).
xgrammar ends a matcher only when it takes a stop token; to end a request as soon as nothing can follow (as the
llguidance backend does), a matcher computes its next mask right after each token, and is terminated when that
mask allows stop tokens only. The mask is kept for the step that samples next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xgrammar

from enginekit.core.structured.backend import bitmask_words
from enginekit.core.structured.xgrammar_form import NotFollowed, clean_message, json_grammar, xgrammar_form
from enginekit.model.text.vocabulary import Vocabulary
from enginekit.structured_outputs import GrammarKind


class XGrammarMatcher:
    __slots__ = ("_inner", "_next_mask", "_only_stop", "_terminated")

    def __init__(self, inner: xgrammar.GrammarMatcher, only_stop: torch.Tensor) -> None:
        self._inner = inner
        self._only_stop = only_stop  # [words]: the bits of the stop tokens, inverted
        self._next_mask: torch.Tensor | None = None
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        if not self._inner.accept_token(token_id):
            return False
        self._next_mask = None
        if self._inner.is_terminated():
            self._terminated = True
        else:
            mask = self.next_mask()
            self._terminated = not bool((mask & self._only_stop).any())
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        self._inner.rollback(num_tokens)
        self._next_mask = None
        self._terminated = False  # a matcher that took a token after this state had not ended there

    def jump_forward_tokens(self) -> list[int]:
        return [] if self._terminated else list(self._inner.find_jump_forward_tokens())

    def next_mask(self) -> torch.Tensor:
        if self._next_mask is None:
            mask = torch.empty((1, self._only_stop.numel()), dtype=torch.int32)
            self._inner.fill_next_token_bitmask(mask)
            self._next_mask = mask[0]
        return self._next_mask


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, vocabulary: Vocabulary, eos_token_ids: list[int]) -> None:
        info = xgrammar.TokenizerInfo(
            vocabulary.token_bytes,
            xgrammar.VocabType.RAW,
            vocab_size=vocabulary.size,
            stop_token_ids=list(eos_token_ids),
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        words = [0xFFFFFFFF] * bitmask_words(vocabulary.size)
        for token in eos_token_ids:
            words[token // 32] &= ~(1 << (token % 32))
        self._only_stop = torch.tensor(
            [w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32
        )

    def compile(self, kind: GrammarKind, text: str, any_whitespace: bool) -> xgrammar.CompiledGrammar:
        """The constraint in xgrammar's form (``xgrammar_form.py``): what makes it follow the constraint as
        llguidance does. The facade refused at submission what it cannot follow; the engine refuses it again
        here for a request that came another way."""
        compiler = self._compiler
        try:
            if kind in ("json", "json_object"):
                return compiler.compile_grammar(json_grammar(text, any_whitespace))
            form = xgrammar_form(kind, text)
            if kind == "regex":
                return compiler.compile_regex(form)
            return compiler.compile_grammar(form)  # a grammar, or a choice written as one
        except NotFollowed as difference:
            raise ValueError(
                f"the {kind} constraint uses {difference}, which xgrammar does not follow"
            ) from None
        except RuntimeError as error:
            raise ValueError(f"the {kind} constraint does not compile: {clean_message(error)}") from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled), self._only_stop)

    def fill_bitmask(self, matchers: Sequence[XGrammarMatcher], bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            bitmask[row] = matcher.next_mask()
