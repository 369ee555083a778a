"""IngressOptions: what the HTTP APIs take from the app's configuration (one frozen
object, built by the ingress from AppArgs, or by a test)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IngressOptions:
    served_model_name: str
    api_key: str | None = None  # Bearer key (or x-api-key) for /v1/* and /tokenize (none: open)
    admin_key: str | None = None  # Bearer key for the control endpoints
    dev_mode: bool = False  # control endpoints without a key (never in production)
    max_body_bytes: int = 1 << 20
    metrics_need_api_key: bool = False  # /metrics behind api_key (off: open to scrapers)
    chat_template: str | None = None  # Jinja text; None: the tokenizer's
    # how tool_choice "auto" reads calls (deployments/apis/common/tool_calls/)
    tool_call_parser: str = "hermes"
    # how thinking is split from the answer (deployments/apis/common/reasoning/); None: not
    reasoning_parser: str | None = None
    request_timeout_s: float | None = 600.0  # a request's deadline when it names none
    max_request_timeout_s: float = 600.0  # the longest `timeout` a request may name
    stream_interval_s: float = 0.0  # a stream's events at most this often (AppArgs' doc)
    # stored Responses (POST /v1/responses with store): the most kept, and for how long
    response_store_max: int = 10_000
    response_store_ttl_s: float = 3600.0
    response_store_max_bytes: int = 256 << 20
    # the Serve replica answering, sent as x-flotilla-replica (operators tracing a
    # request; tests checking which replica answered); None: no header
    replica_name: str | None = None
