"""LoRA on a loaded model: its projections given adapter slots once (through their ``lora`` hook), adapters written
into slots, and each step's rows set before the forward pass.

The runner owns one ``LoRAModel`` when the engine runs with ``enable_lora``. The projections it adapts are the
decoder layers' fused q/k/v, o, gate/up and down (``adapter.PROJECTIONS``), whatever holds their weight (a float
tensor, a GGUF weight kept as stored, a tensor-parallel slice): the adapters' product is added to the base layer's
output, so the base weights are never changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from enginekit.config import EngineConfig
from enginekit.model.decoder import Decoder
from enginekit.model.layers.linear import Linear
from enginekit.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from enginekit.model.lora.slots import LoRASlots, LoRAStep
from enginekit.model.lora.weights import PROJECTIONS, LoRAWeights, module_shapes


class LoRASpec(NamedTuple):
    """The adapter pool's shape: ``max_loras`` slots of rank up to ``max_rank``."""

    max_loras: int
    max_rank: int


def lora_spec(config: EngineConfig) -> LoRASpec | None:
    """The pool an engine with ``config`` runs (``None``: LoRA is off)."""
    return LoRASpec(config.max_loras, config.max_lora_rank) if config.enable_lora else None


class LoRAModel:
    """The adapter slots of every adapted projection of ``decoder``, and the step they compute."""

    def __init__(self, decoder: Decoder, spec: LoRASpec, device: torch.device, dtype: torch.dtype) -> None:
        self.decoder = decoder
        self.spec = spec
        self.device, self.dtype = device, dtype
        self.step = LoRAStep()
        shapes = module_shapes(decoder.config)
        self.layers: list[dict[str, LoRASlots]] = []
        for layer in decoder.layers:
            adapted = {}
            for projection, parts in PROJECTIONS.items():
                linear = layer.get_submodule(projection)
                assert isinstance(linear, Linear)
                adapted[projection] = linear.lora = self._slots(linear, [shapes[p][0] for p in parts])
            self.layers.append(adapted)

    def _slots(self, linear: Linear, parts: list[int]) -> LoRASlots:
        ranks = self.decoder.tensor_parallel_size
        column = linear.shard if isinstance(linear, ColumnParallelLinear) else None
        row = linear.shard if isinstance(linear, RowParallelLinear) else None
        return LoRASlots(
            linear.in_features,
            [part // ranks for part in parts] if column is not None else parts,
            max_loras=self.spec.max_loras,
            max_rank=self.spec.max_rank,
            step=self.step,
            device=self.device,
            dtype=self.dtype,
            shard_a=row,  # as the base layers split: a row-parallel layer by its input
            shard_b=column,  # a column-parallel one by its output
            kernel=linear.kernel,
        )

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Write ``weights`` into ``slot`` of every adapted projection (zeros where the adapter has none)."""
        assert 0 <= slot < self.spec.max_loras and weights.rank <= self.spec.max_rank
        for adapted, touched in zip(self.layers, weights.layers):
            for projection, slots in adapted.items():
                if projection in touched:
                    a, b = touched[projection]
                    slots.write(slot, a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                else:
                    slots.clear(slot)

    def begin_step(
        self, chunk_slots: list[int] | None, counts: Iterable[int], *, static: bool = False
    ) -> None:
        """The step's rows: each chunk's slot (``-1`` for none; ``None``: no adapter in the step) and its token
        count, in the order of the step's inputs. ``static``: a step replayed from (or captured into) a CUDA graph,
        where every projection runs the dense product over all the slots, masked per row on the device, whether or
        not a row uses an adapter (``allow_static`` first). The fused native layers run no adapter, so a step with
        adapters runs the layers piece by piece."""
        if static:
            self.step.begin_static(chunk_slots, counts)
        else:
            self.step.begin(chunk_slots, counts, self.device)
        self.decoder.lora_active = self.step.active

    def allow_static(self, max_rows: int) -> None:
        """Let steps of up to ``max_rows`` rows run with fixed shapes (``begin_step(static=True)``): the graphs."""
        self.step.allow_static(max_rows, self.spec.max_loras, self.device, self.dtype)

    def release(self) -> None:
        for layer in self.decoder.layers:
            for projection in PROJECTIONS:
                linear = layer.get_submodule(projection)
                assert isinstance(linear, Linear)
                linear.lora = None
        self.layers = []
