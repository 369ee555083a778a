"""Engine stats are fresh under load: they ride on every output message (and on idle
heartbeats), so /metrics and the autoscaler see the queue while it is busy, not a
second after it goes quiet."""
import asyncio
import re
import time

from tests.test_openai_app import MODEL, serve

STREAMS = 128


def _running(text: str) -> float:
    return sum(float(v) for v in re.findall(
        r'^vllm:num_requests_running\{[^}]*\} (\S+)$', text, re.M))


def test_running_gauge_follows_128_live_streams_within_a_second(engines):
    # two engines, each token 50 ms: 80 tokens keep every stream live for 4 s
    engines.add(itl_s=0.05)
    engines.add(itl_s=0.05)

    async def test(http, oai):
        started: list[float] = []

        async def stream(i: int) -> None:
            body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 80,
                    "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                started.append(time.monotonic())
                async for _ in r.aiter_lines():
                    pass

        async def gauge_until(predicate, since: float) -> tuple[float, float]:
            """(seconds from `since` until /metrics satisfied predicate, last value)."""
            while True:
                value = _running((await http.get("/metrics")).text)
                if predicate(value) or time.monotonic() - since > 10:
                    return time.monotonic() - since, value
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
        sent = time.monotonic()
        up, busy = await gauge_until(lambda v: v >= 100, sent)
        await asyncio.gather(*tasks)
        ended = time.monotonic()
        down, idle = await gauge_until(lambda v: v == 0, ended)
        return up, busy, down, idle, len(started)

    up, busy, down, idle, started = serve(engines, test)
    assert started == STREAMS
    assert busy >= 100 and up < 1.0, (up, busy)
    assert idle == 0 and down < 1.0, (down, idle)
