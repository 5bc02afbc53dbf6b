"""Incremental detokenization with stop strings.

Text is released only when it is final: never half a UTF-8 character (the decoder's replacement character
at the end means "wait for more tokens"), and never characters that could still turn out to be the start of
a stop string.

One decode per token: each step decodes a window of the last tokens, from a start kept while the window is short,
and the new text is what it adds to the previous step's decode of the same window (kept, not decoded again). Past
``MAX_WINDOW_TOKENS`` the window restarts where the last release started (one more decode, every dozen tokens or
so), so a decode stays short. Where the longer window decodes its earlier tokens otherwise (a byte-fallback
decoder's run of bytes that is not valid UTF-8 as a whole), the step decodes again from where the last release
started: the text is always that of a window that moves at every release, to the character. Special tokens are left out of the text unless ``skip_special_tokens=False``; then
``spaces_between_special_tokens`` puts a space between each special token and the text around it (vLLM's
definition for its slow tokenizers).
"""

from __future__ import annotations

from enginekit.model.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # leading context so that the first token decodes with its correct spacing
MAX_WINDOW_TOKENS = 16  # past this many tokens in the decoded window, it restarts PROMPT_CONTEXT_TOKENS back


class IncrementalDetokenizer:
    __slots__ = (
        "_decode_options",
        "_emitted",
        "_ids",
        "_include_stop",
        "_last_read_offset",
        "_prefix_offset",
        "_prefix_text",
        "_read_offset",
        "_stop",
        "_stop_holdback",
        "_tokenizer",
        "text",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...],
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_options = (skip_special_tokens, spaces_between_special_tokens)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = self._last_read_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # the decode of ids[prefix_offset:read_offset], once known
        self._stop = stop
        self._include_stop = include_stop
        self._stop_holdback = max((len(s) for s in stop), default=1) - 1
        self._emitted = 0
        self.text = ""  # all decoded output text so far, including what is held back

    def update(self, token_id: int, *, finishing: bool = False) -> str | None:
        """Add one token; return the stop string if the text now contains one (the text is cut before it, or
        after it with ``include_stop``)."""
        self._ids.append(token_id)
        ids = self._ids
        prefix_text = self._window_prefix()
        full_text = self._decode(ids[self._prefix_offset :])
        if self._prefix_offset != self._last_read_offset and not full_text.startswith(prefix_text):
            # The longer window decodes its earlier tokens otherwise (a byte run that is not valid UTF-8 as a
            # whole, in a byte-fallback decoder): decode from where the last release started, as a window that
            # moves at every release would.
            self._prefix_offset, self._prefix_text = self._last_read_offset, None
            prefix_text = self._window_prefix()
            full_text = self._decode(ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and (finishing or not full_text.endswith(REPLACEMENT)):
            start = len(self.text)
            self.text += full_text[len(prefix_text) :]
            self._last_read_offset, self._read_offset = self._read_offset, len(ids)
            self._prefix_text = full_text  # the next step's window starts where this one did
            if self._read_offset - self._prefix_offset > MAX_WINDOW_TOKENS:
                self._prefix_offset, self._prefix_text = self._last_read_offset, None
            for stop in self._stop:
                found = self.text.find(stop, max(0, start - len(stop) + 1))
                if found >= 0:
                    self.text = self.text[: found + len(stop) if self._include_stop else found]
                    return stop
        return None

    def _window_prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def flush(self) -> str:
        """Text not yet released, up to what may still be the start of a stop string."""
        end = max(self._emitted, len(self.text) - self._stop_holdback)
        return self._release(end)

    def flush_final(self) -> str:
        """Everything not yet released (the request has finished), less a character left unfinished at the end:
        the tokens with its other bytes never came (``max_tokens``, a stop token or an abort came first), and
        its replacement character is no text (vLLM drops it too)."""
        pending = self._ids[self._read_offset :]
        if pending:
            prefix_text = self._window_prefix()
            full_text = self._decode(self._ids[self._prefix_offset :])
            self.text += full_text[len(prefix_text) :].removesuffix(REPLACEMENT)
            self._prefix_offset = self._read_offset = self._last_read_offset = len(self._ids)
            self._prefix_text = ""
        return self._release(len(self.text))

    def _decode(self, token_ids: list[int]) -> str:
        skip, spaces = self._decode_options
        if skip or not spaces:
            return self._tokenizer.decode(token_ids, skip_special_tokens=skip)
        specials = self._tokenizer.special_token_ids
        pieces, run = [], []
        for token in token_ids:
            if token in specials:
                pieces += [
                    self._tokenizer.decode(run),
                    self._tokenizer.decode([token], skip_special_tokens=False),
                ]
                run = []
            else:
                run.append(token)
        pieces.append(self._tokenizer.decode(run))
        return " ".join(piece for piece in pieces if piece)

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
