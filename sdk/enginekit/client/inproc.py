"""InprocClient: the engine core in this process and thread; ``get_output`` runs one step."""

from __future__ import annotations

import gc
from typing import Any

from enginekit.client.base import EngineCoreClient
from enginekit.config import EngineConfig
from enginekit.core.engine_core import EngineCore
from enginekit.core.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityRequest,
)
from enginekit.errors import EngineDeadError, EngineShutdownError, UtilityCallError


class InprocClient(EngineCoreClient):
    mode = "inproc"

    def __init__(self, config: EngineConfig) -> None:
        self._core: EngineCore | None = EngineCore(config)
        self._dead: BaseException | None = None
        self.max_model_len = self._core.max_model_len
        self.num_kv_blocks = self._core.num_kv_blocks
        import os

        self.engine_pid = os.getpid()

    @property
    def core(self) -> EngineCore:
        if self._dead is not None:
            raise EngineDeadError(f"the in-process engine failed: {self._dead}") from self._dead
        if self._core is None:
            raise EngineShutdownError("the engine has been shut down; call engine.restart()")
        return self._core

    @property
    def is_alive(self) -> bool:
        return self._core is not None and self._dead is None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.handle_request(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.handle_request(RequestType.ABORT, request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        core = self.core
        try:
            outputs, _ = core.step()
        except Exception as error:
            self._dead = error
            core.shutdown()
            raise EngineDeadError(f"the in-process engine failed in a step: {error}") from error
        return EngineCoreOutputs(outputs) if outputs else None

    async def get_output_async(self) -> EngineCoreOutputs:
        import asyncio

        while True:
            batch = self.get_output()
            await asyncio.sleep(0)  # let other tasks of this loop run between steps
            if batch is not None:
                return batch

    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        request = UtilityRequest(0, 0, method_name, list(args))
        try:
            return self.core.handle_request(RequestType.UTILITY, request)
        except (EngineDeadError, EngineShutdownError):
            raise
        except Exception as error:
            raise UtilityCallError(f"utility {method_name!r} failed: {error}") from error

    def shutdown(self, timeout: float | None = None) -> None:
        core, self._core = self._core, None
        if core is not None:
            core.shutdown()
            del core
            gc.collect()
