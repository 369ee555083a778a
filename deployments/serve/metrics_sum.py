"""Request metrics summed over the ingress replicas, so that no scrape goes backwards.

A Prometheus scrape of the Serve port lands on one ingress replica, and each replica
counts only its own requests: with several replicas, successive scrapes would read
different replicas' counters and see them fall. So every replica reports a snapshot of
its request counters and histograms (when it is scraped, and every few seconds) to
the coordinator, which keeps the latest counts of every replica it ever heard from
and answers with their sum. A replica that went away (downscaled, dead) keeps its last
counts in the sum; a report that arrives late (Ray does not order calls) cannot lower
a replica's counts, since each sample keeps the largest value reported (they only
grow).

Only counters and histograms are summed; the engine gauges are the same from every
replica and are served as each replica reads them.

A snapshot is plain data (it crosses Ray calls): a list of families
[name, documentation, type, [[sample name, labels, value], ...]].
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Snapshot = list[list[Any]]
SampleKey = tuple[str, tuple]


def _samples(snapshot: Snapshot, family_of: dict[SampleKey, str],
             families: dict[str, tuple[str, str]]) -> Iterator[tuple[SampleKey, float]]:
    """(sample key, value) of every sample, noting each family and each sample's family."""
    for name, doc, typ, samples in snapshot:
        families.setdefault(name, (doc, typ))
        for sample_name, labels, value in samples:
            key = sample_name, tuple(sorted(labels.items()))
            family_of.setdefault(key, name)
            yield key, value


class MetricsSum:
    """The coordinator's side: the counts of each replica, and their sum."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[SampleKey, float]] = {}  # replica -> sample -> value
        self._families: dict[str, tuple[str, str]] = {}  # name -> (documentation, type)
        self._family_of: dict[SampleKey, str] = {}  # sample key -> family name

    def report(self, replica_id: str, snapshot: Snapshot) -> Snapshot:
        """Take a replica's snapshot; return the sum over every replica."""
        counts = self._counts.setdefault(replica_id, {})
        for key, value in _samples(snapshot, self._family_of, self._families):
            counts[key] = max(counts.get(key, value), value)
        return self.total()

    def total(self) -> Snapshot:
        summed: dict[SampleKey, float] = {}
        for counts in self._counts.values():
            for key, value in counts.items():
                summed[key] = summed.get(key, 0.0) + value
        return families_of(summed, self._family_of, self._families)


def families_of(values: dict[SampleKey, float], family_of: dict[SampleKey, str],
                families: dict[str, tuple[str, str]]) -> Snapshot:
    grouped: dict[str, list[list[Any]]] = {}
    for key, value in values.items():
        sample_name, labels = key
        grouped.setdefault(family_of[key], []).append([sample_name, dict(labels), value])
    return [[name, *families[name], samples] for name, samples in grouped.items()]


def at_least(summed: Snapshot, own: Snapshot) -> Snapshot:
    """Each sample of `summed`, raised to `own`'s where that is larger: what a replica
    serves when the coordinator does not answer (its last sum, plus what it counted
    since), so that its scrapes do not fall back to its own counts alone."""
    values: dict[SampleKey, float] = {}
    family_of: dict[SampleKey, str] = {}
    families: dict[str, tuple[str, str]] = {}
    for key, value in _samples(summed + own, family_of, families):
        values[key] = max(values.get(key, value), value)
    return families_of(values, family_of, families)


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
