"""The Helm chart's serveConfigV2, deployed with `serve deploy` to a `ray start` head
that has logical GPUs, serves the mock model over HTTP: what KubeRay does, minus K8s.

The test starts its own head (`ray start --head --block`, private --temp-dir, free
ports) and ends it by signalling that process and then any process that still names its
temp dir: never `ray stop`, which would stop every Ray on the machine.
"""
from __future__ import annotations

import contextlib

import httpx
import yaml

from tests.e2e.ray_head import free_ports, ray_head, serve_deploy
from tests.helm_tool import helm, serve_config  # noqa: F401 (helm: a fixture)

DEPLOY_TIMEOUT_S = 240


@contextlib.contextmanager
def ray_head_with_gpus(num_gpus: int):
    """Our own head with logical GPUs; yields (dashboard client, env for Ray CLIs)."""
    with ray_head(["--num-cpus=2", f"--num-gpus={num_gpus}"]) as (dashboard, env, _):
        yield dashboard, env


def test_chart_serve_config_deploys_with_serve_deploy_and_answers(helm, tmp_path):
    (http_port,) = free_ports(1)
    values = {
        "image": {"repository": "registry.example.com/flotilla"},
        "serve": {"port": http_port},
        # the mock model; engines take a logical GPU each and no CPU (2 shared cores)
        "app": {"model": "mock", "served_model_name": "mock", "data_parallel_size": 2,
                "engine_num_gpus": 1, "engine_num_cpus": 0, "ingress_num_cpus": 0,
                "ingress_autoscaling": {"min_replicas": 1, "max_replicas": 1}},
    }
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(helm.render(values))))

    with ray_head_with_gpus(num_gpus=2) as (dashboard, env):
        serve_deploy(dashboard, env, config_path, DEPLOY_TIMEOUT_S)

        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["mock"]
            r = http.post("/v1/completions", json={"model": "mock", "prompt": "Hello",
                                                   "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            metrics = http.get("/metrics")
            assert metrics.status_code == 200
            assert "vllm:num_requests_running" in metrics.text

        # each engine replica holds one of the two GPUs, through its placement group
        groups = dashboard.get("/api/v0/placement_groups",
                               params={"detail": "1"}).json()["data"]["result"]["result"]
        gpu_bundles = [b["unit_resources"] for g in groups if g["state"] == "CREATED"
                       for b in g["bundles"]]
        assert gpu_bundles == [{"GPU": 1.0}, {"GPU": 1.0}], groups
