"""The device side of LoRA: every adapted projection's fixed pool of adapter slots, and the batched product of a
step whose rows use several adapters (and none).

Each adapted projection holds ``max_loras`` slots of ``A`` (``[parts x max_rank, in]``) and ``B``
(``[max_rank, out]``), zero where an adapter is smaller or absent. A step's rows each name a slot (or none); the
product runs over the span of slots the step uses, for all its rows at once, in a fixed number of calls whatever the
number of adapters and requests:

1. shrink: ``h = x @ A[first:last]^T``, ``[rows, slots x parts x rank]`` (one product);
2. mask: each row keeps only its own slot's columns of ``h`` (one multiply by a ``[rows, slots]`` 0/1 mask, built
   once per step and shared by every layer; skipped when every row uses the one slot);
3. expand: ``out[:, part] += h_part @ B[first:last, :, part]`` (one product per fused part: q/k/v, gate/up).

A row of another slot or of none adds exact zeros, so the base model's rows are the base model's. The span's cost
grows with the slots it covers; the pool hands out the lowest free slot first, so a step's adapters sit close.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.nn import functional as F

Shard = Callable[[str, torch.Tensor], torch.Tensor]


class LoRAStep:
    """Which slots this step's rows use, shared by every adapted projection of one model; set once per step."""

    __slots__ = ("active", "count", "first", "mask")

    def __init__(self) -> None:
        self.active = False  # some row uses an adapter
        self.first = 0  # the span of slots the rows use: [first, first + count)
        self.count = 0
        self.mask: torch.Tensor | None = None  # [rows, count, 1]: 1 where the row uses that slot

    def begin(self, row_slots: list[int] | None, device: torch.device, dtype: torch.dtype) -> None:
        """Set the step's rows: each row's slot, ``-1`` for none (``None``: no row uses an adapter)."""
        used = set(row_slots) if row_slots else set()
        used.discard(-1)
        if not used:
            self.active, self.mask = False, None
            return
        assert row_slots is not None
        first, last = min(used), max(used)
        self.first, self.count, self.active = first, last - first + 1, True
        if first == last and -1 not in row_slots:
            self.mask = None  # every row: the one slot
            return
        rows = torch.tensor(row_slots, device=device)
        span = torch.arange(first, last + 1, device=device)
        self.mask = (rows[:, None] == span[None, :]).to(dtype).unsqueeze(-1)


class LoRASlots:
    """One projection's adapter slots (this tensor-parallel rank's slice) and its batched product.

    ``parts``: the output features of each fused part on this rank (q, k, v; gate, up; or the one part).
    ``shard_a`` / ``shard_b``: a row-parallel layer splits ``A`` by its input, a column-parallel one ``B`` by its
    output, as the base layer's weight is split (its own ``shard``); ``None`` keeps it whole.
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
    ) -> None:
        self.step = step
        self.rank = max_rank
        self.parts = parts
        self.width = len(parts) * max_rank  # columns of h per slot
        self.in_features = in_features
        self.out_features = sum(parts)
        self.part_bounds = list(itertools.pairwise(itertools.accumulate(parts, initial=0)))
        self.a = torch.zeros((max_loras, self.width, in_features), device=device, dtype=dtype)
        self.b = torch.zeros((max_loras, max_rank, self.out_features), device=device, dtype=dtype)
        self.shard_a, self.shard_b = shard_a, shard_b

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put an adapter's whole-model ``A`` ``[parts x r, in]`` and ``B`` ``[out, r]`` (``LoRAWeights``) in ``slot``."""
        rank = b.shape[1]
        if self.shard_a is not None:
            a = self.shard_a("weight", a)
        if self.shard_b is not None:
            b = self.shard_b("weight", b)
        assert a.shape == (len(self.parts) * rank, self.in_features) and b.shape == (self.out_features, rank)
        self.clear(slot)
        for part in range(len(self.parts)):
            self.a[slot, part * self.rank : part * self.rank + rank] = a[part * rank : (part + 1) * rank]
        self.b[slot, :rank] = b.t()

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the adapters' product of ``x`` ``[rows, in]`` to the base layer's ``out`` ``[rows, out]``, in place."""
        step = self.step
        if not step.active:
            return
        first, count, rows = step.first, step.count, x.shape[0]
        a = self.a[first : first + count].view(count * self.width, self.in_features)
        h = F.linear(x.to(a.dtype), a)  # [rows, slots x parts x rank]
        if step.mask is not None:
            h.view(rows, count, self.width).mul_(step.mask)
        b = self.b[first : first + count].view(count * self.rank, self.out_features)
        if len(self.parts) == 1:
            out.addmm_(h, b)
            return
        per_part = h.view(rows, count, len(self.parts), self.rank)
        for part, (start, end) in enumerate(self.part_bounds):
            out[:, start:end].addmm_(per_part[:, :, part].reshape(rows, count * self.rank), b[:, start:end])
