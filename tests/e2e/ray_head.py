"""A Ray head of the test's own, started with `ray start --head --block`: private temp
dir, free ports, token auth with its own token (not ~/.ray's), and a cleanup that runs
even when the test fails (the head's process group, then every process naming the temp
dir: workers and fake nodes in other process groups)."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

from deployments.serve.local_ray import pids_naming
from engine.wire import ports

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120


def free_ports(n: int) -> list[int]:
    """n distinct ports that bind now, where none of Ray's sockets can take them before
    our server binds them (engine/wire/ports.py says why)."""
    return ports.free_ports("127.0.0.1", n)


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    """Poll predicate until it returns something truthy; HTTP/OS errors count as not yet."""
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
def ray_head(start_args: list[str], extra_env: dict[str, str] | None = None,
             gcs_port: int | None = None, before_cleanup: Callable[[str], None] | None = None
             ) -> Iterator[tuple[httpx.Client, dict[str, str], str]]:
    """Yields (dashboard client, env for Ray CLIs that talk to this head, temp dir).

    start_args: resources and the like (`--num-cpus=2`, `--autoscaling-config=...`).
    before_cleanup(temp_dir) runs before the temp dir is removed (to print logs)."""
    temp_dir = tempfile.mkdtemp(prefix="flotilla-ray-")
    gcs, dashboard, client, node_manager, object_manager, agent_http, agent_grpc, \
        runtime_env, metrics = free_ports(9)
    gcs = gcs_port or gcs
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               OMP_NUM_THREADS="1", **(extra_env or {}))
    headers = {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
    log = open(Path(temp_dir) / "ray-start.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
         f"--temp-dir={temp_dir}", *start_args,
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
        wait_for(lambda: httpx.get(f"{url}/api/version", headers=headers,
                                   timeout=5).raise_for_status(),
                 START_TIMEOUT_S, "the dashboard", proc)
        with httpx.Client(base_url=url, headers=headers, timeout=30) as dash:
            yield dash, env, temp_dir
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
        for pid in pids_naming(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
        print(Path(log.name).read_text()[-3000:])  # pytest shows it when the test fails
        if before_cleanup is not None:
            before_cleanup(temp_dir)
        if os.environ.get("FLOTILLA_KEEP_RAY_TEMP"):
            print(f"kept {temp_dir}")
        else:
            shutil.rmtree(temp_dir, ignore_errors=True)


def serve_deploy(dash: httpx.Client, env: dict[str, str], config_path: Path,
                 timeout_s: float, what: str = "the Serve app") -> None:
    """`serve deploy` a config to this head and wait until the app "flotilla" runs
    (a failed or unhealthy deployment fails at once)."""
    deploy = subprocess.run([str(BIN / "serve"), "deploy", "-a", str(dash.base_url),
                             str(config_path)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr

    def app_running():
        app = dash.get("/api/serve/applications/").json()["applications"].get("flotilla", {})
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        return app.get("status") == "RUNNING"
    wait_for(app_running, timeout_s, what)
