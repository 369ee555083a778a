"""LoRARequest: which adapter a request runs with (vLLM's names and order)."""
from __future__ import annotations

import hashlib

import msgspec

from engine.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter by name, a positive integer id that is its identity inside the engines
    (slots, prefix-cache keys), and the folder holding it (PEFT format)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name or self.lora_int_id < 1 or not self.lora_path:
            raise InvalidRequestError("a LoRARequest needs a name, an id >= 1 and a path")


def adapter_id(name: str) -> int:
    """The id an adapter loaded by name gets (lora_modules, /v1/load_lora_adapter): the
    same on every engine and ingress replica without asking anyone. 63 bits of BLAKE2b:
    a name that takes another adapter's id would need a second preimage (CRC32's were
    crafted at will: "plumless" and "buckeroo" share one); engines still refuse an id
    that stands for another name."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**63 - 1) + 1
