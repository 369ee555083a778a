"""Request metrics summed over the ingress replicas, so that scrapes do not go backwards.

A Prometheus scrape of the Serve port lands on one ingress replica, and each replica
counts only its own requests: with several replicas, successive scrapes would read
different replicas' counters and see them fall. So every replica reports a snapshot of
its request counters and histograms (when it is scraped, and every second) to
the coordinator, which keeps the latest counts of every replica it hears from and
answers with their sum. A replica that went away (downscaled, dead) keeps its last
counts in the sum; a report that arrives late (Ray does not order calls) cannot lower
a replica's counts, since each sample keeps the largest value reported (they only
grow).

Only counters and histograms are summed; the engine gauges are the same from every
replica and are served as each replica reads them.

Replicas come and go (autoscaling, restarts), and each one's counts used to be kept
forever. A replica that stopped reporting for SILENT_AFTER_S is a candidate; if Serve's
controller no longer lists it (ReplicaSweep), its counter and histogram values are
folded into a "retired" total and its entry dropped: the sum keeps its counts (so no
scrape goes backwards) in memory bounded by the label sets, not by the replicas ever
seen. Its id is remembered (a bounded list), and a late report from it is ignored:
counted again on top of the folded values, it would count twice. Silence is measured on
the coordinator's listening time (wall time between any two reports, a long gap counted
as DEAF_GAP_S): a coordinator that was stopped or stalled hears nobody, and must not
take every replica for gone when it resumes. A replica that only paused (a slow event
loop, reports that timed out) reports again before SILENT_AFTER_S, and its cumulative
counts replace its last ones as before: never added twice.

A snapshot is plain data (it crosses Ray calls): a list of families
[name, documentation, type, [[sample name, labels, value], ...]].
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

Snapshot = list[list[Any]]
SampleKey = tuple[str, tuple]
SUMMED_TYPES = ("counter", "histogram")  # what a snapshot carries (they add up)
# the ingress replicas report every METRICS_PUSH_S (1 s, deployments/serve/ingress.py) and
# at each scrape: a replica silent this long is asked about (ReplicaSweep)
SILENT_AFTER_S = 60.0
DEAF_GAP_S = 15.0  # a gap between reports longer than this counts as this (see above)
# a silent replica is forgotten without Serve's word after this long (Serve's controller
# not answering, or its API changed: memory stays bounded either way)
FORGET_AFTER_S = 3600.0
RETIRED_IDS_KEPT = 10_000  # retired replica ids remembered, so that late reports are ignored
SWEEP_EVERY_S = 30.0  # Serve is asked at most this often
SERVE_QUERY_TIMEOUT_S = 5.0


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
    """The coordinator's side: the counts of each replica, the folded counts of the
    replicas gone, and their sum. clock: seconds, monotonic (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._counts: dict[str, dict[SampleKey, float]] = {}  # replica -> sample -> value
        self._families: dict[str, tuple[str, str]] = {}  # name -> (documentation, type)
        self._family_of: dict[SampleKey, str] = {}  # sample key -> family name
        self._retired: dict[SampleKey, float] = {}  # the gone replicas' counts, summed
        self._retired_ids: set[str] = set()
        self._retired_order: deque[str] = deque()  # oldest first, RETIRED_IDS_KEPT at most
        self._clock = clock
        self._last_heard = clock()
        self._listened = 0.0  # the listening time (module docstring) at the last report
        self._seen: dict[str, float] = {}  # replica -> listening time of its last report

    def report(self, replica_id: str, snapshot: Snapshot) -> Snapshot:
        """Take a replica's snapshot; return the sum over every replica. A retired
        replica's snapshot is left out (its folded counts are in the sum already)."""
        now = self._clock()
        self._listened += min(max(now - self._last_heard, 0.0), DEAF_GAP_S)
        self._last_heard = now
        if replica_id in self._retired_ids:
            logger.warning("metrics: a report from retired ingress replica %s ignored",
                           replica_id)
            return self.total()
        self._seen[replica_id] = self._listened
        counts = self._counts.setdefault(replica_id, {})
        for key, value in _samples(snapshot, self._family_of, self._families):
            counts[key] = max(counts.get(key, value), value)
        return self.total()

    def silent(self, after_s: float = SILENT_AFTER_S) -> list[str]:
        """The replicas that have not reported for after_s of listening time."""
        return [r for r, seen in self._seen.items() if self._listened - seen > after_s]

    def retire(self, replica_ids: Iterable[str]) -> None:
        """Forget these replicas: their counts (counters and histograms, all a snapshot
        holds) stay in the sum, folded into the retired total."""
        for replica_id in replica_ids:
            counts = self._counts.pop(replica_id, None)
            self._seen.pop(replica_id, None)
            if counts is None:
                continue
            for key, value in counts.items():
                self._retired[key] = self._retired.get(key, 0.0) + value
            self._retired_ids.add(replica_id)
            self._retired_order.append(replica_id)
            while len(self._retired_order) > RETIRED_IDS_KEPT:
                self._retired_ids.discard(self._retired_order.popleft())
            logger.info("metrics: ingress replica %s is gone; its counts stay in the sum",
                        replica_id)

    @property
    def replicas(self) -> list[str]:
        """The replicas whose counts are kept one by one."""
        return list(self._counts)

    def total(self) -> Snapshot:
        summed: dict[SampleKey, float] = dict(self._retired)
        for counts in self._counts.values():
            for key, value in counts.items():
                summed[key] = summed.get(key, 0.0) + value
        return families_of(summed, self._family_of, self._families)


class ReplicaSweep:
    """Retires the silent replicas that Serve no longer runs (MetricsSum.retire).

    running: returns the replica ids Serve runs (a blocking call: it runs on a thread,
    one at a time, waited for SERVE_QUERY_TIMEOUT_S at most); when it fails or does not
    answer, the silent replicas are kept, unless silent for FORGET_AFTER_S."""

    def __init__(self, hub: MetricsSum, running: Callable[[], set[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hub, self.running, self._clock = hub, running, clock
        self._swept = -SWEEP_EVERY_S
        self._task: asyncio.Future | None = None
        self._query: asyncio.Future | None = None  # the thread asking Serve

    def poke(self) -> None:
        """After a report: start a sweep if one is due and there are silent replicas."""
        if self._task is not None and not self._task.done():
            return
        if self._clock() - self._swept < SWEEP_EVERY_S or not self.hub.silent():
            return
        self._swept = self._clock()
        self._task = asyncio.ensure_future(self.sweep())

    async def sweep(self) -> None:
        if not self.hub.silent():
            return
        if self._query is None or self._query.done():  # never two threads asking
            self._query = asyncio.get_running_loop().run_in_executor(None, self.running)
        try:
            running = await asyncio.wait_for(asyncio.shield(self._query),
                                             SERVE_QUERY_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no answer: keep them (docstring)
            logger.warning("metrics: could not ask Serve which ingress replicas run: %s",
                           exc)
            self.hub.retire(self.hub.silent(FORGET_AFTER_S))
            return
        self.hub.retire([r for r in self.hub.silent() if r not in running])


def serve_running_replicas() -> set[str]:
    """The ids of the replicas Serve's controller lists in this replica's application,
    stopped ones left out (blocking: ReplicaSweep calls it on a thread)."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    app_name = serve.get_replica_context().app_name
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_serve_instance_details.remote(),
                      timeout=SERVE_QUERY_TIMEOUT_S)
    if hasattr(details, "model_dump"):
        details = details.model_dump()
    deployments = details["applications"][app_name]["deployments"]
    return {str(replica["replica_id"]) for deployment in deployments.values()
            for replica in deployment.get("replicas", [])
            if str(replica.get("state", "")).rpartition(".")[2] != "STOPPED"}


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
        if family.type not in SUMMED_TYPES:
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
