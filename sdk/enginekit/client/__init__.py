"""The clients: one per mode, chosen from a table; each drives an engine core the same way for the facade."""

from __future__ import annotations

from enginekit.client.base import EngineCoreClient
from enginekit.client.inproc import InprocClient
from enginekit.client.mp import AsyncMPClient, SyncMPClient
from enginekit.config import EngineConfig, EngineMode
from enginekit.model.loader import ModelSpec

__all__ = ["CLIENTS", "AsyncMPClient", "EngineCoreClient", "InprocClient", "SyncMPClient", "make_client"]

CLIENTS: dict[str, type[EngineCoreClient]] = {
    "inproc": InprocClient,
    "mp": SyncMPClient,
    "async": AsyncMPClient,
}


def make_client(mode: EngineMode, config: EngineConfig, spec: ModelSpec) -> EngineCoreClient:
    """Start an engine core for ``mode``; an in-process core reuses the front end's model spec."""
    return CLIENTS[mode](config, spec)
