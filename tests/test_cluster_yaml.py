"""cluster.yaml (`ray up`), checked offline: Ray's own config preparation and schema,
the node types, and the Serve app config that the head's start commands deploy."""
from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


@pytest.fixture
def cluster() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _deploy_command(cluster: dict) -> str:
    (command,) = [c for c in cluster["head_start_ray_commands"] if "serve deploy" in c]
    return command


def _written_serve_config(cluster: dict, home) -> dict:
    """Runs the start command that writes the app config (as bash on the head would)
    with HOME pointing at a scratch dir, and parses what it wrote."""
    (writer,) = [c for c in cluster["head_start_ray_commands"] if "<<'EOF'" in c]
    subprocess.run(["bash", "-c", writer], check=True, env={**os.environ, "HOME": str(home)},
                   timeout=30)
    (path,) = re.findall(r"cat > ~/(\S+) <<'EOF'", writer)
    assert f"serve deploy ~/{path}" in _deploy_command(cluster)
    return yaml.safe_load((home / path).read_text())


def test_ray_prepares_and_validates_the_config(cluster):
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    # the checks can fail: a misspelt node-type field, a head type that does not exist
    broken = copy.deepcopy(cluster)
    broken["available_node_types"]["gpu_small"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(broken))
    broken = copy.deepcopy(cluster)
    broken["head_node_type"] = "head_gpu"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(prepare_config(broken))


def test_cpu_only_head_and_autoscaled_gpu_worker_types(cluster):
    types = cluster["available_node_types"]
    head = types.pop(cluster["head_node_type"])
    assert head["resources"] == {"CPU": 0}  # no replicas on the head, and no GPU
    assert len(types) >= 2
    for name, node_type in types.items():
        assert node_type["resources"]["GPU"] >= 1, name
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"], name
    assert sum(t["min_workers"] for t in types.values()) <= cluster["max_workers"]
    gpus = sorted(t["resources"]["GPU"] for t in types.values())
    assert gpus[0] < gpus[-1]  # a small and a large GPU type


def test_nodes_run_the_flotilla_image(cluster):
    """Every node runs the image the Dockerfile builds (tests/test_image.py checks that
    it is Flotilla's on this Ray); nothing is installed on the nodes."""
    from tests.test_image import built_image
    docker = cluster["docker"]
    assert docker["image"] == built_image()
    assert "head_image" not in docker and "worker_image" not in docker
    assert cluster["setup_commands"] == [] and not cluster.get("file_mounts")
    for command in (cluster["head_start_ray_commands"]
                    + cluster["worker_start_ray_commands"]):
        subprocess.run(["bash", "-n", "-c", command], check=True, timeout=30)


def test_head_deploys_the_flotilla_app_config(cluster, tmp_path):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import build_app
    from deployments.config import AppArgs
    config = _written_serve_config(cluster, tmp_path)
    parsed = ServeDeploySchema.model_validate(config)
    (app,) = parsed.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    assert parsed.http_options.host == "0.0.0.0"
    assert app.deployments == []  # args configure the app; no overrides that contradict them
    build_app(app.args)
    AutoscalingConfig(**app.args["ingress_autoscaling"])
    # an engine replica (its placement group) fits on one GPU worker type
    args = AppArgs.model_validate(app.args)
    need = {"CPU": args.engine_num_cpus * args.tensor_parallel_size,
            "GPU": args.engine_num_gpus * args.tensor_parallel_size}
    assert need["GPU"] >= 1
    workers = [t for name, t in cluster["available_node_types"].items()
               if name != cluster["head_node_type"]]
    assert any(all(t["resources"].get(k, 0) >= v for k, v in need.items()) for t in workers)
