"""What every captured CUDA graph of a runner shares: one memory pool and one static logits buffer.

The decode graphs (``decode_graph.py``) and the mixed-step graphs (``mixed_graph.py``) are captured one after
another into one pool, and replayed one at a time on one stream, so a capture reuses what the captures before it
freed: the pool grows to about the largest step's activations, not their sum. Every graph writes its logits into
the same buffer (``max_rows`` rows): a graph's own output would stay allocated in the pool for as long as the
graph lives. Both are what the KV cache's sizing sets aside for graphs (``graph_reserve_bytes`` in
``core/resources.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

logger = logging.getLogger("enginekit.model")
Shape = TypeVar("Shape", bound=Hashable)


class _Replay:
    """A captured graph and the static tensor its replay writes the logits into."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class GraphPool:
    """Captures padded steps into one shared pool; without CUDA (``capture=False``) runs them eagerly instead."""

    def __init__(self, device: torch.device, max_rows: int, *, capture: bool) -> None:
        self.device = device
        self.max_rows = max_rows  # the most logits rows a captured step computes
        self.capture = capture
        self.logits: torch.Tensor | None = None  # what every captured graph writes its logits into
        self._pool = None

    def prepare(self, forward: Callable[[], torch.Tensor], rows: int) -> Callable[[], torch.Tensor]:
        """A step that runs ``forward`` (the padded step on static buffers, ``rows`` logits rows): its captured
        graph's replay, or (``capture=False``) ``forward`` itself."""
        if not self.capture:
            return forward
        # Warm up on a side stream first (lazy initialisation and Triton's compilation must not be recorded), as
        # torch's docs ask. The warm-up runs on the buffers' current inputs: its cache writes are the replay's.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            warm = forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # a tensor-parallel worker's step computes no logits (rank 0's does): its graph has no output to keep
        has_logits = warm.dim() == 2
        if has_logits and self.logits is None:
            self.logits = torch.empty(self.max_rows, warm.shape[1], dtype=warm.dtype, device=self.device)
        del warm
        logits = (
            self.logits[:rows]
            if has_logits and self.logits is not None
            else torch.empty(0, device=self.device)
        )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
            if has_logits:
                logits.copy_(out)
            del out
        self._pool = graph.pool()
        return _Replay(graph, logits)

    def prepare_ahead(
        self,
        what: str,
        steps: dict[Shape, Callable[[], torch.Tensor]],
        shapes: Sequence[Shape],
        prepare: Callable[[Shape], Callable[[], torch.Tensor]],
        budget_s: float,
        clock: Callable[[], float],
    ) -> int:
        """Prepare ``shapes`` in order into ``steps`` (shape -> step, ``prepare(shape)``) until ``budget_s`` seconds
        have passed, the ones already there counted; log how many (``what``: their kind) and return it."""
        started = clock()
        count = 0
        for shape in shapes:
            if clock() - started >= budget_s:
                break
            if shape not in steps:
                steps[shape] = prepare(shape)
            count += 1
        logger.info(
            "%s: %d of %d shapes %s in %.1f s at start (cuda_graph_capture_s budget %g); the rest on first use",
            what,
            count,
            len(shapes),
            "captured" if self.capture else "prepared",
            clock() - started,
            budget_s,
        )
        return count

    def release(self) -> None:
        """Drop the buffer and the pool (the graphs' owners drop the graphs)."""
        self.logits = None
        self._pool = None
