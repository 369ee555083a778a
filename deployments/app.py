"""build_app(args): the Flotilla Serve application (ingress -> engines, coordinator).

    serve run deployments.app:build_app model=mock data_parallel_size=2
    serve build deployments.app:app -o config.yaml   # then: import_path -> build_app, set
                                                     # args:, delete the deployments: list
                                                     # (it would override what args say),
                                                     # serve deploy config.yaml
"""
from __future__ import annotations

import math
from typing import Any

from ray.serve import Application

from deployments.config import AppArgs, parse_app_args
from deployments.coordinator import Coordinator
from deployments.engine_server import EngineServer
from deployments.heap_trim import allocator_env
from deployments.ingress import OpenAIIngress


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
    # Serve's default max_ongoing_requests (5) would cap each ingress replica at 5
    # concurrent streams: the proxy queues the rest, so the engines never see more load,
    # and the ingress target of 64 could never be reached (Serve warns "Autoscaling will
    # never happen"). Room for 4x the target: bursts while new ingress replicas start.
    ingress_scaling = parsed.ingress_autoscaling
    return OpenAIIngress.options(
        autoscaling_config=ingress_scaling.serve_config(),
        max_ongoing_requests=max(1, math.ceil(4 * ingress_scaling.target_ongoing_requests)),
        ray_actor_options={"num_cpus": parsed.ingress_num_cpus,
                           "runtime_env": {"env_vars": allocator_env()}},
    ).bind(raw, coordinator, engines)


# The default app as an Application object, for `serve build deployments.app:app` (which
# takes only Applications). In the written config, point import_path at
# deployments.app:build_app, put the AppArgs fields under `args:`, and delete the
# `deployments:` list: its replica counts and resources would override the args.
app = build_app()
