"""The HTTP app: every API's routes over one EngineClient, as a Starlette app.

Independent of Ray: the Serve ingress deployment wraps this app, tests drive it
in-process. The APIs live in their own folders (openai/, responses/, anthropic/) over
shared pieces (common/: chat templates, tool and reasoning parsers; events.py: the
neutral generation events each API renders); service_routes.py has models, health,
metrics, tokenize and the control endpoints. Every error is the API's own JSON with a
fitting status, and the app keeps serving after each one. A streamed request whose
client goes away is closed, which closes its EngineClient stream, which aborts it at
its engine.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.applications import Starlette

from deployments.apis.anthropic.routes import anthropic_routes
from deployments.apis.context import ApiContext, ClientControl
from deployments.apis.openai.routes import openai_routes
from deployments.apis.options import IngressOptions
from deployments.apis.responses.routes import responses_routes
from deployments.apis.responses.store import LocalResponses
from deployments.apis.service_routes import service_routes
from engine.wire.core_client import EngineClient

__all__ = ["ClientControl", "IngressOptions", "build_api_app"]


def build_api_app(get_client: Callable[[], Awaitable[EngineClient]],
                  options: IngressOptions, control: Any = None, store: Any = None,
                  current_client: Callable[[], EngineClient | None] | None = None
                  ) -> Starlette:
    """Routes of every API (+ tokenize, health, metrics, control) over the engines.

    control: what answers the control endpoints (the coordinator in Serve); by default
    the ingress's own client, with the same aggregation rules. store: where stored
    Responses live (the coordinator in Serve, so every ingress replica reaches them); by
    default one in this process. current_client: the client get_client would return
    without waiting, or None (read by /metrics, which must not wait behind a busy loop).
    """
    store = store or LocalResponses(options.response_store_max, options.response_store_ttl_s,
                                    options.response_store_max_bytes)
    ctx = ApiContext(get_client, options, control, store, current_client)
    app = Starlette(routes=openai_routes(ctx) + responses_routes(ctx) + anthropic_routes(ctx)
                    + service_routes(ctx))
    app.state.metrics = ctx.metrics  # the ingress reports its snapshot from here too
    app.state.adapters = ctx.adapters  # the ingress fetches its first list early
    app.state.stopping = False  # set when the server stops: /health and new requests 503
    return app
