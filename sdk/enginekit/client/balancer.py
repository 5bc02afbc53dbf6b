"""LoadBalancer: which data-parallel rank serves a new request, counted in the front end.

A request goes to the rank with the fewest unfinished requests; ties go round-robin. Its aborts follow it to
that rank, and the count drops when its final output arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LoadBalancer:
    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)
        self.loads = dict.fromkeys(self.ranks, 0)  # unfinished requests per rank
        self._owners: dict[str, int] = {}
        self._next = 0  # where the round-robin among tied ranks starts
        self._lock = threading.Lock()

    def choose(self, request_id: str) -> int:
        """The rank for a new request (the least loaded, round-robin among equals); it is counted there."""
        with self._lock:
            least = min(self.loads.values())
            count = len(self.ranks)
            order = (self.ranks[(self._next + offset) % count] for offset in range(count))
            rank = next(rank for rank in order if self.loads[rank] == least)
            self._next = (self.ranks.index(rank) + 1) % count
            self.loads[rank] += 1
            self._owners[request_id] = rank
            return rank

    def finished(self, request_id: str) -> None:
        with self._lock:
            rank = self._owners.pop(request_id, None)
            if rank is not None:
                self.loads[rank] -= 1

    def by_rank(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """The ids grouped by the rank that owns them (ids no rank owns are left out)."""
        groups: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                rank = self._owners.get(request_id)
                if rank is not None:
                    groups.setdefault(rank, []).append(request_id)
        return groups
