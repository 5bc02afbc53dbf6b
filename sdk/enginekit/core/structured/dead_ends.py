"""Whether a structured output and a request's token controls leave it a way to end, decided at submission.

``allowed_token_ids`` and ``bad_words`` ban tokens after the structured output's mask allowed them; together
they may leave a step nothing to sample (``choice=["Paris"]`` with ``bad_words=["Paris"]``: llguidance allows
only the tokenization of a text the grammar forces, and that one token is banned). Where the outputs the
grammar allows are few, a search through them with the engine's own backend decides it before the request is
sent: each step takes the tokens the mask, ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` leave, and a
way ends when the grammar ends, the end-of-sequence or a stop token is allowed, or ``max_tokens`` is reached.
When no way ends, the request is refused with a message naming the structured output and the controls. A
search that would take more than ``MAX_MASKS`` masks (a grammar with many outputs) decides nothing: then the
step that finds no token fails the request, with the same names (``core/step_outputs.py``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from enginekit.core.structured.backend import GrammarBackend, GrammarMatcher, bitmask_words
from enginekit.core.structured.manager import load_backend
from enginekit.model.text.tokenizer import Tokenizer
from enginekit.model.text.vocabulary import bad_words_token_ids, build_vocabulary
from enginekit.model.token_controls import banned_by_words
from enginekit.sampling_params import SamplingParams

MAX_MASKS = 512  # masks a search computes before it gives up deciding (about 50 ms on a 49k vocabulary)
MAX_CACHED_GRAMMARS = 64
MAX_SHOWN = 80  # characters of a control's or a constraint's value a message shows


def has_token_controls(params: SamplingParams) -> bool:
    """Whether the request's token controls can ban what its structured output allows."""
    controls = params.allowed_token_ids or params.bad_words or params.min_tokens
    return params.structured_outputs is not None and bool(controls)


def is_banned(
    params: SamplingParams, words: list[list[int]] | None, output: list[int], token_id: int
) -> bool:
    """Whether ``allowed_token_ids`` or ``bad_words`` (``words``, tokenized) ban ``token_id`` after ``output``:
    a token the sampler drew from a row the masks left empty."""
    if params.allowed_token_ids is not None and token_id not in params.allowed_token_ids:
        return True
    return bool(words) and token_id in banned_by_words(words or [], output)


def no_token_left(params: SamplingParams, output_text: str) -> str | None:
    """The message of a request whose structured output and token controls left no token to sample after
    ``output_text``; the same at submission and at a step. ``None`` if it has no such control."""
    controls = [name for name in ("allowed_token_ids", "bad_words") if getattr(params, name)]
    if params.min_tokens:
        controls.append("min_tokens")
    structured = params.structured_outputs
    if not controls or structured is None:
        return None
    named = " and ".join(f"SamplingParams.{name}={_shown(getattr(params, name))}" for name in controls)
    kind, text, _ = structured.spec
    where = f"after {output_text!r}" if output_text else "at its start"
    return (
        f"the structured output ({kind}={_shown(text)}) and {named} together leave no token to sample "
        f"{where}: every token the structured output allows there is banned. Loosen the token controls or "
        "the structured output"
    )


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= MAX_SHOWN else shown[: MAX_SHOWN - 4] + "...]"


class DeadEnds:
    """The search of one front end: its backend and compiled grammars, built at the first request that needs
    them (the same backend the engine uses, over the same tokenizer)."""

    def __init__(
        self, backend_name: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._lock = threading.Lock()  # NOTE: facade calls may come from several threads
        self._backend: GrammarBackend[Any] | None = None
        self._token_lengths: list[int] = []  # bytes per token: the search tries the longest first
        self._compiled: dict[tuple[str, str, bool], Any] = {}

    def check(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` if no way through the structured output survives the token controls."""
        structured = params.structured_outputs
        if structured is None or params.stop:  # a stop string may end a way the search cannot see end
            return
        with self._lock:
            backend, compiled = self._compile(structured.spec)
            words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else None
            matcher = backend.matcher(compiled)
            search = _Search(backend, matcher, self._token_lengths, params, words, self.eos_token_ids)
            if search.run() is False:
                message = no_token_left(params, self.tokenizer.decode(search.deepest))
                assert message is not None  # has_token_controls held
                raise ValueError(message)

    def _compile(self, spec: tuple[Any, str, bool]) -> tuple[GrammarBackend[Any], Any]:
        if self._backend is None:
            self._backend = load_backend(
                self.backend_name, self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)
            )
            vocabulary = build_vocabulary(self.tokenizer, self.vocab_size)
            self._token_lengths = [len(piece) for piece in vocabulary.token_bytes]
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._backend.compile(*spec)  # ValueError: the engine would refuse it the same way
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = compiled
        return self._backend, compiled


class _Search:
    """A depth-first search for one way to end: ``run`` is True (found), False (none) or None (gave up)."""

    def __init__(
        self,
        backend: GrammarBackend[Any],
        matcher: GrammarMatcher,
        token_lengths: list[int],
        params: SamplingParams,
        words: list[list[int]] | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.backend = backend
        self.matcher = matcher
        self.lengths = token_lengths
        self.params = params
        self.words = words
        self.allowed = frozenset(params.allowed_token_ids) if params.allowed_token_ids is not None else None
        self.stopping = frozenset(params.stop_token_ids) | eos_token_ids
        self.bits = torch.empty((1, bitmask_words(len(token_lengths))), dtype=torch.int32)
        self.num_masks = 0
        self.output: list[int] = []
        self.deepest: list[int] = []  # the longest way tried: where a refused request's message says it ends

    def run(self) -> bool | None:
        try:
            return self._ways_on()
        except _GaveUp:
            return None

    def _ways_on(self) -> bool:
        """Whether some way on from the matcher's state ends (the state after ``self.output``)."""
        if len(self.output) > len(self.deepest):
            self.deepest = list(self.output)
        max_tokens = self.params.max_tokens
        if max_tokens is not None and len(self.output) >= max_tokens:
            return True  # the request ends with "length"
        tokens = self._samplable()
        if not tokens:
            return False
        if any(token in self.stopping for token in tokens):
            return True  # the end-of-sequence or a stop token ends the request (the grammar allows it)
        for token in sorted(tokens, key=lambda t: -self.lengths[t]):  # the longest first: fewer steps
            if not self.matcher.accept(token):
                continue
            self.output.append(token)
            ends = self.matcher.is_terminated() or self._ways_on()
            self.output.pop()
            self.matcher.rollback(1)
            if ends:
                return True
        return False

    def _samplable(self) -> list[int]:
        """What the engine's sampler could draw here: the mask, less what the token controls ban."""
        self.num_masks += 1
        if self.num_masks > MAX_MASKS:
            raise _GaveUp
        self.backend.fill_bitmask([self.matcher], self.bits)
        bits = np.unpackbits(self.bits.numpy().view(np.uint8), bitorder="little")
        tokens = np.flatnonzero(bits[: len(self.lengths)]).tolist()
        if self.allowed is not None:
            tokens = [t for t in tokens if t in self.allowed]
        if self.words:
            banned = banned_by_words(self.words, self.output)
            tokens = [t for t in tokens if t not in banned]
        if len(self.output) < self.params.min_tokens:  # min_tokens keeps EOS and stop tokens back until then
            tokens = [t for t in tokens if t not in self.stopping]
        return tokens


class _GaveUp(Exception):
    pass
