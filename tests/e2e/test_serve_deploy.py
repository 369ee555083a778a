"""The Helm chart's serveConfigV2, deployed with `serve deploy` to a `ray start` head
that has logical GPUs, serves the mock model over HTTP: what KubeRay does, minus K8s.

The test starts its own head (`ray start --head --block`, private --temp-dir, free
ports) and ends it by signalling that process and then any process that still names its
temp dir: never `ray stop`, which would stop every Ray on the machine.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helm_tool import by_kind, helm, serve_config  # noqa: F401

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120
DEPLOY_TIMEOUT_S = 240


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pids_naming(marker: str) -> list[int]:
    """Processes whose command line names marker (our head's temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: `ray start` exited with {proc.returncode}")
        try:
            result = predicate()
            if result:
                return result
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


@contextlib.contextmanager
def ray_head(num_gpus: int):
    """A Ray head of our own; yields (dashboard URL, env for Ray CLIs that talk to it).
    Token auth with a token of its own (not ~/.ray's). Cleans up even on failure."""
    temp_dir = tempfile.mkdtemp(prefix="flotilla-ray-")
    gcs, dashboard, client, node_manager, object_manager, agent_http, agent_grpc, \
        runtime_env, metrics = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               OMP_NUM_THREADS="1")
    headers = {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
    log = open(Path(temp_dir) / "ray-start.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
         f"--temp-dir={temp_dir}", "--num-cpus=2", f"--num-gpus={num_gpus}",
         "--node-ip-address=127.0.0.1", f"--port={gcs}", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--ray-client-server-port={client}", f"--node-manager-port={node_manager}",
         f"--object-manager-port={object_manager}",
         f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
         "--min-worker-port=0", "--max-worker-port=0"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait(lambda: httpx.get(f"{url}/api/version", headers=headers,
                                timeout=5).raise_for_status(),
              START_TIMEOUT_S, "the dashboard", proc)
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            yield client, env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own node
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in _pids_naming(temp_dir):  # workers in other process groups
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
        print(Path(log.name).read_text()[-4000:])  # pytest shows it when the test fails
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_chart_serve_config_deploys_with_serve_deploy_and_answers(helm, tmp_path):
    (http_port,) = _free_ports(1)
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

    with ray_head(num_gpus=2) as (dashboard, env):
        deploy = subprocess.run([str(BIN / "serve"), "deploy", "-a", str(dashboard.base_url),
                                 str(config_path)], capture_output=True, text=True,
                                env=env, timeout=120)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr

        def app_running():
            status = dashboard.get("/api/serve/applications/").json()
            app = status["applications"].get("flotilla", {})
            assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), app
            return app.get("status") == "RUNNING"
        _wait(app_running, DEPLOY_TIMEOUT_S, "the Serve app")

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
