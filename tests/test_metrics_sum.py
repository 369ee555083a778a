"""Request metrics summed over ingress replicas (deployments/serve/metrics_sum.py): whichever
replica a scrape reaches, counters and histograms are the sum over all of them and
never go backwards, also when a replica goes away."""
import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deployments.serve import metrics_sum
from deployments.serve.metrics_sum import MetricsSum, ReplicaSweep, at_least
from deployments.apis.server import ClientControl, IngressOptions, build_api_app
from tests.test_openai_app import MODEL


def _counter(value: float) -> list:
    return [["vllm:request_success", "Finished requests", "counter",
             [["vllm:request_success_total", {"finished_reason": "length"}, value]]]]


def _total(snapshot) -> float:
    return sum(v for *_, samples in snapshot for _, _, v in samples)


def test_the_sum_covers_every_replica_ever_heard_and_never_falls():
    hub = MetricsSum()
    assert _total(hub.report("a", _counter(3))) == 3
    assert _total(hub.report("b", _counter(5))) == 8
    assert _total(hub.report("a", _counter(4))) == 9  # a's latest replaces its last
    assert _total(hub.report("a", _counter(2))) == 9  # a late, older report: ignored
    # b went away (downscaled): what it counted stays; a new replica adds to it
    assert _total(hub.report("c", _counter(1))) == 10
    assert hub.report("a", []) == [["vllm:request_success", "Finished requests", "counter",
                                     [["vllm:request_success_total",
                                       {"finished_reason": "length"}, 10.0]]]]


def test_a_replica_without_an_answer_serves_its_last_sum_raised_to_its_own():
    assert _total(at_least(_counter(10), _counter(4))) == 10  # the last sum holds
    assert _total(at_least(_counter(10), _counter(12))) == 12  # it counted more since


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _histogram(count: float, total: float) -> list:
    return [["vllm:e2e_request_latency_seconds", "Latency", "histogram",
             [["vllm:e2e_request_latency_seconds_bucket", {"le": "+Inf"}, count],
              ["vllm:e2e_request_latency_seconds_count", {}, count],
              ["vllm:e2e_request_latency_seconds_sum", {}, total]]]]


def _values(snapshot) -> dict:
    return {(name, tuple(sorted(labels.items()))): v
            for *_, samples in snapshot for name, labels, v in samples}


def _reports_every_5s(hub, clock, replicas, rounds, value_of, totals):
    for _ in range(rounds):
        clock.now += 5.0
        for r in replicas:
            totals.append(_values(hub.report(r, value_of(r))))


def test_a_gone_replica_is_forgotten_and_its_counts_stay_in_the_sum():
    clock = Clock()
    hub = MetricsSum(clock)
    sent = {"a": 0, "b": 0}

    def both(r):  # each replica counts 1 more request each round
        sent[r] += 1
        return _counter(sent[r]) + _histogram(sent[r], 0.5 * sent[r])
    totals = []
    _reports_every_5s(hub, clock, ["a", "b"], 3, both, totals)
    assert hub.silent() == []
    _reports_every_5s(hub, clock, ["a"], 13, both, totals)  # b stopped reporting
    assert hub.silent() == ["b"]  # 65 s of a's reports without one from b
    hub.retire(hub.silent())
    assert hub.replicas == ["a"]
    _reports_every_5s(hub, clock, ["a"], 2, both, totals)
    for before, after in zip(totals, totals[1:]):  # never backwards, histograms included
        assert all(after[k] >= v for k, v in before.items()), (before, after)
    last = totals[-1]
    assert last[("vllm:request_success_total", (("finished_reason", "length"),))] == 18 + 3
    assert last[("vllm:e2e_request_latency_seconds_count", ())] == 21
    assert last[("vllm:e2e_request_latency_seconds_sum", ())] == 10.5
    # a late report from b (Ray does not order calls) is not counted on top of its fold
    assert _values(hub.report("b", both("b")))[
        ("vllm:request_success_total", (("finished_reason", "length"),))] == 21
    assert hub.replicas == ["a"]


def test_memory_stays_bounded_while_replicas_come_and_go(monkeypatch):
    monkeypatch.setattr(metrics_sum, "RETIRED_IDS_KEPT", 100)
    clock = Clock()
    hub = MetricsSum(clock)
    for i in range(2000):  # a replica starts, counts, reports, is replaced
        clock.now += 5.0
        hub.report("steady", _counter(i))
        hub.report(f"r{i}", _counter(1))
        hub.retire(hub.silent())
    assert len(hub.replicas) <= 14  # the steady one and the ones not yet silent 60 s
    assert len(hub._retired_ids) <= 100 and len(hub._retired_order) <= 100
    assert _total(hub.total()) == 1999 + 2000  # every request still counted once


def test_a_replica_that_paused_briefly_is_not_counted_twice():
    clock = Clock()
    hub = MetricsSum(clock)
    hub.report("a", _counter(5))
    hub.report("b", _counter(1))
    for _ in range(10):  # a silent for 50 s while b reports
        clock.now += 5.0
        hub.report("b", _counter(1))
    assert hub.silent() == []
    assert _total(hub.report("a", _counter(7))) == 7 + 1  # a's 7 replaces its 5


def test_a_stalled_coordinator_takes_nobody_for_gone():
    clock = Clock()
    hub = MetricsSum(clock)
    hub.report("a", _counter(1))
    hub.report("b", _counter(1))
    clock.now += 600.0  # the coordinator was stopped (SIGSTOP) for 10 minutes
    hub.report("a", _counter(2))
    assert hub.silent() == []  # b reports next, as soon as its call goes through


def test_the_sweep_retires_only_what_serve_no_longer_runs():
    clock = Clock()
    hub = MetricsSum(clock)
    for r in ("a", "paused", "gone"):
        hub.report(r, _counter(1))
    for _ in range(13):
        clock.now += 5.0
        hub.report("a", _counter(1))
    assert sorted(hub.silent()) == ["gone", "paused"]
    asyncio.run(ReplicaSweep(hub, lambda: {"a", "paused"}, clock).sweep())
    assert sorted(hub.replicas) == ["a", "paused"]  # Serve still runs `paused`
    assert _total(hub.total()) == 3


def test_without_an_answer_from_serve_silent_replicas_are_kept_for_a_while(monkeypatch):
    monkeypatch.setattr(metrics_sum, "SERVE_QUERY_TIMEOUT_S", 0.2)
    clock = Clock()
    hub = MetricsSum(clock)
    hub.report("a", _counter(1))
    hub.report("b", _counter(1))
    for _ in range(13):
        clock.now += 5.0
        hub.report("a", _counter(1))

    def failing():
        raise RuntimeError("no Serve controller")

    def hanging():
        import time
        time.sleep(1.0)
        return set()

    async def main():
        for running in (failing, hanging):
            sweep = ReplicaSweep(hub, running, clock)
            await sweep.sweep()  # answers within the timeout, keeps b
            assert sorted(hub.replicas) == ["a", "b"]
        for _ in range(720):  # silent for an hour: forgotten without Serve's word
            clock.now += 5.0
            hub.report("a", _counter(1))
        await ReplicaSweep(hub, failing, clock).sweep()
        assert hub.replicas == ["a"]
        assert _total(hub.total()) == 2
    asyncio.run(main())


def test_the_coordinator_sweeps_after_a_report(monkeypatch):
    clock = Clock()
    hub = MetricsSum(clock)
    asked = []

    def running():
        asked.append(1)
        return {"a"}

    async def main():
        sweep = ReplicaSweep(hub, running, clock)
        hub.report("a", _counter(1))
        hub.report("b", _counter(1))
        sweep.poke()  # nobody silent: Serve is not asked
        for _ in range(13):
            clock.now += 5.0
            hub.report("a", _counter(1))
            sweep.poke()
        await sweep._task
        assert asked == [1] and hub.replicas == ["a"]
    asyncio.run(main())


class SharedControl(ClientControl):
    """What CoordinatorControl does over Ray: report to one MetricsSum."""

    def __init__(self, get_client, hub: MetricsSum, replica_id: str) -> None:
        super().__init__(get_client)
        self.hub, self.replica_id = hub, replica_id

    async def sum_metrics(self, snapshot, timeout_s: float = 2.0):
        return self.hub.report(self.replica_id, snapshot)


def _scrape(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:request_success_total", "vllm:generation_tokens_total",
                          "vllm:e2e_request_latency_seconds_count"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_two_ingress_replicas_scraped_in_turn_never_go_backwards(engines):
    engines.add(itl_s=0.001)

    async def main():
        client = await engines.client()

        async def get_client():
            return client
        hub = MetricsSum()
        replicas = []
        for name in ("ingress-a", "ingress-b"):
            app = build_api_app(get_client, IngressOptions(MODEL),
                                   SharedControl(get_client, hub, name))
            replicas.append(httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                              base_url="http://flotilla"))
        try:
            seen, sent = [], 0
            # replica a takes 3 requests, b 1, then a 1 more: each scrape alternates
            for replica in (0, 0, 0, 1, 0):
                r = await replicas[replica].post("/v1/completions", json={
                    "model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
                assert r.status_code == 200
                sent += 1
                # the replica that served it reports it at its scrape; from then on a
                # scrape of the other one counts it too
                for http in (replicas[replica], replicas[1 - replica]):
                    seen.append((sent, _scrape((await http.get("/metrics")).text)))
            return seen
        finally:
            for http in replicas:
                await http.aclose()
            await client.shutdown()

    seen = asyncio.run(main())
    for (_, before), (_, after) in zip(seen, seen[1:]):
        for name, value in before.items():
            assert after[name] >= value, (name, before, after)
    # each scrape is the sum over both replicas
    for sent, values in seen:
        assert values["vllm:request_success_total"] == sent
        assert values["vllm:e2e_request_latency_seconds_count"] == sent
        assert values["vllm:generation_tokens_total"] == 2 * sent


class SlowControl(ClientControl):
    """A coordinator answering the sum late (a loaded replica's round trip: 0.5-0.8 s),
    with CoordinatorControl's rule: no answer past the caller's timeout."""

    def __init__(self, get_client, delay_s: float, answer) -> None:
        super().__init__(get_client)
        self.delay_s, self.answer, self.asked = delay_s, answer, 0

    async def sum_metrics(self, snapshot, timeout_s: float = 2.0):
        self.asked += 1
        answer = self.answer  # as of the report
        if self.delay_s > timeout_s:
            await asyncio.sleep(timeout_s)
            return None
        await asyncio.sleep(self.delay_s)
        return answer


def test_a_scrape_serves_a_recent_sum_without_waiting_and_keeps_a_late_answer(
        engines, monkeypatch):
    """/metrics took 0.9-1.3 s under 256 streams, most of it waiting for the coordinator's
    sum (issue 62). A scrape waits SUM_WAIT_S at most; an answer that comes later is
    kept, and a scrape with a sum under SUM_FRESH_S old serves it at once, raised to the
    replica's own counts; its own report's answer is the next scrape's sum."""
    from deployments.apis import service_routes
    monkeypatch.setattr(service_routes, "SUM_WAIT_S", 0.3)
    engines.add(itl_s=0.001)

    async def main():
        client = await engines.client()

        async def get_client():
            return client
        control = SlowControl(get_client, 0.6, _counter(11))
        app = build_api_app(get_client, IngressOptions(MODEL), control)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")

        async def scrape() -> tuple[float, float]:
            began = asyncio.get_running_loop().time()
            values = _scrape((await http.get("/metrics")).text)
            return (asyncio.get_running_loop().time() - began,
                    values.get("vllm:request_success_total", 0.0))
        try:
            first = await scrape()  # no sum yet: waits SUM_WAIT_S, serves its own
            await asyncio.sleep(0.5)  # the answer comes meanwhile (0.6 s)
            control.answer = _counter(12)
            second = await scrape()  # the kept answer, at once
            await asyncio.sleep(0.8)  # the second scrape's own answer comes meanwhile
            third = await scrape()
            return first, second, third, control.asked
        finally:
            await http.aclose()
            await client.shutdown()

    first, second, third, asked = asyncio.run(main())
    assert first[0] >= 0.3 and first[1] == 0
    assert second[0] < 0.25 and second[1] == 11
    assert third[1] == 12
    assert asked == 3  # every scrape still reports


def test_an_answer_to_an_older_report_never_replaces_a_newer_one():
    """Ray does not order calls: the periodic report's answer may come after a newer
    scrape's. The replica keeps the answer to its newest report."""
    from deployments.serve.metrics import IngressMetrics
    metrics = IngressMetrics(MODEL, lambda: None)
    older, _ = metrics.report()
    newer, _ = metrics.report()
    metrics.remember_sum(_counter(9), newer)
    metrics.remember_sum(_counter(7), older)  # late
    assert _scrape(metrics.exposition().decode())["vllm:request_success_total"] == 9
