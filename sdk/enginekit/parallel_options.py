"""The checks of ``EngineConfig``'s parallel options, which constrain each other: data-parallel ranks (started here,
by hand on other hosts, or placed by Ray) and the tensor-parallel size of each engine core.

``EngineConfig.__post_init__`` calls both checks; each raises ``ValueError`` (``ImportError`` for a missing Ray)
with a message that names the options that clash and what to change.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from enginekit.config import EngineConfig


def check_data_parallel(config: EngineConfig) -> None:
    """Refuse a data-parallel rank, load balancing, remote ranks or Ray placement that cannot run together."""
    size, rank, balancing = (
        config.data_parallel_size,
        config.data_parallel_rank,
        config.data_parallel_load_balancing,
    )
    if size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {size}")
    if config.data_parallel_backend == "ray":
        _check_ray(config)
    if rank is not None and not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size={size}), got {rank}")
    if rank is not None and balancing == "internal":
        raise ValueError(
            f"data_parallel_rank={rank} starts one rank, which needs external load balancing; drop "
            "data_parallel_load_balancing='internal', or drop the rank to start every rank here"
        )
    if rank is None and balancing == "external":
        raise ValueError(
            "data_parallel_load_balancing='external' runs one rank per front end: give data_parallel_rank"
        )
    _check_remote_ranks(config)


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a tensor-parallel size with what its workers do not support yet (remote ranks), and a
    stall timeout that is not a positive number of seconds."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    stall = config.tensor_parallel_stall_timeout
    if not stall > 0:  # NOTE: also refuses nan
        raise ValueError(
            f"tensor_parallel_stall_timeout must be a positive number of seconds, got {stall}: how long a worker "
            "may hold a step up without progress before the engine fails"
        )
    if size == 1:
        return
    if config.data_parallel_size_local is not None:
        raise ValueError(
            f"tensor_parallel_size={size} runs its workers beside each engine core this front end starts or "
            "Ray places: it does not combine with remote ranks started by hand (data_parallel_size_local) yet"
        )


def _check_remote_ranks(config: EngineConfig) -> None:
    local, size, address = config.data_parallel_size_local, config.data_parallel_size, config.address
    if local is None:
        if config.data_parallel_keys is not None:
            raise ValueError("data_parallel_keys is for remote ranks: give data_parallel_size_local too")
        return
    if not 0 <= local <= size:
        raise ValueError(f"data_parallel_size_local must be in [0, data_parallel_size={size}], got {local}")
    if config.data_parallel_rank is not None or config.data_parallel_load_balancing == "external":
        raise ValueError(
            "data_parallel_size_local starts ranks behind one front end (internal load balancing); "
            "it cannot be combined with data_parallel_rank or external load balancing"
        )
    if local == size:
        return
    port = (address or "").rpartition(":")[2]
    if not (address or "").startswith("tcp://") or not port.isdigit() or port == "0":
        raise ValueError(
            f"remote ranks (data_parallel_size_local={local} < data_parallel_size={size}) connect over "
            f"TCP to a fixed port: give address='tcp://HOST:PORT', got {address!r}"
        )
    if not config.data_parallel_keys:
        raise ValueError(
            "remote ranks need data_parallel_keys: the file the front end writes their CURVE keys to"
        )


def _check_ray(config: EngineConfig) -> None:
    if (
        config.data_parallel_rank is not None
        or config.data_parallel_size_local is not None
        or config.data_parallel_load_balancing == "external"
    ):
        raise ValueError(
            "data_parallel_backend='ray' places every rank behind this front end (internal load balancing): "
            "drop data_parallel_rank, data_parallel_size_local and external load balancing"
        )
    if config.address is not None and not config.address.startswith("tcp://"):
        raise ValueError(
            f"Ray ranks join the front end over TCP: give address='tcp://HOST:PORT', got {config.address!r}"
        )
    if config.device is not None and config.device.startswith("cuda:"):
        raise ValueError(
            f"Ray places each rank on a GPU of its choosing: give device='cuda', not {config.device!r}"
        )
    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # a module named ray without a spec: not the package
        found = False
    if not found:
        raise ImportError(
            "data_parallel_backend='ray' needs Ray, which is not installed: pip install 'enginekit[ray]'"
        )
