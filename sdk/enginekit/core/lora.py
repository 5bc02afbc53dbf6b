"""The engine core's LoRA adapters: which are loaded in host memory, which sit in the device's slots, and the
slot of each row of a step.

``LoRAManager`` keeps up to ``max_cpu_loras`` adapters in host memory, least recently used first (one that live
requests use, or that is pinned, is never dropped; a dropped one is read again from its folder when a request names
it). A step's adapters go into the ``max_loras`` device slots before it runs (``assign_slots``): an adapter already in a
slot stays there; another takes the lowest free slot, else the least recently used slot whose adapter the step does
not use (a pinned one last). The scheduler never runs more than ``max_loras`` adapters at once, so a slot is always
found. Each load of an adapter gets its own ``key``, which seeds its requests' prefix-cache hashes: blocks are never
shared between adapters, nor with an earlier adapter of the same id.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from enginekit.config import EngineConfig
from enginekit.lora_request import LoRARequest
from enginekit.model.config import ModelConfig
from enginekit.model.lora.adapter import load_adapter
from enginekit.model.lora.weights import LoRAWeights

if TYPE_CHECKING:
    from enginekit.core.request import Request
    from enginekit.model.batch import SequenceChunk

logger = logging.getLogger("enginekit.core")


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: its request, its weights in host memory and where it is on the device."""

    request: LoRARequest
    weights: LoRAWeights
    key: int  # seeds the prefix-cache hashes of its requests' blocks: unique to this load
    pinned: bool = False
    slot: int | None = None  # its device slot, if it is in one

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


class LoRAManager:
    """Adapters in host memory and in the device's slots.

    ``load_slot(slot, weights)`` writes an adapter into a device slot (on every tensor-parallel rank);
    ``live()`` yields the adapters of the requests the engine holds.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        load_slot: Callable[[int, LoRAWeights], None],
        live: Callable[[], Iterable[Adapter | None]],
    ) -> None:
        self.model_config = model_config
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.num_cpu_loras
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()  # by lora_int_id, least recently used first
        self.slots: list[Adapter | None] = [None] * config.max_loras
        self._slot_order: OrderedDict[int, None] = OrderedDict()  # filled slots, least recently used first
        self._load_slot = load_slot
        self._live = live
        self._keys = itertools.count(1)
        self.num_slot_loads = 0  # adapters written into a device slot

    # ---- adapters in host memory --------------------------------------------------------------------
    def resolve(self, lora_request: LoRARequest) -> Adapter:
        """The adapter a request names: the loaded one of its id, else read from its folder now. Raises
        ``ValueError`` naming the adapter if it cannot be served."""
        adapter = self.adapters.get(lora_request.lora_int_id)
        if adapter is not None:
            known = adapter.request
            if (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(
                    f"lora_int_id {known.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}) in this "
                    f"engine, not {lora_request.lora_name!r} ({lora_request.lora_path}): give each adapter its own "
                    f"id, or remove_lora({known.lora_int_id}) first"
                )
            self.adapters.move_to_end(known.lora_int_id)
            return adapter
        weights = load_adapter(lora_request, self.model_config, self.max_rank)
        adapter = Adapter(lora_request, weights, next(self._keys))
        self.adapters[lora_request.lora_int_id] = adapter
        self._drop_unused(keep=adapter)
        logger.info(
            "LoRA adapter %r (id %d) loaded from %s: rank %d, %.1f MB",
            lora_request.lora_name,
            lora_request.lora_int_id,
            lora_request.lora_path,
            weights.rank,
            weights.nbytes / 1e6,
        )
        return adapter

    def add(self, lora_request: Any) -> bool:
        """``add_lora``: load the adapter (if not loaded); ``True``."""
        self.resolve(_lora_request(lora_request))
        return True

    def remove(self, lora_int_id: int) -> bool:
        """``remove_lora``: forget the adapter; ``False`` if none has the id. Refused while requests use it."""
        adapter = self.adapters.get(_lora_id(lora_int_id))
        if adapter is None:
            return False
        users = sum(1 for live in self._live() if live is adapter)
        if users:
            raise ValueError(
                f"LoRA adapter {adapter.request.lora_name!r} (lora_int_id {lora_int_id}) is used by {users} "
                "unfinished requests: abort them or let them finish before removing it"
            )
        self._forget(adapter)
        return True

    def pin(self, lora_int_id: int) -> bool:
        """``pin_lora``: never drop the adapter from host memory, and keep it in its device slot while another
        slot can be used instead; ``True``."""
        adapter = self.adapters.get(_lora_id(lora_int_id))
        if adapter is None:
            raise ValueError(f"no LoRA adapter with lora_int_id {lora_int_id} is loaded: add_lora it first")
        pinned = sum(a.pinned for a in self.adapters.values())
        if not adapter.pinned and pinned >= self.max_cpu_loras:
            raise ValueError(
                f"cannot pin LoRA adapter {adapter.request.lora_name!r}: all {self.max_cpu_loras} adapters kept in "
                "host memory (max_cpu_loras) are pinned already"
            )
        adapter.pinned = True
        return True

    def list(self) -> list[int]:
        """``list_loras``: the ids of the adapters loaded in host memory."""
        return sorted(self.adapters)

    def _drop_unused(self, keep: Adapter | None) -> None:
        """Forget the least recently used adapters past ``max_cpu_loras``: never ``keep``, a pinned one, or one
        that live requests use (then the cache holds more for a while)."""
        excess = len(self.adapters) - self.max_cpu_loras
        if excess <= 0:
            return
        used = {id(adapter) for adapter in self._live() if adapter is not None}
        for adapter in list(self.adapters.values()):
            if excess <= 0:
                break
            if adapter is not keep and not adapter.pinned and id(adapter) not in used:
                self._forget(adapter)
                excess -= 1

    def _forget(self, adapter: Adapter) -> None:
        del self.adapters[adapter.lora_int_id]
        if adapter.slot is not None:
            self.slots[adapter.slot] = None
            del self._slot_order[adapter.slot]
            adapter.slot = None

    # ---- adapters in the device's slots -----------------------------------------------------------
    def assign_slots(self, requests: list[Request], chunks: list[SequenceChunk]) -> None:
        """Put every adapter a step uses in a device slot, and give each chunk its adapter's slot (``requests[i]``
        owns ``chunks[i]``; a chunk of the base model keeps ``-1``)."""
        needed = {request.lora for request in requests if request.lora is not None}
        if not needed:
            return
        if len(self.adapters) > self.max_cpu_loras:  # held past the bound while requests used them
            self._drop_unused(keep=None)
        for adapter in needed:
            self._place(adapter, needed)
        for request, chunk in zip(requests, chunks):
            if request.lora is not None:
                assert request.lora.slot is not None  # placed just now
                chunk.lora_slot = request.lora.slot

    def _place(self, adapter: Adapter, needed: set[Adapter]) -> None:
        if adapter.slot is not None:
            self._slot_order.move_to_end(adapter.slot)
            return
        slot = next((index for index, held in enumerate(self.slots) if held is None), None)
        if slot is None:
            movable = [s for s in self._slot_order if self.slots[s] not in needed]
            assert movable, "the scheduler ran more adapters than max_loras"
            slot = next((s for s in movable if not self.slots[s].pinned), movable[0])  # pyright: ignore[reportOptionalMemberAccess]
            evicted = self.slots[slot]
            assert evicted is not None
            evicted.slot = None
            del self._slot_order[slot]
        self._load_slot(slot, adapter.weights)
        self.num_slot_loads += 1
        adapter.slot = slot
        self.slots[slot] = adapter
        self._slot_order[slot] = None

    def stats(self) -> dict[str, Any]:
        return {
            "lora_adapters_loaded": len(self.adapters),
            "lora_adapters_in_slots": sum(held is not None for held in self.slots),
            "lora_slot_loads": self.num_slot_loads,
        }


def adapter_order(item: tuple[Request, int]) -> int:
    """A scheduled request's place when a step's requests are grouped by adapter (the base model's first)."""
    adapter = item[0].lora
    return adapter.key if adapter is not None else 0


def _lora_request(value: Any) -> LoRARequest:
    """A ``LoRARequest`` from a utility argument (as sent over the wire: its fields, in order)."""
    if isinstance(value, LoRARequest):
        return value
    try:
        return msgspec.convert(value, LoRARequest)
    except msgspec.ValidationError as error:
        raise ValueError(
            f"add_lora takes a LoRARequest(lora_name, lora_int_id, lora_path): {error}"
        ) from None


def _lora_id(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"lora_int_id must be an integer, got {value!r}")
    return value
