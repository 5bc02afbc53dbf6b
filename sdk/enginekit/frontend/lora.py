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
        return all(_on_each_rank(self, "add_lora", _checked(self, lora_request)))

    async def aadd_lora(self: _Engine, lora_request: LoRARequest) -> bool:
        """Async ``add_lora``."""
        return all(await _on_each_rank_async(self, "add_lora", _checked(self, lora_request)))

    def remove_lora(self: _Engine, lora_int_id: int) -> bool:
        """Forget a LoRA adapter; ``False`` if none has that id. Refused (``UtilityCallError``) while unfinished
        requests use it."""
        return all(_on_each_rank(self, "remove_lora", _id(self, lora_int_id)))

    async def aremove_lora(self: _Engine, lora_int_id: int) -> bool:
        """Async ``remove_lora``."""
        return all(await _on_each_rank_async(self, "remove_lora", _id(self, lora_int_id)))

    def pin_lora(self: _Engine, lora_int_id: int) -> bool:
        """Keep a loaded LoRA adapter loaded (never dropped from host memory; kept in its device slot while
        another slot will do); ``True``."""
        return all(_on_each_rank(self, "pin_lora", _id(self, lora_int_id)))

    async def apin_lora(self: _Engine, lora_int_id: int) -> bool:
        """Async ``pin_lora``."""
        return all(await _on_each_rank_async(self, "pin_lora", _id(self, lora_int_id)))

    def list_loras(self: _Engine) -> set[int]:
        """The ids of the LoRA adapters the engine holds (on any data-parallel rank)."""
        _check_on(self)
        return {i for ids in _on_each_rank(self, "list_loras") for i in ids}

    async def alist_loras(self: _Engine) -> set[int]:
        """Async ``list_loras``."""
        _check_on(self)
        return {i for ids in await _on_each_rank_async(self, "list_loras") for i in ids}


def _on_each_rank(engine: _Engine, method: str, *args: Any) -> list[Any]:
    """The utility's answer of every data-parallel rank."""
    result = engine.client.call_utility(method, *args, timeout=TIMEOUT_S)
    return result if engine.client.num_ranks > 1 else [result]


async def _on_each_rank_async(engine: _Engine, method: str, *args: Any) -> list[Any]:
    result = await engine.client.call_utility_async(method, *args, timeout=TIMEOUT_S)
    return result if engine.client.num_ranks > 1 else [result]


def _checked(engine: _Engine, lora_request: Any) -> LoRARequest:
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"add_lora takes a LoRARequest, not {type(lora_request).__name__}")
    _check_on(engine)
    assert engine._spec is not None
    inspect_adapter(lora_request, engine._spec.config, engine.config.max_lora_rank)
    return lora_request


def _check_on(engine: _Engine) -> None:
    if not engine.config.enable_lora:
        raise ValueError("LoRA is off in this engine: start it with enable_lora=True")


def _id(engine: _Engine, lora_int_id: Any) -> int:
    _check_on(engine)
    if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool):
        raise TypeError(f"lora_int_id must be an integer, got {lora_int_id!r}")
    return lora_int_id
