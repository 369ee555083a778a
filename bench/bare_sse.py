"""A bare Starlette app that streams OpenAI-style completion chunks with no model and no
engine: the ceiling a serving stack can reach on this machine.

bench/serve.py runs it under uvicorn (`python bench/bare_sse.py --port P`) and behind
Ray Serve's proxy (`serve_app`, deployed with serve.run), so Flotilla's mock-engine
path can be compared with both in one run.
"""
from __future__ import annotations

import argparse
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
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


def build() -> Starlette:
    return Starlette(routes=[Route("/v1/models", _models),
                             Route("/v1/completions", _completions, methods=["POST"])])


def serve_app():
    """The same app as one Ray Serve deployment (behind Serve's proxy)."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    @serve.ingress(build())
    class BareSSE:
        pass

    return BareSSE.bind()


if __name__ == "__main__":
    import uvicorn
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build(), host="127.0.0.1", port=args.port, log_level="warning")
