"""The clients: one per mode, chosen from a table; each drives an engine core the same way for the facade."""

from __future__ import annotations

from collections.abc import Callable

from enginekit.client.base import EngineCoreClient
from enginekit.client.inproc import InprocClient
from enginekit.client.mp import AsyncMPClient, SyncMPClient
from enginekit.client.startup import check_placement
from enginekit.config import EngineConfig, EngineMode
from enginekit.model.loader import ModelSpec

__all__ = [
    "CLIENTS",
    "AsyncMPClient",
    "EngineCoreClient",
    "InprocClient",
    "SyncMPClient",
    "check_client",
    "make_client",
]

CLIENTS: dict[str, Callable[[EngineConfig, ModelSpec], EngineCoreClient]] = {
    "inproc": InprocClient,
    "mp": SyncMPClient,
    "async": AsyncMPClient,
}


def make_client(mode: EngineMode, config: EngineConfig, spec: ModelSpec) -> EngineCoreClient:
    """Start an engine core for ``mode``; an in-process core reuses the front end's model spec."""
    check_client(mode, config)
    return CLIENTS[mode](config, spec)


def check_client(mode: EngineMode, config: EngineConfig) -> None:
    """Refuse a mode and config that cannot run together (``ValueError``), before anything starts."""
    if mode == "inproc" and config.data_parallel_size > 1:
        raise ValueError(
            f"mode='inproc' runs one engine core in this process; data_parallel_size={config.data_parallel_size} "
            "needs mode='mp' or mode='async'"
        )
    if mode != "inproc":
        check_placement(config)
