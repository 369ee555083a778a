"""The ingress's view of the LoRA adapters: which `model` names are adapters.

Adapters live in the engines (lora_modules at start, /v1/load_lora_adapter at run
time). An ingress keeps the names it has seen and asks the engines again when a
request names one it does not know, so every ingress replica learns of an adapter
another one loaded, without a shared store.
"""
from __future__ import annotations

import asyncio
import math
import time

from engine.lora.request import LoRARequest, adapter_id

MAX_AGE_S = 5.0  # how stale this replica's adapter list may be


class AdapterDirectory:
    def __init__(self, control, max_age_s: float = MAX_AGE_S) -> None:
        """control: what reaches the engines (list_loras / add_lora / remove_lora)."""
        self.control = control
        self.max_age_s = max_age_s
        self._by_name: dict[str, LoRARequest] = {}
        self._fetched = -math.inf
        self._lock = asyncio.Lock()

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter called `name`, or None if the engines hold none by that name.
        What this replica knows is asked again when it is older than max_age_s, so an
        adapter another replica unloaded stops being served here within that time."""
        found = self._by_name.get(name)
        if found is None or time.monotonic() - self._fetched > self.max_age_s:
            await self.refresh()
            found = self._by_name.get(name)
        return found

    async def refresh(self) -> list[LoRARequest]:
        async with self._lock:
            adapters = await self.control.list_loras()
            self._by_name = {a.lora_name: a for a in adapters}
            self._fetched = time.monotonic()
            return adapters

    async def load(self, name: str, path: str) -> LoRARequest:
        """Load an adapter on every engine; raises ValueError if the name is taken."""
        if await self.resolve(name) is not None:  # on every engine already
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
        lora = LoRARequest(name, adapter_id(name), path)
        await self.control.add_lora(lora)
        self._by_name[name] = lora
        return lora

    async def unload(self, name: str) -> bool:
        """Unload by name everywhere (requests running with it finish); False if unknown."""
        lora = await self.resolve(name)
        if lora is None:
            return False
        await self.control.remove_lora(lora.lora_int_id)
        self._by_name.pop(name, None)
        return True
