"""EngineCoreClient: how the facade drives an engine core, whichever process it runs in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from enginekit.config import EngineConfig, EngineMode
from enginekit.core.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """The front end's handle on one engine core.

    ``get_output`` returns the next batch of step outputs (``None`` when none arrived within ``timeout``)
    and raises ``EngineDeadError`` once the engine is gone. The ``*_async`` variants do the same on the
    caller's asyncio loop.
    """

    mode: EngineMode
    max_model_len: int
    num_kv_blocks: int
    engine_pid: int

    @staticmethod
    def make_client(mode: EngineMode, config: EngineConfig) -> EngineCoreClient:
        if mode == "inproc":
            from enginekit.client.inproc import InprocClient

            return InprocClient(config)
        if mode == "mp":
            from enginekit.client.sync_mp import SyncMPClient

            return SyncMPClient(config)
        if mode == "async":
            from enginekit.client.async_mp import AsyncMPClient

            return AsyncMPClient(config)
        raise ValueError(f"unknown mode {mode!r}")

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None: ...

    @abstractmethod
    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any: ...

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None: ...

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...

    # Async variants: by default the sync call, which is fine wherever the call cannot block for long.
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        return self.call_utility(method_name, *args, timeout=timeout)
