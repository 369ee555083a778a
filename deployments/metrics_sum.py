"""Request metrics summed over the ingress replicas, so that no scrape goes backwards.

A Prometheus scrape of the Serve port lands on one ingress replica, and each replica
counts only its own requests: with several replicas, successive scrapes would read
different replicas' counters and see them fall. So every replica reports a snapshot of
its request counters and histograms (when it is scraped, and every few seconds) to
the coordinator, which keeps the latest snapshot per replica and answers with the sum.
A replica that stops reporting (removed by downscaling, dead) is folded into a retired
base after RETIRE_AFTER_S: what it counted stays in the totals.

Only counters and histograms are summed (both only grow); the engine gauges are the
same from every replica and are served as each replica reads them.

A snapshot is plain data (it crosses Ray calls): a list of families
[name, documentation, type, [[sample name, labels, value], ...]].
"""
from __future__ import annotations

import time
from typing import Any

Snapshot = list[list[Any]]
RETIRE_AFTER_S = 60.0  # a replica silent this long has gone; its counts move to the base


def _key(sample_name: str, labels: dict[str, str]) -> tuple[str, tuple]:
    return sample_name, tuple(sorted(labels.items()))


class MetricsSum:
    """The coordinator's side: the latest snapshot of each replica, and their sum."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[str, tuple[float, Snapshot]] = {}  # replica -> (seen, snapshot)
        self._retired: dict[tuple[str, tuple], float] = {}  # counts of replicas gone
        self._families: dict[str, tuple[str, str]] = {}  # name -> (documentation, type)
        self._family_of: dict[tuple[str, tuple], str] = {}  # sample key -> family name

    def report(self, replica_id: str, snapshot: Snapshot) -> Snapshot:
        """Take a replica's latest snapshot; return the sum over every replica."""
        now = self._clock()
        self._latest[replica_id] = (now, snapshot)
        for other, (seen, old) in list(self._latest.items()):
            if now - seen > RETIRE_AFTER_S:
                self._add(self._retired, old)
                del self._latest[other]
        total = dict(self._retired)
        for _, snap in self._latest.values():
            self._add(total, snap)
        return self._families_of(total)

    def _add(self, into: dict[tuple[str, tuple], float], snapshot: Snapshot) -> None:
        for name, doc, typ, samples in snapshot:
            self._families.setdefault(name, (doc, typ))
            for sample_name, labels, value in samples:
                key = _key(sample_name, labels)
                self._family_of.setdefault(key, name)
                into[key] = into.get(key, 0.0) + value

    def _families_of(self, total: dict[tuple[str, tuple], float]) -> Snapshot:
        grouped: dict[str, list[list[Any]]] = {}
        for key, value in total.items():
            sample_name, labels = key
            grouped.setdefault(self._family_of[key], []).append(
                [sample_name, dict(labels), value])
        return [[name, *self._families[name], samples] for name, samples in grouped.items()]


def snapshot_of(registry) -> Snapshot:
    """A prometheus_client registry's counters and histograms as a Snapshot (the
    *_created timestamps left out: they do not add up)."""
    out: Snapshot = []
    for family in registry.collect():
        if family.type not in ("counter", "histogram"):
            continue
        samples = [[s.name, dict(s.labels), s.value] for s in family.samples
                   if not s.name.endswith("_created")]
        out.append([family.name, family.documentation, family.type, samples])
    return out


class SnapshotCollector:
    """Serves a Snapshot (the summed one) through a prometheus_client registry."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self):
        from prometheus_client.metrics_core import Metric
        for name, doc, typ, samples in self.snapshot:
            family = Metric(name, doc, typ)
            for sample_name, labels, value in samples:
                family.add_sample(sample_name, labels, value)
            yield family
