"""cluster.yaml (`ray up`), checked offline: Ray's own config preparation and schema,
the node types, the Serve app config that the head's start commands deploy, and that
the cluster is closed by default (Ray's token auth on every node, the dashboard on the
head's loopback, the API key from a file into the environment, never argv or args)."""
from __future__ import annotations

import copy
import json
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
    assert cluster["setup_commands"] == []
    # the only files mounted are secrets from the user's machine (below), not code
    assert set(cluster["file_mounts"]) == {"~/.ray/auth_token"}
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


def _ray_start_lines(cluster: dict) -> dict[str, str]:
    (head,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    (worker,) = [c for c in cluster["worker_start_ray_commands"] if "ray start" in c]
    return {"head": head, "worker": worker}


def _run_with_fake_ray(command: str, home: Path) -> dict:
    """Runs a start line as bash on a node would, with a `ray` on PATH that records
    its argv and the keys in its environment instead of starting anything."""
    bin_dir = home / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "ray"
    fake.write_text("#!/usr/bin/env python3\n"
                    "import json, os, sys\n"
                    "json.dump({'argv': sys.argv[1:], 'api_key': os.environ.get("
                    "'FLOTILLA_API_KEY')}, open(os.path.expanduser('~/ray.json'), 'w'))\n")
    fake.chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1"}
    subprocess.run(["bash", "-c", command], check=True, env=env, timeout=30)
    return json.loads((home / "ray.json").read_text())


def test_ray_token_auth_on_every_node(cluster):
    """RAY_AUTH_MODE=token in every container (ray start, serve deploy, ray attach
    shells), and the token file at the path Ray reads by default on every node: the
    launcher copies file_mounts to the head and the head's autoscaler to each worker."""
    from ray._private.authentication.authentication_token_setup import (
        AUTH_MODE_ENV_VAR, _get_default_token_path)
    options = cluster["docker"]["run_options"]
    assert f"--env {AUTH_MODE_ENV_VAR}=token" in options
    default = "~/" + str(_get_default_token_path().relative_to(Path.home()))
    assert cluster["file_mounts"][default] == default
    # no start line turns it off again
    for command in (cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]):
        assert AUTH_MODE_ENV_VAR not in command and "RAY_AUTH_TOKEN" not in command
    # the cluster-wide copy comes from file_mounts (what Ray's launcher syncs to every
    # node), not a path that exists on the head only
    assert not cluster.get("cluster_synced_files")


def test_dashboard_on_the_heads_loopback(cluster, tmp_path):
    recorded = _run_with_fake_ray(_ray_start_lines(cluster)["head"], tmp_path)
    assert recorded["argv"][:2] == ["start", "--head"]
    hosts = [a.split("=", 1)[1] for a in recorded["argv"] if a.startswith("--dashboard-host")]
    assert hosts == ["127.0.0.1"]
    assert "0.0.0.0" not in CLUSTER_YAML.read_text().split("http_options", 1)[0]


def test_api_key_reaches_ray_from_a_file_not_argv_or_the_serve_args(cluster, tmp_path):
    secret = "sk-cluster-test-1234"
    for node, line in _ray_start_lines(cluster).items():
        home = tmp_path / node
        home.mkdir()
        assert _run_with_fake_ray(line, home)["api_key"] == ""  # no file: no key (open)
        (home / ".flotilla").mkdir()
        (home / ".flotilla" / "api-key").write_text(secret)
        recorded = _run_with_fake_ray(line, home)
        assert recorded["api_key"] == secret, node
        assert not any(secret in a for a in recorded["argv"]), node
    # the app's args (which the dashboard shows) carry no key, not even a commented hint
    (tmp_path / "serve").mkdir()
    config = _written_serve_config(cluster, tmp_path / "serve")
    (app,) = config["applications"]
    assert "api_key" not in app["args"] and "admin_key" not in app["args"]
    (writer,) = [c for c in cluster["head_start_ray_commands"] if "<<'EOF'" in c]
    assert "api_key:" not in writer and "admin_key:" not in writer
