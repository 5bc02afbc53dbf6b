"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of a sequence's last
tokens, in its prompt and its own output (vLLM's ``ngram`` method; llama.cpp's lookup decoding).

The longest suffix first: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens are
looked for earlier in the sequence; the first n that occurs proposes the up to k tokens after its latest
occurrence. The search is numpy over the sequence (the candidates are the places its last token occurs), with
no state between steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from enginekit.core.speculative.proposer import ProposalRequest


class NgramProposer:
    def __init__(self, *, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: Sequence[ProposalRequest], limits: Sequence[int]) -> list[list[int]]:
        return [
            lookup(request.all_token_ids, limit, self.max_n, self.min_n)
            for request, limit in zip(requests, limits)
        ]

    def forget(self, request_ids: Iterable[str]) -> None:
        pass  # no state per request

    def shutdown(self) -> None:
        pass


def lookup(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``token_ids`` of
    ``max_n`` down to ``min_n`` tokens; ``[]`` when no such suffix occurs before."""
    length = len(token_ids)
    if length <= min_n or k <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # where an earlier copy of the suffix could end: the last token occurs there (and something follows it)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        candidates = ends[ends >= n - 1]
        for back in range(1, n):
            if not len(candidates):
                break
            candidates = candidates[tokens[candidates - back] == tokens[length - 1 - back]]
        if len(candidates):
            start = int(candidates[-1]) + 1
            return token_ids[start : start + k]
    return []
