"""A bare Starlette app that streams OpenAI-style completion chunks with no model and no
engine: the ceiling a serving stack can reach on this machine.

bench/serve.py runs it under uvicorn (`python bench/bare_sse.py --port P`) and behind
Ray Serve's proxy (`serve_app`, deployed with serve.run), so Flotilla's mock-engine
path can be compared with both in one run.

Paced (`serve run bench.bare_sse:paced_app itl_s=0.02`), one ticker wakes every stream
each `itl_s` as an engine step would, and /metrics reports how many streams run
(`vllm:num_requests_running`): bench/disconnect_storm.py's `--launch bare-serve-run`
drops a storm on it, the floor Serve's proxy and replica set for any app behind them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

MODEL = "bare"


async def _models(_: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _completions(request: Request) -> StreamingResponse | JSONResponse:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    if not body.get("stream"):
        return JSONResponse({"id": "cmpl-bare", "object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": " a" * n,
                                          "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                       "total_tokens": n + 1}})
    created = int(time.time())

    async def events():
        for i in range(n):
            chunk = {"id": "cmpl-bare", "object": "text_completion", "created": created,
                     "model": MODEL, "choices": [{"index": 0, "text": " a",
                                                  "finish_reason": "length" if i == n - 1
                                                  else None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        usage = {"id": "cmpl-bare", "object": "text_completion", "created": created,
                 "model": MODEL, "choices": [],
                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
        yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


class _Ticker:
    """One task that wakes every live stream each `itl_s` (an engine step's batch of
    outputs), and the count of streams running, which falls as each one is cancelled."""

    def __init__(self, itl_s: float) -> None:
        self.itl_s = itl_s
        self.streams: set[asyncio.Queue] = set()
        self.task: asyncio.Task | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.itl_s)
            for queue in self.streams:
                queue.put_nowait(None)

    async def completions(self, request: Request) -> StreamingResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._tick())
        queue: asyncio.Queue = asyncio.Queue()
        self.streams.add(queue)

        async def events():
            try:
                for i in range(n):
                    await queue.get()
                    chunk = {"id": "cmpl-bare", "object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": " a", "finish_reason":
                                          "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.streams.discard(queue)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(self, _: Request) -> PlainTextResponse:
        return PlainTextResponse(f"vllm:num_requests_running {len(self.streams)}\n")


def build(itl_s: float = 0.0) -> Starlette:
    """The app; with `itl_s` its streams are paced by one ticker and /metrics counts them."""
    if not itl_s:
        return Starlette(routes=[Route("/v1/models", _models),
                                 Route("/v1/completions", _completions, methods=["POST"])])
    ticker = _Ticker(itl_s)
    return Starlette(routes=[Route("/v1/models", _models),
                             Route("/v1/completions", ticker.completions, methods=["POST"]),
                             Route("/metrics", ticker.metrics)])


def serve_app():
    """The same app as one Ray Serve deployment (behind Serve's proxy)."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    @serve.ingress(build())
    class BareSSE:
        pass

    return BareSSE.bind()


def paced_app(args: dict[str, str]):
    """`serve run bench.bare_sse:paced_app itl_s=0.02`: the paced app, one replica."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    @serve.ingress(build(float(args.get("itl_s", 0.02))))
    class PacedSSE:
        pass

    return PacedSSE.bind()


if __name__ == "__main__":
    import uvicorn
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build(), host="127.0.0.1", port=args.port, log_level="warning")
