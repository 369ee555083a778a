"""OpenTelemetry tracing (engine/tracing.py): off by default and then nothing carries a
trace context; on, a caller's traceparent continues through the ingress to the engine's
llm_request span and its queue / prefill / decode children, with vLLM's gen_ai.*
attributes. Spans go to an in-memory exporter."""
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine import tracing
from engine.core_messages import EngineCoreRequest
from engine.model.loader import load_tokenizer
from tests.test_openai_app import MODEL, _Real, serve, tiny_server  # noqa: F401

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
OTEL_ENV = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT")


@pytest.fixture
def exporter(monkeypatch):
    """Tracing on (console named in the environment), spans kept in memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield memory
    provider.shutdown()


def test_off_unless_the_environment_asks(monkeypatch):
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not tracing.enabled()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing.enabled()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.enabled()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="otlp or console"):
        tracing._exporter()


def test_untraced_requests_carry_no_context(tiny_server, tiny_llama, monkeypatch):  # noqa: F811
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    sent: list[EngineCoreRequest] = []
    real = _Real(tiny_server, load_tokenizer(tiny_llama))

    async def test(http, oai):
        client = await real.client()
        make = client.processor.make_requests

        def spy(*args, **kwargs):
            requests = make(*args, **kwargs)
            sent.extend(requests)
            return requests
        client.processor.make_requests = spy
        try:
            async for _ in client.generate("plain", [5, 6, 7], _params()):
                pass
        finally:
            await client.shutdown()
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6],
                                                     "max_tokens": 2},
                            headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"})
        return r.status_code

    assert serve(real, test) == 200
    assert sent and all(r.trace_headers is None for r in sent)


def _params():
    from engine import SamplingParams
    return SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("stream", [False, True])
def test_the_callers_trace_reaches_the_engine_span(tiny_server, tiny_llama,  # noqa: F811
                                                   exporter, stream):
    real = _Real(tiny_server, load_tokenizer(tiny_llama))

    async def test(http, oai):
        r = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True,
            "temperature": 0.5, "stream": stream},
            headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"})
        await r.aread()
        return r.status_code

    # the app reads the environment when it is built: here, with tracing on
    assert serve(real, test) == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "llm_request", "queue", "prefill", "decode"}
    http, engine = spans["POST /v1/completions"], spans["llm_request"]
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TRACE_ID}
    assert format(http.parent.span_id, "016x") == CALLER_SPAN  # the caller's child
    assert engine.parent.span_id == http.context.span_id  # the ingress's child
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase].parent.span_id == engine.context.span_id
    assert spans["queue"].end_time <= spans["prefill"].start_time + 1000
    assert spans["prefill"].end_time <= spans["decode"].start_time + 1000
    assert http.attributes["http.response.status_code"] == 200
    a = engine.attributes
    assert a["gen_ai.usage.prompt_tokens"] == 4 and a["gen_ai.usage.completion_tokens"] == 4
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.latency.time_in_queue"] >= 0
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
        a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"])
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]


def test_a_bad_exporter_setting_turns_tracing_off_not_the_requests(  # noqa: F811
        tiny_server, tiny_llama, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.setattr(tracing, "_failed", False)
    real = _Real(tiny_server, load_tokenizer(tiny_llama))

    async def test(http, oai):
        statuses = []
        for _ in range(2):
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6],
                                                         "max_tokens": 2},
                                headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"})
            statuses.append(r.status_code)
        return statuses

    assert serve(real, test) == [200, 200]
    assert tracing._failed and not tracing.enabled()  # tried once, then off
