"""Request metrics summed over ingress replicas (deployments/serve/metrics_sum.py): whichever
replica a scrape reaches, counters and histograms are the sum over all of them and
never go backwards, also when a replica goes away."""
import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deployments.serve.metrics_sum import MetricsSum, at_least
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
