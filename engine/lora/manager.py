"""Which adapters the engine knows, which sit in device slots, and the CPU cache.

LoRAManager runs in the engine core (rank 0). It keeps the adapters added by name
(add_lora, lora_modules) and assigns device slots: before a step, every adapter of
the step's requests gets a slot, the least recently used adapter outside the step
giving up its slot when none is free. The scheduler never puts more than max_loras
adapters in one step, so a slot can always be found. AdapterCache is each rank's host
copy of the adapters it read (max_cpu_loras, least recently used dropped first), so
moving an adapter back into a slot does not read the disk again.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from engine.errors import InvalidRequestError
from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest


class AdapterCache:
    """Adapters in host memory, by id, least recently used first out."""

    def __init__(self, capacity: int, load: Callable[[LoRARequest], LoRAAdapter]) -> None:
        self.capacity = capacity
        self._load = load
        self._cache: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        entry = self._cache.get(request.lora_int_id)
        if entry is not None and entry[0] == request:
            self._cache.move_to_end(request.lora_int_id)
            return entry[1]
        adapter = self._load(request)
        self._cache[request.lora_int_id] = (request, adapter)
        self._cache.move_to_end(request.lora_int_id)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return adapter

    def drop(self, lora_id: int) -> None:
        self._cache.pop(lora_id, None)

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._cache


class LoRAManager:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.registered: dict[str, LoRARequest] = {}  # by name: add_lora / lora_modules
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # id -> slot, LRU first
        self._free = list(range(max_loras))
        self._resident: dict[int, LoRARequest] = {}  # what each slotted id holds

    def register(self, request: LoRARequest) -> None:
        known = self.registered.get(request.lora_name)
        if known is not None and known != request:
            raise InvalidRequestError(f"an adapter named {request.lora_name!r} is already "
                                      "loaded with another id or path")
        clash = next((r for r in self.registered.values()
                      if r.lora_int_id == request.lora_int_id and r != request), None)
        if clash is not None:
            raise InvalidRequestError(f"adapter id {request.lora_int_id} is already used by "
                                      f"{clash.lora_name!r}")
        self.registered[request.lora_name] = request

    def unregister(self, lora_id: int) -> bool:
        """Forget an adapter; its slot frees once no step uses it. False if unknown."""
        name = next((n for n, r in self.registered.items() if r.lora_int_id == lora_id), None)
        if name is None:
            return False
        del self.registered[name]
        return True

    def release(self, lora_id: int) -> None:
        """Give the adapter's slot back (it was removed and nothing runs with it)."""
        slot = self._slot_of.pop(lora_id, None)
        self._resident.pop(lora_id, None)
        if slot is not None:
            self._free.append(slot)

    def assign(self, adapters: dict[int, LoRARequest]) -> tuple[dict[int, int],
                                                                list[tuple[int, LoRARequest]]]:
        """Slots for this step's adapters (at most max_loras): id -> slot, and the
        (slot, adapter) pairs that must be loaded first."""
        to_load: list[tuple[int, LoRARequest]] = []
        slots: dict[int, int] = {}
        for lora_id, request in adapters.items():
            slot = self._slot_of.get(lora_id)
            if slot is None:
                slot = self._take_slot(set(adapters))
                self._slot_of[lora_id] = slot
            if self._resident.get(lora_id) != request:  # not there, or an older version
                to_load.append((slot, request))
                self._resident[lora_id] = request
            self._slot_of.move_to_end(lora_id)
            slots[lora_id] = slot
        return slots, to_load

    def _take_slot(self, in_step: set[int]) -> int:
        if self._free:
            return self._free.pop(0)
        victim = next(i for i in self._slot_of if i not in in_step)  # LRU outside the step
        self._resident.pop(victim, None)
        return self._slot_of.pop(victim)

    def resident(self) -> list[int]:
        return list(self._slot_of)
