"""Engine autoscaling end to end on a fake multi-node Ray cluster.

`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=<fake_multinode config>`
runs the Ray autoscaler (v1) with Ray's fake_multinode provider: it "launches" a node
by starting another raylet on this machine with the node type's resources. Here the
head has no GPU and a `flotilla_head` resource that pins the ingress and the
coordinator to it; the GPU worker type is {CPU: 1, GPU: 1} with min_workers 0 and
max_workers 2, so every engine replica (engine_num_gpus=1) needs a fake GPU node.

The test deploys the app with `serve deploy` (model=mock, max_num_seqs 4, 50 ms per
token, engine_autoscaling 1..2), then:

1. heavy streaming load (more concurrent requests than one engine runs): requests
   wait in the engine, the engine policy asks for a second engine, the autoscaler
   adds a second fake GPU node for it, the new rank registers and receives traffic;
2. light load (fewer requests than one engine's batch: nothing waits): the policy
   removes one engine while requests still stream; it drains first;
3. no load: the autoscaler removes the idle fake GPU node.

Every request of every phase must succeed. The scale-up and scale-down times are
printed (run with -s); only generous timeouts bound them.

The head is our own (private --temp-dir, free ports, its own auth token) and is ended
as tests/e2e/test_serve_deploy.py ends its own, never with `ray stop`. Set
FLOTILLA_KEEP_RAY_TEMP=1 to keep its temp dir (the Ray and Serve logs) for debugging.
"""
from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.e2e.ray_head import free_ports, ray_head, serve_deploy, wait_for

DEPLOY_TIMEOUT_S = 240
SCALE_TIMEOUT_S = 150
HEAD_RESOURCE = "flotilla_head"
GPU_NODE_TYPE = "ray.worker.gpu"

MAX_TOKENS = 16
HEAVY_CONCURRENCY = 16  # one engine runs max_num_seqs=4: 12 wait
LIGHT_CONCURRENCY = 2  # fits one engine's batch: nothing waits

APP_ARGS = {
    "model": "mock", "served_model_name": "mock",
    "data_parallel_size": 1,  # the initial engine count
    "engine_num_gpus": 1, "engine_num_cpus": 0, "ingress_num_cpus": 0,
    "ingress_autoscaling": {"min_replicas": 1, "max_replicas": 1},
    "max_num_seqs": 4, "mock_itl_s": 0.05,  # a request of 16 tokens takes ~0.8 s
    "engine_autoscaling": {"min_replicas": 1, "max_replicas": 2,
                           "target_waiting_per_engine": 2, "upscale_delay_s": 0,
                           "downscale_delay_s": 5, "look_back_period_s": 12},
}


def fake_cluster_config(gcs_address: str, head_cpus: int) -> dict:
    """A fake_multinode autoscaler config (the fields of Ray's fake_multi_node
    example.yaml, which the Ray 2.60 wheel does not ship)."""
    return {
        "cluster_name": "flotilla-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,  # 6 s: fake nodes go away quickly
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,  # else the provider assumes <node ip>:6379
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "head_node_type": "ray.head.default",
        "available_node_types": {
            # must match what `ray start --head` registers (the autoscaler cannot set it)
            "ray.head.default": {"resources": {"CPU": head_cpus, HEAD_RESOURCE: 1},
                                 "node_config": {}, "max_workers": 0},
            GPU_NODE_TYPE: {"resources": {"CPU": 1, "GPU": 1,
                                          "object_store_memory": 100 * 1024 * 1024},
                            "node_config": {}, "min_workers": 0, "max_workers": 2},
        },
        # not used by the fake provider, but the autoscaler reads them
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def serve_config(http_port: int) -> dict:
    # the ingress and the coordinator ask for no CPU: pin them to the head, so that the
    # GPU nodes hold engines only and go away once their engine does
    pinned = {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [{
            "name": "flotilla", "route_prefix": "/",
            "import_path": "deployments.app:build_app", "args": APP_ARGS,
            "deployments": [{"name": "Coordinator", "ray_actor_options": pinned},
                            {"name": "OpenAIIngress", "ray_actor_options": pinned}],
        }],
    }


@contextlib.contextmanager
def fake_cluster_head(config_path: Path, head_cpus: int, gcs: int):
    """`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...` of our own; yields
    (dashboard client, env for Ray CLIs, temp dir). On exit it also prints the
    autoscaler's launch/terminate events (shown when the test fails)."""
    def autoscaler_events(temp_dir: str) -> None:
        for path in sorted(Path(temp_dir).glob("session_*/logs/monitor.log")):
            events = [line for line in path.read_text(errors="replace").splitlines()
                      if re.search(r"Launching|Terminating|Removing|idle|ERROR|Error", line)]
            print("--- autoscaler events\n" + "\n".join(events[-40:]))

    with ray_head([f"--autoscaling-config={config_path}", f"--num-cpus={head_cpus}",
                   "--num-gpus=0", f"--resources={json.dumps({HEAD_RESOURCE: 1})}"],
                  extra_env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"},
                  gcs_port=gcs, before_cleanup=autoscaler_events) as head:
        yield head


# ---- load ---------------------------------------------------------------------------
@dataclass
class Load:
    """Streaming completions from `concurrency` threads until stopped; every request
    must stream MAX_TOKENS tokens and end with usage and [DONE], without an error."""

    base_url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    concurrency: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_concurrency(self, n: int) -> None:
        self.concurrency = n
        while len(self._threads) < n:
            t = threading.Thread(target=self._worker, args=(len(self._threads),), daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _worker(self, i: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            while not self._stop.is_set():
                if i >= self.concurrency:
                    time.sleep(0.1)
                    continue
                problem = self._one(http, i)
                with self._lock:
                    if problem is None:
                        self.ok += 1
                    else:
                        self.failures.append(problem)

    @staticmethod
    def _one(http: httpx.Client, i: int) -> str | None:
        body = {"model": "mock", "prompt": f"load {i}", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read()[:300]!r}"
                events = [line[len("data: "):] for line in r.iter_lines()
                          if line.startswith("data: ")]
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if not events or events[-1] != "[DONE]":
            return f"no [DONE]: {events[-2:]}"
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        if errors:
            return f"error event: {errors[0]}"
        usage = chunks[-1].get("usage") or {}
        if usage.get("completion_tokens") != MAX_TOKENS:
            return f"usage {usage}"
        return None


# ---- cluster state ------------------------------------------------------------------
def engine_replica_list(dash: httpx.Client) -> list[dict]:
    r = dash.get("/api/serve/applications/")
    r.raise_for_status()
    app = r.json()["applications"].get("flotilla", {})
    return app.get("deployments", {}).get("EngineServer", {}).get("replicas", [])


def engine_replicas(dash: httpx.Client) -> dict[str, int]:
    """Replica states of the EngineServer deployment -> counts."""
    counts: dict[str, int] = {}
    for r in engine_replica_list(dash):
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    return counts


def gpu_nodes(dash: httpx.Client) -> list[str]:
    """Ids of the alive nodes that have a GPU (the fake GPU workers)."""
    r = dash.get("/api/v0/nodes", params={"detail": "1", "limit": "100"})
    r.raise_for_status()
    nodes = r.json()["data"]["result"]["result"]
    return [n["node_id"] for n in nodes
            if n["state"] == "ALIVE" and n.get("resources_total", {}).get("GPU", 0) > 0]


_ENGINE_LINE = re.compile(r'^vllm:num_requests_running\{.*engine="(\d+)".*\} (\S+)$')
_INFO_LINE = re.compile(r'^vllm:cache_config_info\{.*engine="(\d+)"')


def ingress_engines(http: httpx.Client) -> tuple[set[str], dict[str, float]]:
    """(engines the ingress routes to, running requests per engine) from /metrics."""
    r = http.get("/metrics")
    r.raise_for_status()
    text = r.text
    engines = {m.group(1) for line in text.splitlines() if (m := _INFO_LINE.match(line))}
    running = {}
    for line in text.splitlines():
        m = _ENGINE_LINE.match(line)
        if m:
            running[m.group(1)] = float(m.group(2))
    return engines, running


def test_ingress_admits_more_streams_than_its_autoscaling_target():
    """Serve's default max_ongoing_requests (5) capped every ingress replica at 5
    streams: the proxy queued the rest, the engines never saw them waiting, and engine
    autoscaling never triggered (nor could the ingress target of 64 be reached)."""
    from ray.serve._private.build_app import build_app as serve_build

    from deployments.app import build_app
    for target in (64, 8):
        app = build_app({**APP_ARGS, "ingress_autoscaling": {"target_ongoing_requests": target}})
        ingress = {d.name: d for d in serve_build(app, name="x").deployments}["OpenAIIngress"]
        config = ingress._deployment_config
        assert config.max_ongoing_requests > target
        assert config.max_ongoing_requests >= HEAVY_CONCURRENCY


def test_engines_and_fake_gpu_nodes_scale_up_and_down_without_failed_requests(tmp_path):
    from ray.autoscaler._private.util import validate_config

    head_cpus = 2
    gcs, http_port = free_ports(2)
    cluster = fake_cluster_config(f"127.0.0.1:{gcs}", head_cpus)
    validate_config(cluster)  # Ray's own schema check of the autoscaling config
    cluster_path = tmp_path / "fake_cluster.yaml"
    cluster_path.write_text(yaml.safe_dump(cluster))
    serve_path = tmp_path / "serve.yaml"
    serve_path.write_text(yaml.safe_dump(serve_config(http_port)))
    base_url = f"http://127.0.0.1:{http_port}"
    times: dict[str, float] = {}
    t_start = time.monotonic()

    with fake_cluster_head(cluster_path, head_cpus, gcs) as (dash, env, _), \
            httpx.Client(base_url=base_url, timeout=30) as http:
        serve_deploy(dash, env, serve_path, DEPLOY_TIMEOUT_S,
                     "the Serve app (its first fake GPU node)")
        times["deploy_s"] = time.monotonic() - t_start
        # the first engine runs on the first fake GPU node (the head has no GPU)
        assert len(gpu_nodes(dash)) == 1
        assert engine_replicas(dash) == {"RUNNING": 1}
        assert Load._one(http, 0) is None  # the ingress connects on its first request
        assert ingress_engines(http)[0] == {"0"}

        load = Load(base_url)
        try:
            # 1. heavy load: a second engine on a second fake GPU node
            t0 = time.monotonic()
            load.set_concurrency(HEAVY_CONCURRENCY)
            wait_for(lambda: len(gpu_nodes(dash)) == 2, SCALE_TIMEOUT_S, "a second GPU node")
            times["up_node_s"] = time.monotonic() - t0
            wait_for(lambda: engine_replicas(dash) == {"RUNNING": 2}, SCALE_TIMEOUT_S,
                  "two running engine replicas")
            times["up_replica_s"] = time.monotonic() - t0
            # the new rank registered (the ingress routes to two engines) and serves
            wait_for(lambda: (lambda e, r: e == {"0", "1"} and r.get("1", 0) > 0)(
                *ingress_engines(http)), 60, "requests running on the new engine")
            times["up_serving_s"] = time.monotonic() - t0
            assert not load.failures, load.failures[:5]

            # 2. light load: nothing waits, one engine goes while requests stream
            t1 = time.monotonic()
            load.set_concurrency(LIGHT_CONCURRENCY)
            wait_for(lambda: engine_replicas(dash) == {"RUNNING": 1}, SCALE_TIMEOUT_S,
                  "one engine replica again")
            times["down_replica_s"] = time.monotonic() - t1
            wait_for(lambda: len(ingress_engines(http)[0]) == 1, 60,
                  "the ingress's one engine again")
            time.sleep(2)  # more requests on the remaining engine, after the switch
        finally:
            load.stop()
        assert load.failures == [], f"{len(load.failures)} failed: {load.failures[:5]}"
        assert load.ok > 0
        t2 = time.monotonic()

        # 3. no load: the idle fake GPU node goes away; the one engine keeps serving
        wait_for(lambda: len(gpu_nodes(dash)) == 1, SCALE_TIMEOUT_S, "one GPU node again")
        times["down_node_s"] = time.monotonic() - t1
        times["node_after_load_end_s"] = time.monotonic() - t2
        assert engine_replicas(dash) == {"RUNNING": 1}
        # the node that went is the one whose engine went
        assert [r["node_id"] for r in engine_replica_list(dash)] == gpu_nodes(dash)
        assert Load._one(http, 0) is None
        times["requests_ok"] = load.ok + 1
        times["requests_failed"] = len(load.failures)

    times["total_s"] = time.monotonic() - t_start
    print("fake-cluster autoscaling: " + json.dumps({k: round(v, 1) for k, v in times.items()}))
