"""The device side of LoRA: every adapted projection's fixed pool of adapter slots, and the batched product of a
step whose rows use several adapters (and none).

Each adapted projection holds ``max_loras`` slots: ``A`` ``[parts x max_rank, in]`` and ``B`` block-diagonal,
``[parts x max_rank, out]`` (part p's rows of ``A`` feed only part p's output features: q, k, v; gate, up), zero
where an adapter is smaller or absent. A step's rows are gathered per adapter once, before the forward pass
(``LoRAStep.begin``, from each chunk's slot and token count, in the order the step's inputs lay the chunks' rows
out), and every projection then runs two products per adapter the step uses, whatever the number of requests:
``h = x[rows] @ A^T``, ``out[rows] += h @ B``. An adapter's rows that lie together (one request, or requests side by
side) are a slice of the batch, read and written in place; scattered ones are gathered with one index and added
back with another. Rows of no adapter are not touched: the base model's rows are the base model's.

A step replayed from a CUDA graph (``cuda_graphs``) cannot split its rows on the host: the graph recorded fixed
shapes. There every projection runs one dense product instead (``LoRAStep.begin_static``): every slot's ``A`` over
every row, each row's own slot kept by a one-hot mask on the device (zeros for rows of no adapter and for padding),
then every slot's ``B``. That is ``max_loras`` times the adapters' arithmetic, small beside the base layer's (rank
16, 4 slots: under 2% of a 4,096-wide projection), and it is the same kernels whichever adapters the step uses.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.nn import functional as F

from enginekit.model import transfer

Shard = Callable[[str, torch.Tensor], torch.Tensor]
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# up to this many rows (a decode step's share) B's product is one call over its blocks, zeros included; past
# them one call per part, which skips the zeros (a fused q/k/v: a third of the work)
SMALL_ROWS = 64


class Segment:
    """One adapter's rows in a step: ``slot``, and ``start:end`` when they lie together, else ``rows``."""

    __slots__ = ("end", "rows", "slot", "start")

    def __init__(self, slot: int, start: int, end: int, rows: torch.Tensor | None = None) -> None:
        self.slot, self.start, self.end, self.rows = slot, start, end, rows


class LoRAStep:
    """This step's rows gathered per adapter slot, shared by every adapted projection of one model; in a step of
    fixed shapes (``static``), every row's slot as a one-hot row of ``mask``."""

    __slots__ = ("_mask_rows", "mask", "segments", "static")

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.static = False  # the step runs the dense product (a graph's step): see begin_static
        # NOTE: graphs read this address: fill it in place, never rebind it
        self.mask: torch.Tensor | None = None  # [rows, slots]: 1 where the row uses the slot
        self._mask_rows = 0  # the mask's rows that may hold a 1 (the rest are zeros)

    @property
    def active(self) -> bool:
        """Whether the step runs the adapters' product: some row uses an adapter, or the step has fixed shapes."""
        return self.static or bool(self.segments)

    def allow_static(self, max_rows: int, max_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        """Hold the mask for static steps of up to ``max_rows`` rows."""
        self.mask = torch.zeros(max_rows, max_loras, device=device, dtype=dtype)

    def begin_static(self, chunk_slots: list[int] | None, counts: Iterable[int]) -> None:
        """Set a step of fixed shapes (a graph's capture or replay, ``allow_static`` first): each chunk's slot
        (``-1`` for none; ``None``: no chunk uses an adapter) and its token count, written into the mask, whose
        other rows (the padding) are zeros."""
        mask = self.mask
        assert mask is not None
        self.segments = []
        self.static = True
        rows = 0
        if chunk_slots:
            slots = np.repeat(
                np.asarray(chunk_slots, np.int64), np.fromiter(counts, np.int64, len(chunk_slots))
            )
            rows = len(slots)
            used = np.flatnonzero(slots >= 0)
            onehot = np.zeros((rows, mask.shape[1]), np.float32)
            onehot[used, slots[used]] = 1.0
            mask[:rows].copy_(transfer.upload(onehot, mask.dtype, mask.device))
        if self._mask_rows > rows:  # rows the step before set that this one does not
            mask[rows : self._mask_rows].zero_()
        self._mask_rows = rows

    def begin(self, chunk_slots: list[int] | None, counts: Iterable[int], device: torch.device) -> None:
        """Set the step's rows from its chunks: each chunk's slot (``-1`` for none; ``None``: no chunk uses an
        adapter) and its token count, the chunks' rows lying one after another in their order."""
        self.segments = []
        self.static = False
        if not chunk_slots:
            return
        runs: dict[int, list[tuple[int, int]]] = {}  # slot -> its runs of rows [start, end)
        row = 0
        for slot, count in zip(chunk_slots, counts):
            end = row + int(count)
            if slot >= 0:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == row:  # the chunk before ran the same adapter: one run
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((row, end))
            row = end
        for slot, spans in runs.items():
            if len(spans) == 1:
                self.segments.append(Segment(slot, *spans[0]))
            else:
                rows = transfer.upload_tensor(torch.cat([torch.arange(a, b) for a, b in spans]), device)
                self.segments.append(Segment(slot, 0, 0, rows))


class LoRASlots:
    """One projection's adapter slots (this tensor-parallel rank's slice) and its batched product.

    ``parts``: the output features of each fused part on this rank (q, k, v; gate, up; or the one part).
    ``shard_a`` / ``shard_b``: a row-parallel layer splits ``A`` by its input, a column-parallel one ``B`` by its
    output, as the base layer's weight is split (its own ``shard``); ``None`` keeps it whole. ``kernel``: the
    base layer's product (``x @ weight^T``), used for the shrink.
    """

    def __init__(
        self,
        in_features: int,
        parts: list[int],
        *,
        max_loras: int,
        max_rank: int,
        step: LoRAStep,
        device: torch.device,
        dtype: torch.dtype,
        shard_a: Shard | None = None,
        shard_b: Shard | None = None,
        kernel: Kernel = F.linear,
    ) -> None:
        self.step = step
        self.rank = max_rank
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(parts)
        width = len(parts) * max_rank
        self.a = torch.zeros((max_loras, width, in_features), device=device, dtype=dtype)
        self.b = torch.zeros((max_loras, width, self.out_features), device=device, dtype=dtype)
        self.shard_a, self.shard_b = shard_a, shard_b
        self.kernel = kernel
        # each part's block of B: its rows (of h) and its output features
        bounds = list(itertools.accumulate(parts, initial=0))
        self.blocks = [
            (slice(p * max_rank, (p + 1) * max_rank), slice(bounds[p], bounds[p + 1]))
            for p in range(len(parts))
        ]
        self.b_blocks = [
            [self.b[slot, inner, outer] for inner, outer in self.blocks] for slot in range(max_loras)
        ]
        # every slot at once, for the dense product (views: a slot written in place is what the graphs read)
        self.a_all = self.a.view(max_loras * width, in_features)
        self.b_all = self.b.view(max_loras * width, self.out_features)

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put an adapter's whole-model ``A`` ``[parts x r, in]`` and ``B`` ``[out, r]`` (``LoRAWeights``) in ``slot``."""
        rank = b.shape[1]
        if self.shard_a is not None:
            a = self.shard_a("weight", a)
        if self.shard_b is not None:
            b = self.shard_b("weight", b)
        assert a.shape == (len(self.parts) * rank, self.in_features) and b.shape == (self.out_features, rank)
        self.clear(slot)
        start = 0
        for part, size in enumerate(self.parts):
            rows = slice(part * self.rank, part * self.rank + rank)
            self.a[slot, rows] = a[part * rank : (part + 1) * rank]
            self.b[slot, rows, start : start + size] = b[start : start + size].t()
            start += size

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the adapters' product of ``x`` ``[rows, in]`` to the base layer's ``out`` ``[rows, out]``, in place."""
        if self.step.static:
            self._dense(x, out)
            return
        for segment in self.step.segments:
            slot = segment.slot
            if segment.rows is not None:
                h = self.kernel(x.index_select(0, segment.rows), self.a[slot], None)
                out.index_add_(0, segment.rows, h.mm(self.b[slot]))
                continue
            start, end = segment.start, segment.end
            h = self.kernel(x[start:end], self.a[slot], None)
            if end - start <= SMALL_ROWS or len(self.parts) == 1:
                out[start:end].addmm_(h, self.b[slot])
                continue
            rows = out[start:end]
            for (inner, outer), block in zip(self.blocks, self.b_blocks[slot]):
                rows[:, outer].addmm_(h[:, inner], block)

    def _dense(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The static step's product: every slot's ``A`` over every row, each row's own slot kept by the mask (a
        row of no adapter keeps none: its output gains exact zeros), then every slot's ``B``."""
        mask = self.step.mask
        assert mask is not None
        rows, slots = x.shape[0], mask.shape[1]
        h = self.kernel(x, self.a_all, None).view(rows, slots, -1)
        h = h * mask[:rows, :, None]
        out.addmm_(h.view(rows, -1), self.b_all)
