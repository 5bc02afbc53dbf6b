"""EngineCoreClient: how the facade drives an engine core, whichever process it runs in.

Every client offers the same calls, each waiting one with a blocking and an ``*_async`` form, so the
facade never asks which mode it runs in. Submissions (``add_request``, ``abort_requests``) never block and are
safe from any thread. Waiting and taking are separate: ``wait_for_output`` (or ``wait_for_output_async``)
returns once a batch of step outputs may be ready (or the waiter's own condition holds: another thread routed
its outputs, and said so with ``wake_waiters``), and ``get_output(0)`` takes it (``None`` if there is none;
in-process, it runs a step). The facade takes and routes a batch in one short critical section, so batches are
applied in order whichever thread or task takes them. ``get_output(timeout)`` does both. Once the engine is
gone, every call raises ``EngineDeadError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from enginekit.config import EngineMode
from enginekit.wire.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """The front end's handle on an engine core."""

    mode: EngineMode
    max_model_len: int
    num_kv_blocks: int
    kv_cache_bytes: int  # every rank's KV cache, as READY reported it
    kv_cache_tokens: int
    engine_pid: int

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = 0) -> EngineCoreOutputs | None: ...

    @abstractmethod
    def wait_for_output(self, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        """Until a batch may be ready, the engine is gone, ``until()`` holds (re-checked at each
        ``wake_waiters``), or ``timeout``."""

    @abstractmethod
    def wake_waiters(self) -> None:
        """Have the threads blocked in ``wait_for_output`` check their ``until`` again: a batch was routed, and
        with it perhaps what they wait for."""

    @abstractmethod
    async def wait_for_output_async(self) -> None: ...

    @abstractmethod
    def call_utility(
        self, method_name: str, *args: Any, timeout: float | None = None, rank: int | None = None
    ) -> Any:
        """Run ``utility_<method_name>`` on one rank (``rank``), or on each rank (a list of results)."""

    @abstractmethod
    async def call_utility_async(
        self, method_name: str, *args: Any, timeout: float | None = None, rank: int | None = None
    ) -> Any: ...

    @property
    def num_ranks(self) -> int:
        """Engine cores behind this client (data-parallel ranks)."""
        return 1

    def call_utility_on_each_rank(
        self, method_name: str, *args: Any, timeout: float | None = None
    ) -> list[Any]:
        """``utility_<method_name>`` on every rank: one result per rank, however many there are."""
        result = self.call_utility(method_name, *args, timeout=timeout)
        return result if self.num_ranks > 1 else [result]

    def get_stats(self) -> dict[str, Any]:
        """The engine's statistics; with several ranks, their sums and a per-rank breakdown."""
        return merge_stats(self.call_utility("get_stats", timeout=30.0))

    async def get_stats_async(self) -> dict[str, Any]:
        return merge_stats(await self.call_utility_async("get_stats", timeout=30.0))

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None: ...

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...


# What merging several ranks' statistics does with a key that is not a count to add up.
RANK_KEYS = frozenset(
    {"data_parallel_rank"}
)  # one rank's identity: no merged value (each is under ``ranks``)
DIFFERS = "differs by rank (see ranks)"


def merge_stats(stats: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's stats as they are; several ranks' merged, with ``ranks`` (each rank's own) beside.

    Counts are summed, ratios recomputed from the sums, ``uptime_s`` is the longest; a text value is kept when
    every rank has the same, else it says it differs; a rank's identity (``data_parallel_rank``) has no merged
    value and is left out."""
    if isinstance(stats, dict):
        return stats
    total: dict[str, Any] = {}
    for key, value in stats[0].items():
        if key in RANK_KEYS:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = sum(rank[key] for rank in stats)
        else:
            values = [rank.get(key) for rank in stats]
            total[key] = value if all(other == value for other in values) else DIFFERS
    total["kv_cache_usage"] = 1.0 - total["num_free_kv_blocks"] / total["num_kv_blocks"]
    queries = total["prefix_cache_queries"]
    total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
    total["uptime_s"] = max(rank["uptime_s"] for rank in stats)
    total["ranks"] = stats
    return total
