"""Every value a step moves between the host and the device, in one place.

- **Up** (``upload``, ``upload_tensor``): small per-step tensors (sampling parameters, token ids of the controls,
  a structured output's packed bitmask) go through pinned host memory and are copied without blocking. A copy from
  pageable memory would make CUDA wait for everything queued on the stream first: the forward pass.
- **Back** (``to_host``): a step's sampled ids and the logprobs asked for, never the logits, are copied into pinned
  host memory on a stream of their own (``CopyStream``), behind the step's work; ``HostCopy.wait`` blocks until
  they are there. This is the only way a step's values reach the host, so a test can count them.

On CPU the device is the host: nothing is copied, and the tensors are handed on as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def upload(values: Sequence[Any] | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (numbers, or equal rows of numbers) as a tensor on ``device``, built on the host and copied
    without blocking."""
    host = (
        torch.from_numpy(values).to(dtype)
        if isinstance(values, np.ndarray)
        else torch.tensor(values, dtype=dtype)
    )
    return upload_tensor(host, device)


def upload_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory, without blocking (the pinned copy is the caching host
    allocator's, kept until the copy is done, so the caller may reuse ``tensor`` at once)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class CopyStream:
    """The stream the copies back run on, one per runner (CUDA only): they wait for the step's work, and the next
    step's work does not wait for them."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None


class HostCopy:
    """Tensors on their way to the host; ``wait`` returns them once they are there."""

    __slots__ = ("_event", "_sources", "tensors")

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...],
        event: torch.cuda.Event | None = None,
        sources: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.tensors = tensors
        self._event = event
        self._sources = sources  # NOTE: the device tensors stay alive until the copy stream has read them

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._event is not None:
            self._event.synchronize()
            self._event, self._sources = None, ()
        return self.tensors


def to_host(tensors: tuple[torch.Tensor, ...], copy_stream: CopyStream | None = None) -> HostCopy:
    """Start copying ``tensors`` (all on one device) to pinned host memory, behind the work queued so far."""
    stream = copy_stream.stream if copy_stream is not None else None
    if not tensors or tensors[0].device.type == "cpu":
        return HostCopy(tensors)
    if stream is None or tensors[0].device.type != "cuda":
        return HostCopy(tuple(tensor.cpu() for tensor in tensors))
    main = torch.cuda.current_stream(tensors[0].device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        host = tuple(
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
        )
        event = torch.cuda.Event(
            blocking=True
        )  # NOTE: a blocking event sleeps instead of spinning on the driver
        event.record(stream)
    return HostCopy(host, event, tensors)
