"""LoadBalancer: which data-parallel rank serves a new request, counted in the front end.

A request goes to the rank with the fewest unfinished requests; ties go round-robin. The samples of one prompt
(``n > 1``: engine requests with one parent) all go where the first went, so the prompt is prefilled once and
its KV blocks are shared. Its aborts follow a request to its rank, and the count drops when its final output
arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LoadBalancer:
    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)
        self.loads = dict.fromkeys(self.ranks, 0)  # unfinished requests per rank
        self._owners: dict[str, int] = {}
        self._parents: dict[str, str] = {}  # a sample's parent request id
        self._families: dict[str, list[int]] = {}  # per parent: its rank and its unfinished samples
        self._next = 0  # where the round-robin among tied ranks starts
        self._lock = threading.Lock()

    def choose(self, request_id: str, parent_id: str | None = None) -> int:
        """The rank for a new request (the least loaded, round-robin among equals; a sample goes where its
        parent's first sample went); it is counted there."""
        with self._lock:
            family = self._families.get(parent_id) if parent_id is not None else None
            rank = family[0] if family is not None else self._least_loaded()
            if parent_id is not None:
                family = self._families.setdefault(parent_id, [rank, 0])
                family[1] += 1
                self._parents[request_id] = parent_id
            self.loads[rank] += 1
            self._owners[request_id] = rank
            return rank

    def _least_loaded(self) -> int:
        least = min(self.loads.values())
        count = len(self.ranks)
        order = (self.ranks[(self._next + offset) % count] for offset in range(count))
        rank = next(rank for rank in order if self.loads[rank] == least)
        self._next = (self.ranks.index(rank) + 1) % count
        return rank

    def finished(self, request_id: str) -> None:
        with self._lock:
            rank = self._owners.pop(request_id, None)
            if rank is not None:
                self.loads[rank] -= 1
            parent_id = self._parents.pop(request_id, None)
            if parent_id is not None:
                family = self._families[parent_id]
                family[1] -= 1
                if family[1] == 0:
                    del self._families[parent_id]

    def by_rank(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """The ids grouped by the rank that owns them (ids no rank owns are left out)."""
        groups: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                rank = self._owners.get(request_id)
                if rank is not None:
                    groups.setdefault(rank, []).append(request_id)
        return groups
