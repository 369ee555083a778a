"""The ingress's view of the LoRA adapters: which `model` names are adapters.

Adapters live in the engines (lora_modules at start, /v1/load_lora_adapter at run
time). An ingress keeps the names it has seen and asks the engines again when a
request names one it does not know, so every ingress replica learns of an adapter
another one loaded, without a shared store.
"""
from __future__ import annotations

import asyncio

from engine.lora.request import LoRARequest, adapter_id


class AdapterDirectory:
    def __init__(self, control) -> None:
        """control: what reaches the engines (list_loras / add_lora / remove_lora)."""
        self.control = control
        self._by_name: dict[str, LoRARequest] = {}
        self._lock = asyncio.Lock()

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter called `name`, or None if the engines hold none by that name."""
        found = self._by_name.get(name)
        if found is None:
            await self.refresh()
            found = self._by_name.get(name)
        return found

    def cached(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name else None

    async def refresh(self) -> list[LoRARequest]:
        async with self._lock:
            adapters = await self.control.list_loras()
            self._by_name = {a.lora_name: a for a in adapters}
            return adapters

    async def load(self, name: str, path: str) -> LoRARequest:
        """Load an adapter on every engine; raises ValueError if the name is taken."""
        if await self.resolve(name) is not None:
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
