"""The coordinator's rank table, kept where a coordinator restart does not lose it.

The coordinator is state only, and Serve restarts it with nothing: before, a restarted
coordinator handed rank 0 to the next engine replica that asked while the engine
already holding rank 0 had not yet re-registered (it does at its next health check), so
two engines served as rank 0; and it waited for data_parallel_size engines before
listing any, though fewer may be alive. So which replica owns which rank, and the
membership version, are written to Ray's GCS key-value store (the store Serve keeps its
own checkpoints in), under the application's name; a new coordinator starts from them.
The engines' addresses are kept too, so a restarted coordinator can tell an owner that
died meanwhile (its port refuses connections) from one that has not re-registered yet;
their keys are not stored: they come back as each live engine re-registers.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)
NAMESPACE = "flotilla"


@dataclass
class RankTable:
    owner: dict[int, str] = field(default_factory=dict)  # rank -> replica id
    version: int = 0
    # rank -> its engine's address, once registered: a restarted coordinator frees the
    # rank of an owner whose port no longer takes connections (it died meanwhile)
    address: dict[int, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({"owner": self.owner, "version": self.version,
                           "address": self.address}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "RankTable":
        data = json.loads(raw)
        return cls({int(r): o for r, o in data["owner"].items()}, int(data["version"]),
                   {int(r): a for r, a in data.get("address", {}).items()})


class RankStore:
    """Reads and writes one application's RankTable in the GCS key-value store."""

    def __init__(self, app_name: str) -> None:
        self.key = f"ranks/{app_name}".encode()

    def load(self) -> RankTable | None:
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(self.key, namespace=NAMESPACE)
        return RankTable.decode(raw) if raw else None

    def save(self, table: RankTable) -> None:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(self.key, table.encode(), overwrite=True, namespace=NAMESPACE)

    def delete(self) -> None:
        """The application is going away (a graceful stop): its next deploy starts clean."""
        from ray.experimental.internal_kv import _internal_kv_del
        _internal_kv_del(self.key, namespace=NAMESPACE)

