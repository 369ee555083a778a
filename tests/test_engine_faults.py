"""Engines failing under load, seen from the HTTP API and the client: mock engines in
their own processes (so they can be SIGKILLed or SIGSTOPped), the app under uvicorn,
and no process handles (as in the Ray deployment, where engines are remote): only the
dropped connection and the heartbeat tell the ingress an engine is gone."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx

from engine import SamplingParams
from engine.errors import EngineDeadError
from engine.wire.core_client import EngineClient
from tests.app_server import MODEL, serve_app_over_mocks

FAIL_WITHIN_S = 5.0


class _Stream(threading.Thread):
    """One streamed completion read to its end: when each event came, and how it ended."""

    def __init__(self, url: str, i: int, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.i, self.max_tokens = url, i, max_tokens
        self.first = threading.Event()
        self.times: list[float] = []
        self.error: dict | None = None
        self.tokens = 0
        self.done = False

    def run(self) -> None:
        body = {"model": MODEL, "prompt": f"stream {self.i}", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as http, \
                http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.times.append(time.monotonic())
                self.first.set()
                if line == "data: [DONE]":
                    self.done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = chunk["error"]
                elif chunk.get("usage"):
                    self.tokens = chunk["usage"]["completion_tokens"]


def test_a_killed_engine_fails_its_requests_within_5s_with_503_and_the_other_streams_on(
        tokenizer):
    with serve_app_over_mocks(tokenizer, engines=2, processes=True, itl_s=0.01) as server:
        streams = [_Stream(server.url, i, 800) for i in range(12)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(30)
        plain: dict[int, httpx.Response] = {}

        def non_streaming(i: int) -> None:
            plain[i] = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"plain {i}", "max_tokens": 800, "ignore_eos": True})
        waiting = [threading.Thread(target=non_streaming, args=(i,)) for i in range(6)]
        for t in waiting:
            t.start()
        time.sleep(0.5)
        server.procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for t in streams + waiting:
            t.join(60)

    failed = [s for s in streams if s.error is not None]
    survived = [s for s in streams if s.error is None]
    assert failed and survived, "the requests should have been spread over both engines"
    last_failure = max(s.times[-1] for s in failed)
    slowest = last_failure - killed_at
    print(f"engine SIGKILL: {len(failed)} streams failed within {slowest:.2f}s, "
          f"{len(survived)} went on to the end")
    for s in failed:
        assert s.error["code"] == 503 and "dead" in s.error["message"], s.error
        assert s.times[-1] - killed_at < FAIL_WITHIN_S  # the error event, then [DONE]
    for s in survived:  # streamed on past the failure, to the end
        assert s.done and s.tokens == 800
        assert s.times[-1] > last_failure
    codes = sorted(r.status_code for r in plain.values())
    assert len(codes) == 6 and set(codes) <= {200, 503} and 503 in codes, codes
    for r in plain.values():
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_stopped_engine_is_declared_dead_by_the_heartbeat(tokenizer):
    """SIGSTOP keeps the TCP connection open: only the missing heartbeats tell. The
    streams on it end with EngineDeadError once heartbeat_timeout_s has passed, not
    after waiting forever; those on the other engine finish."""
    from tests.app_server import _mock_process, free_tcp_port
    addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    procs = [_mock_process(a, len(tokenizer), 0.01) for a in addresses]
    try:
        async def main():
            client = await EngineClient.connect(addresses, tokenizer, handshake_timeout_s=30,
                                                heartbeat_timeout_s=2.0)
            params = SamplingParams(max_tokens=600, ignore_eos=True)

            async def run(rank: int):
                tokens = 0
                try:
                    async for out in client.generate(f"r{rank}", [5, 6], params,
                                                     data_parallel_rank=rank):
                        tokens += len(out.outputs[0].token_ids)
                        if tokens >= 5 and rank == 0 and "at" not in stopped:
                            procs[0].send_signal(signal.SIGSTOP)
                            stopped["at"] = time.monotonic()
                except EngineDeadError as exc:
                    return "dead", time.monotonic() - stopped["at"], str(exc)
                return "done", tokens, ""

            stopped: dict[str, float] = {}
            try:
                return await asyncio.wait_for(asyncio.gather(run(0), run(1)), 60)
            finally:
                await client.shutdown()

        (kind0, after_stop, message), (kind1, tokens1, _) = asyncio.run(main())
        assert kind0 == "dead" and "silent" in message
        assert 1.5 < after_stop < 2.0 + 1.5  # the timeout, plus at most a monitor period
        assert kind1 == "done" and tokens1 == 600
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()



def test_an_engine_back_from_a_blip_is_used_again_and_gets_its_aborts(tokenizer):
    """An engine stopped past the heartbeat timeout is declared dead and its streams
    fail; once it runs again (SIGCONT: it only went quiet) the client routes to it
    again without any membership change, and sends it the aborts of the failed
    requests, which went on decoding to max_tokens before (issue 40, finding 1)."""
    from tests.app_server import _mock_process, free_tcp_port
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = _mock_process(address, len(tokenizer), 0.01)
    try:
        async def main():
            client = await EngineClient.connect([address], tokenizer, handshake_timeout_s=30,
                                                heartbeat_timeout_s=1.0)
            try:
                params = SamplingParams(max_tokens=5000, ignore_eos=True)
                streams = [client.generate(f"r{i}", [5, 6], params) for i in range(3)]
                for s in streams:
                    await s.__anext__()
                proc.send_signal(signal.SIGSTOP)
                for s in streams:
                    try:
                        async for _ in s:
                            pass
                    except EngineDeadError:
                        pass
                assert not client.healthy
                proc.send_signal(signal.SIGCONT)
                for _ in range(100):  # its next heartbeat (1 s) brings it back
                    if client.healthy:
                        break
                    await asyncio.sleep(0.1)
                assert client.healthy and not client.engines[0].dead
                stats = await client.get_stats()
                for _ in range(50):
                    if not stats[0].num_running_reqs:
                        break
                    await asyncio.sleep(0.1)
                    stats = await client.get_stats()
                running = stats[0].num_running_reqs
                tokens = 0
                async for out in client.generate("after", [7, 8], SamplingParams(
                        max_tokens=5, ignore_eos=True)):
                    tokens += len(out.outputs[0].token_ids)
                return running, tokens
            finally:
                await client.shutdown()

        running, tokens = asyncio.run(asyncio.wait_for(main(), 60))
        assert running == 0  # the failed requests were aborted, not decoded to the end
        assert tokens == 5
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_request_a_dead_engine_gave_no_token_goes_to_another_engine(tokenizer):
    """A request still waiting for its first token on an engine that dies is sent to
    another engine instead of failing (only a draining engine's were), and the dead
    engine's copy is aborted should it come back (issue 40, finding 1)."""
    from tests.app_server import _mock_process, free_tcp_port
    addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    procs = [_mock_process(a, len(tokenizer), 0.01, ttft_s=3.0) for a in addresses]
    try:
        async def main():
            client = await EngineClient.connect(addresses, tokenizer, handshake_timeout_s=30)
            try:
                stream = client.generate("r", [5, 6], SamplingParams(max_tokens=5,
                                                                     ignore_eos=True))
                first = asyncio.ensure_future(stream.__anext__())
                await asyncio.sleep(0.5)  # sent, still in its 3 s prefill
                engine = client._engine_of["r"]
                procs[engine].send_signal(signal.SIGKILL)
                tokens = len((await first).outputs[0].token_ids)
                async for out in stream:
                    tokens += len(out.outputs[0].token_ids)
                return tokens, client.abort_causes["resubmitted"]
            finally:
                await client.shutdown()

        tokens, resubmitted = asyncio.run(asyncio.wait_for(main(), 60))
        assert tokens == 5 and resubmitted == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
