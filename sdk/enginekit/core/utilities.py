"""The engine's utility calls: ``call_utility("name", *args)`` runs ``EngineCore.utility_name(*args)`` on the
engine's loop (``EngineCore._call_utility`` dispatches them, and answers a Future result once it completes).

Each is a read of the engine's state or a thin call into one of its parts; they live here, as a base class of
``EngineCore``, so that ``core/engine_core.py`` is the dispatch and the step loop alone.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.lora import LoRAManager
from enginekit.core.resources import KVCacheSize
from enginekit.core.scheduler import Scheduler
from enginekit.core.speculative.plan import Speculation
from enginekit.core.step_outputs import StepOutputs
from enginekit.core.structured.manager import StructuredOutputManager
from enginekit.model.kernels.library import native_kernels_status


class EngineUtilities:
    """``EngineCore``'s ``utility_*`` methods. What they read is the core's, set as it starts (declared here)."""

    engine_index: int
    scheduler: Scheduler
    kv_cache: KVCacheManager
    kv_size: KVCacheSize
    outputs: StepOutputs
    structured: StructuredOutputManager
    speculation: Speculation
    loras: LoRAManager | None
    num_steps: int
    start_time: float
    _idle_waiters: list[concurrent.futures.Future[dict[str, Any]]]

    def utility_ping(self) -> str:
        return "pong"

    def utility_get_stats(self) -> dict[str, Any]:
        kv = self.kv_cache
        return {
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting),
            "kv_cache_usage": kv.usage,
            "num_kv_blocks": kv.pool.num_blocks,
            "kv_cache_bytes": self.kv_size.num_bytes,
            "kv_cache_tokens": self.kv_size.num_tokens,
            "num_free_kv_blocks": kv.pool.num_free_blocks,
            "prefix_cache_queries": kv.num_prefix_queries,
            "prefix_cache_hits": kv.num_prefix_hits,
            "prefix_cache_hit_rate": kv.num_prefix_hits / kv.num_prefix_queries
            if kv.num_prefix_queries
            else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_idle_waiters": len(self._idle_waiters),
            "num_generated_tokens": self.outputs.num_generated_tokens,
            "uptime_s": time.monotonic() - self.start_time,
            "data_parallel_rank": self.engine_index,
            "native_kernels": native_kernels_status(),
            **self.structured.stats(),
            **self.speculation.stats(),
            **(self.loras.stats() if self.loras is not None else {}),
        }

    def utility_wait_idle(self) -> concurrent.futures.Future[dict[str, Any]]:
        """A Future that completes (with the stats) once no request is running or waiting."""
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._idle_waiters.append(future)
        return future

    def utility_reset_prefix_cache(self) -> bool:
        return self.kv_cache.pool.reset_prefix_cache()

    def utility_get_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def utility_add_lora(self, lora_request: Any) -> bool:
        return self._lora_manager().add(lora_request)

    def utility_remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().remove(lora_int_id)

    def utility_pin_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().pin(lora_int_id)

    def utility_list_loras(self) -> list[int]:
        return self._lora_manager().list()

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise ValueError("LoRA is off in this engine: start it with enable_lora=True")
        return self.loras

    def utility_sleep(self, seconds: float) -> float:
        """Block the engine loop for a while (tests use it to hold a step open)."""
        time.sleep(seconds)
        return seconds
