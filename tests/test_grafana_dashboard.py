"""The Grafana dashboard (helm/flotilla/dashboards/flotilla.json) queries only series
that /metrics serves: every metric name in its PromQL is in a live exposition."""
import json
import re
from pathlib import Path

from tests.test_openai_app import MODEL, serve

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "flotilla" / "dashboards" / \
    "flotilla.json"
METRIC = re.compile(r"\b((?:vllm|flotilla):[a-z0-9_]+)")


def _queried() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    names = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names.update(METRIC.findall(target["expr"]))
            # every Serve pod serves the same totals: one copy per series before a sum
            assert target["expr"].count("max without(instance, pod) (") == len(
                METRIC.findall(target["expr"])), target["expr"]
    for variable in dashboard["templating"]["list"]:
        names.update(METRIC.findall(variable.get("definition", "")))
    return names


def test_every_series_the_dashboard_queries_is_served(engines):
    engines.add(itl_s=0.001)

    async def test(http, oai):
        await oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                     extra_body={"ignore_eos": True})
        return (await http.get("/metrics")).text

    from prometheus_client.parser import text_string_to_metric_families
    served = {s.name for f in text_string_to_metric_families(serve(engines, test))
              for s in f.samples}
    queried = _queried()
    assert len(queried) >= 20
    assert queried <= served, sorted(queried - served)
