"""EngineCoreClient: how the facade drives an engine core, whichever process it runs in.

Every client offers the same calls, each waiting one with a blocking and an ``*_async`` form, so the
facade never asks which mode it runs in. Submissions (``add_request``, ``abort_requests``) never block and are
safe from any thread. Waiting and taking are separate: ``wait_for_output`` (or ``wait_for_output_async``)
returns once a batch of step outputs may be ready, and ``get_output(0)`` takes it (``None`` if there is none;
in-process, it runs a step). The facade takes and routes a batch in one short critical section, so batches are
applied in order whichever thread or task takes them. ``get_output(timeout)`` does both. Once the engine is
gone, every call raises ``EngineDeadError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from enginekit.config import EngineMode
from enginekit.wire.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """The front end's handle on an engine core."""

    mode: EngineMode
    max_model_len: int
    num_kv_blocks: int
    engine_pid: int

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = 0) -> EngineCoreOutputs | None: ...

    @abstractmethod
    def wait_for_output(self, timeout: float | None) -> None: ...

    @abstractmethod
    async def wait_for_output_async(self) -> None: ...

    @abstractmethod
    def call_utility(self, method_name: str, *args: Any, timeout: float | None = None) -> Any: ...

    @abstractmethod
    async def call_utility_async(self, method_name: str, *args: Any, timeout: float | None = None) -> Any: ...

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None: ...

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...
