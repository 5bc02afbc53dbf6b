"""The facade's LoRA utilities (vLLM's names): add, remove, pin and list the adapters an engine holds.

A request loads its adapter by itself (``lora_request=``); these calls manage them ahead of and between requests.
Each runs on every data-parallel rank, so every rank holds the same adapters.
"""

from __future__ import annotations

from typing import Any, Protocol

from enginekit.client import EngineCoreClient
from enginekit.config import EngineConfig
from enginekit.lora_request import LoRARequest
from enginekit.model.loader import ModelSpec
from enginekit.model.lora.adapter import inspect_adapter

TIMEOUT_S = 60.0  # reading an adapter's weights from disk may take a while


class _Engine(Protocol):
    """What the LoRA calls need of ``Engine``."""

    config: EngineConfig
    _spec: ModelSpec | None

    @property
    def client(self) -> EngineCoreClient: ...


class LoRAMethods:
    """``add_lora``, ``remove_lora``, ``pin_lora``, ``list_loras`` and their async forms, on ``Engine``."""

    def add_lora(self: _Engine, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter into the engine (it stays loaded while it fits ``max_cpu_loras``); ``True``.

        The folder, config and shapes are checked here first (``ValueError`` naming the adapter); the engine then
        reads the weights (a failure there raises ``UtilityCallError`` with its reason).
        """
        return all(
            _each_rank(
                self, self.client.call_utility("add_lora", _checked(self, lora_request), timeout=TIMEOUT_S)
            )
        )

    async def aadd_lora(self: _Engine, lora_request: LoRARequest) -> bool:
        """Async ``add_lora``."""
        checked = _checked(self, lora_request)
        return all(
            _each_rank(self, await self.client.call_utility_async("add_lora", checked, timeout=TIMEOUT_S))
        )

    def remove_lora(self: _Engine, lora_int_id: int) -> bool:
        """Forget a LoRA adapter; ``False`` if none has that id. Refused (``UtilityCallError``) while unfinished
        requests use it."""
        return all(
            _each_rank(self, self.client.call_utility("remove_lora", _id(lora_int_id), timeout=TIMEOUT_S))
        )

    async def aremove_lora(self: _Engine, lora_int_id: int) -> bool:
        """Async ``remove_lora``."""
        result = await self.client.call_utility_async("remove_lora", _id(lora_int_id), timeout=TIMEOUT_S)
        return all(_each_rank(self, result))

    def pin_lora(self: _Engine, lora_int_id: int) -> bool:
        """Keep a loaded LoRA adapter loaded (never dropped from host memory; kept in its device slot while
        another slot will do); ``True``."""
        return all(
            _each_rank(self, self.client.call_utility("pin_lora", _id(lora_int_id), timeout=TIMEOUT_S))
        )

    async def apin_lora(self: _Engine, lora_int_id: int) -> bool:
        """Async ``pin_lora``."""
        result = await self.client.call_utility_async("pin_lora", _id(lora_int_id), timeout=TIMEOUT_S)
        return all(_each_rank(self, result))

    def list_loras(self: _Engine) -> set[int]:
        """The ids of the LoRA adapters the engine holds (on any data-parallel rank)."""
        return {
            i
            for ids in _each_rank(self, self.client.call_utility("list_loras", timeout=TIMEOUT_S))
            for i in ids
        }

    async def alist_loras(self: _Engine) -> set[int]:
        """Async ``list_loras``."""
        result = await self.client.call_utility_async("list_loras", timeout=TIMEOUT_S)
        return {i for ids in _each_rank(self, result) for i in ids}


def _checked(engine: _Engine, lora_request: Any) -> LoRARequest:
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"add_lora takes a LoRARequest, not {type(lora_request).__name__}")
    if not engine.config.enable_lora:
        raise ValueError("LoRA is off in this engine: start it with enable_lora=True")
    assert engine._spec is not None
    inspect_adapter(lora_request, engine._spec.config, engine.config.max_lora_rank)
    return lora_request


def _id(lora_int_id: Any) -> int:
    if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool):
        raise TypeError(f"lora_int_id must be an integer, got {lora_int_id!r}")
    return lora_int_id


def _each_rank(engine: _Engine, result: Any) -> list[Any]:
    """A utility's answer as one result per data-parallel rank."""
    return result if engine.client.num_ranks > 1 else [result]
