"""The interface every grammar backend implements, and the table of backends.

A backend compiles a constraint (``StructuredOutputsParams.spec``) for one vocabulary, makes a matcher per
request from a compiled grammar, and fills a batch of token bitmasks (``int32`` rows, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed). Compiling raises ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

from enginekit.structured_outputs import GrammarKind


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; ``False`` if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended: it took the end-of-sequence token, or no token can follow."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens (a search of the ways a grammar goes on)."""
        ...

    def jump_forward_tokens(self) -> list[int]:
        """The text the grammar forces from here, as tokens the library picks (greedy longest, llguidance's and
        xgrammar's): the model may tokenize the same text otherwise, so they are proposals to verify, not
        tokens to take. The matcher does not move."""
        ...


MatcherT = TypeVar("MatcherT", bound=GrammarMatcher)


class GrammarBackend(Protocol[MatcherT]):
    """A backend's matchers are its own kind: ``fill_bitmask`` takes only those ``matcher`` made."""

    name: str

    def compile(self, kind: GrammarKind, text: str, any_whitespace: bool) -> Any:
        """A compiled grammar (shared by every request with the same constraint); ``ValueError`` if invalid."""
        ...

    def matcher(self, compiled: Any) -> MatcherT: ...

    def fill_bitmask(self, matchers: Sequence[MatcherT], bitmask: torch.Tensor) -> None:
        """Write the allowed tokens of ``matchers[i]`` into row ``i`` of ``bitmask``."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
