"""The engine core's LoRA side (a mixin of EngineCore): checking an adapter before its
requests queue, giving a step's adapters device slots, and the add / remove / list
utilities. It reads the core's lora manager, runner, requests and scheduler."""
from __future__ import annotations

import msgspec

from engine.core_messages import EngineCoreOutput
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.lora.roots import path_within


class EngineLoRA:
    def _check_lora(self, lora: LoRARequest) -> None:
        """Refuse an adapter this engine cannot serve: LoRA off, an id or name that
        stands for another adapter (by name, or in a request still running), or files
        that do not read (read now, off the step, once per adapter)."""
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with "
                                      "enable_lora)")
        known = self.lora.registered.get(lora.lora_name)
        if known is not None and known != lora:
            raise InvalidRequestError(f"adapter {lora.lora_name!r} is loaded with another id "
                                      "or path")
        clash = next((other for other in self._adapters_in_use()
                      if other.lora_int_id == lora.lora_int_id and other != lora), None)
        if clash is not None:
            raise InvalidRequestError(
                f"adapter id {lora.lora_int_id} already stands for {clash.lora_name!r} at "
                f"{clash.lora_path!r}; give this adapter another id")
        if lora not in self._checked_loras:
            if self._lora_roots is not None and not path_within(lora.lora_path,
                                                                self._lora_roots):
                raise InvalidRequestError(
                    f"adapter {lora.lora_name!r}: its path is outside the folders this engine "
                    "loads adapters from (allowed_lora_roots)")
            self.runner.check_lora(lora)  # raises LoRAError
            self._checked_loras.add(lora)

    def _adapters_in_use(self):
        yield from self.lora.registered.values()
        for r in self.requests.values():
            if r.lora is not None:
                yield r.lora

    def _place_adapters(self, sched) -> list[EngineCoreOutput]:
        """Give the step's adapters device slots, loading those not resident. An adapter
        that can no longer be read (its folder gone since it was checked) fails its
        requests, which leave this step; the others go on."""
        requests = sched.requests
        adapters = {r.lora.lora_int_id: r.lora for r in requests if r.lora is not None}
        if not adapters:
            return []
        slots, to_load = self.lora.assign(adapters)
        broken: dict[int, str] = {}
        for slot, lora in to_load:
            try:
                self.runner.load_lora(slot, lora)
            except Exception as exc:  # noqa: BLE001 - fails this adapter's requests only
                self.lora.release(lora.lora_int_id)
                broken[lora.lora_int_id] = f"LoRA adapter {lora.lora_name!r}: {exc}"
        failed: list[EngineCoreOutput] = []
        keep = []
        for r, n in zip(requests, sched.num_new_tokens):
            if r.lora is not None and r.lora.lora_int_id in broken:
                failed.append(self._fail(r, broken[r.lora.lora_int_id]))
                continue
            if r.lora is not None:
                r.lora_slot = slots[r.lora.lora_int_id]
            keep.append((r, n))
        if failed:
            sched.requests = [r for r, _ in keep]
            sched.num_new_tokens = [n for _, n in keep]
        return failed

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter by name (requests may then name it); raises if it cannot be
        served. Loading the same adapter again is a no-op."""
        if not isinstance(lora_request, LoRARequest):  # a utility call's decoded argument
            lora_request = msgspec.convert(lora_request, LoRARequest)
        self._check_lora(lora_request)
        self.lora.register(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter. Requests already running with it finish. Its slot and host
        copy are freed now when no request uses it, else they go as any other adapter's
        do (least recently used). False if no adapter has that id."""
        if self.lora is None or not self.lora.unregister(lora_id):
            return False
        self._checked_loras = {r for r in self._checked_loras if r.lora_int_id != lora_id}
        if not any(r.lora is not None and r.lora.lora_int_id == lora_id
                   for r in self.requests.values()):
            self.lora.release(lora_id)
            self.runner.drop_lora(lora_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded by name, by id."""
        return [] if self.lora is None else sorted(self.lora.registered.values(),
                                                   key=lambda r: r.lora_int_id)
