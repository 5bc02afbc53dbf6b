"""InprocClient: the engine core in this process and thread; ``get_output`` runs one step."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
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
        self._undelivered: list = []  # outputs of steps run for a utility call, for the next get_output
        # NOTE: the core is not thread-safe; every call into it (a step included) holds this lock.
        self._lock = threading.RLock()
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
        with self._lock:
            self.core.handle_request(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            self.core.handle_request(RequestType.ABORT, request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        with self._lock:
            self._undelivered.extend(self._step())
            if not self._undelivered:
                return None
            batch, self._undelivered = self._undelivered, []
        return EngineCoreOutputs(batch)

    def _step(self) -> list:
        core = self.core
        try:
            outputs, _ = core.step()
        except Exception as error:
            self._dead = error
            core.shutdown()
            raise EngineDeadError(f"the in-process engine failed in a step: {error}") from error
        return outputs

    async def get_output_async(self) -> EngineCoreOutputs:
        import asyncio

        while True:
            batch = self.get_output()
            if batch is not None:
                return batch
            await asyncio.sleep(0)  # let other tasks of this loop run between steps

    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any:
        request = UtilityRequest(0, 0, method_name, list(args))
        with self._lock:
            return self._call_utility(request, timeout)

    def _call_utility(self, request: UtilityRequest, timeout: float | None) -> Any:
        method_name = request.method_name
        try:
            result = self.core.handle_request(RequestType.UTILITY, request)
        except (EngineDeadError, EngineShutdownError):
            raise
        except Exception as error:
            raise UtilityCallError(f"{type(error).__name__}: {error}") from error
        if isinstance(result, concurrent.futures.Future):
            # The background process answers when the Future completes; here, steps run until it does.
            deadline = None if timeout is None else time.monotonic() + timeout
            while not result.done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"utility {method_name!r} did not answer within {timeout}s")
                self._undelivered.extend(self._step())  # delivered by the next get_output
            return result.result()
        return result

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            core, self._core = self._core, None
        if core is not None:
            core.shutdown()
            del core
            gc.collect()
