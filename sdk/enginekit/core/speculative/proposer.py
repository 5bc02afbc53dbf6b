"""What a speculative method gives the engine core: up to k tokens to follow each decoding request.

The core asks once a step, before it schedules, for every running request that decodes (its tokens all
computed but the last); a request's proposals are then verified in that step (``core/speculative/plan.py``). A
proposer sees requests only through ``ProposalRequest``'s fields, and hears which requests are gone
(``forget``), so a method with state per request (a draft model's KV cache) can drop it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class ProposalRequest(Protocol):
    """The fields of a request a proposer may read (``core/request.py``'s ``Request`` has them)."""

    request_id: str
    all_token_ids: list[int]  # prompt and output so far: the proposals follow its last token
    num_prompt_tokens: int


class Proposer(Protocol):
    def propose(self, requests: Sequence[ProposalRequest], limits: Sequence[int]) -> list[list[int]]:
        """At most ``limits[i]`` tokens (at least 1 each) to follow ``requests[i].all_token_ids``; fewer, or
        none, where the method has nothing to offer."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests ended or were preempted: drop what was kept for them."""
        ...

    def shutdown(self) -> None:
        """Release what the proposer holds (a draft model, its cache)."""
        ...
