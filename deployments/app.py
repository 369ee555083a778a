"""build_app(args): the Flotilla Serve application (ingress -> engines, coordinator).

    serve run deployments.app:build_app model=mock data_parallel_size=2
    serve build deployments.app:app -o config.yaml   # then: import_path -> build_app, set
                                                     # args:, delete the deployments: list
                                                     # (it would override what args say),
                                                     # serve deploy config.yaml
"""
from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.config import AppArgs, parse_app_args
from deployments.serve.coordinator import Coordinator
from deployments.serve.engine_server import EngineServer
from deployments.serve.heap_trim import allocator_env
from deployments.serve.ingress import OpenAIIngress

# an ingress replica's concurrency cap: none in practice (see build_app)
INGRESS_MAX_ONGOING_REQUESTS = 1_000_000_000


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Validate args (clear errors for bad values) and bind the deployment graph."""
    parsed = parse_app_args(args)
    raw = parsed.model_dump(mode="json")
    coordinator = Coordinator.bind(raw)
    bundles = parsed.engine_bundles()
    placement = ({"placement_group_bundles": bundles,
                  "placement_group_strategy": parsed.placement_strategy} if bundles else {})
    if parsed.engine_autoscaling is not None:  # on queue depth, from data_parallel_size
        count = {"autoscaling_config": parsed.engine_autoscaling.serve_config(
            initial_replicas=parsed.data_parallel_size)}
    else:
        count = {"num_replicas": parsed.data_parallel_size}
    engines = EngineServer.options(
        ray_actor_options={"num_cpus": parsed.engine_cpus,
                           "num_gpus": parsed.engine_num_gpus},
        **count, **placement,
    ).bind(raw, coordinator)
    # The ingress has no concurrency cap of its own (as Ray Serve LLM's ingress): the
    # engines bound the load (max_num_seqs running, max_waiting_requests waiting, then
    # 503 with Retry-After). Serve's cap queues every request past it inside the replica,
    # /metrics and /health included: Serve's default (5) held the engines at 5 streams
    # a replica, and 4x the target (256) held a scrape behind 256 streams for 15 s+
    # (streams opened before a scale-out stay on their replica). Autoscaling still
    # aims at target_ongoing_requests.
    return OpenAIIngress.options(
        autoscaling_config=parsed.ingress_autoscaling.serve_config(),
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": parsed.ingress_num_cpus,
                           "runtime_env": {"env_vars": allocator_env()}},
    ).bind(raw, coordinator, engines)


# The default app as an Application object, for `serve build deployments.app:app` (which
# takes only Applications). In the written config, point import_path at
# deployments.app:build_app, put the AppArgs fields under `args:`, and delete the
# `deployments:` list: its replica counts and resources would override the args.
app = build_app()
