"""The Serve app's arguments and the config files users deploy it with (no Ray cluster)."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.app import build_app


def test_bad_args_get_a_clear_error():
    with pytest.raises(ValueError, match="data_parallel_size"):
        build_app({"data_parallel_size": 0})
    with pytest.raises(ValueError, match="not_a_field"):
        build_app({"not_a_field": 1})
    with pytest.raises(ValueError, match="block_size"):
        build_app({"block_size": 12})


def test_serve_build_writes_a_deployable_config(tmp_path):
    from ray.serve.schema import ServeDeploySchema
    out = tmp_path / "serve.yaml"
    serve_cli = Path(sys.executable).with_name("serve")
    subprocess.run([str(serve_cli), "build", "deployments.app:app", "-o", str(out)],
                   check=True, capture_output=True, timeout=120)
    config = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(config)
    names = {d["name"] for d in config["applications"][0]["deployments"]}
    assert names == {"Coordinator", "EngineServer", "OpenAIIngress"}
    # the same file configured through the builder's args
    config["applications"][0].update(import_path="deployments.app:build_app",
                                     args={"model": "mock", "data_parallel_size": 2})
    parsed = ServeDeploySchema.model_validate(config)
    assert parsed.applications[0].args == {"model": "mock", "data_parallel_size": 2}


def test_the_coordinator_takes_every_concurrent_call():
    """Slow utility calls (waiting on engines) must not take the slots that the engines'
    heartbeats and registrations and the ingress's membership polls need."""
    from deployments.serve.coordinator import Coordinator
    assert Coordinator.max_ongoing_requests >= 1000


def test_engine_placement_bundles_follow_resources():
    from deployments.config import AppArgs
    assert AppArgs(engine_num_cpus=0).engine_bundles() is None
    assert AppArgs(engine_num_cpus=2).engine_bundles() == [{"CPU": 2}]
    assert AppArgs(engine_num_cpus=1, engine_num_gpus=1).engine_bundles() == [
        {"CPU": 1, "GPU": 1}]
    with pytest.raises(ValueError, match="placement_strategy"):
        build_app({"placement_strategy": "ANYWHERE"})
    assert AppArgs(model="mock", tensor_parallel_size=2, engine_num_cpus=1,
                   engine_num_gpus=1).engine_bundles() == [{"CPU": 1, "GPU": 1}] * 2


def test_tensor_parallel_size_must_divide_the_model(tiny_llama):
    from deployments.config import AppArgs
    assert AppArgs(model=str(tiny_llama), tensor_parallel_size=2).engine_config(0) \
        .tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        build_app({"model": str(tiny_llama), "tensor_parallel_size": 3})


def test_keys_come_from_args_else_the_replica_environment(monkeypatch):
    from deployments.config import AppArgs
    monkeypatch.delenv("FLOTILLA_API_KEY", raising=False)
    monkeypatch.delenv("FLOTILLA_ADMIN_KEY", raising=False)
    assert AppArgs(model="mock").keys() == (None, None)
    monkeypatch.setenv("FLOTILLA_API_KEY", "from-secret")
    monkeypatch.setenv("FLOTILLA_ADMIN_KEY", "admin-secret")
    assert AppArgs(model="mock").keys() == ("from-secret", "admin-secret")
    assert AppArgs(model="mock", api_key="explicit").keys() == ("explicit", "admin-secret")
    # the key is not copied into the args that Serve stores
    assert "from-secret" not in str(AppArgs(model="mock").model_dump())


def test_engine_autoscaling_replaces_the_fixed_replica_count():
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.config import AutoscalingConfig

    from deployments.config import AppArgs
    app = build_app({"model": "mock", "data_parallel_size": 2,
                     "engine_autoscaling": {"min_replicas": 1, "max_replicas": 3}})
    deployments = {d.name: d for d in serve_build(app, name="x").deployments}
    scaling = deployments["EngineServer"]._deployment_config.autoscaling_config
    assert scaling is not None and scaling.policy.policy_function.endswith("EngineQueuePolicy")
    config = AutoscalingConfig(**scaling.model_dump())
    assert (config.min_replicas, config.initial_replicas, config.max_replicas) == (1, 2, 3)
    assert AppArgs(model="mock", data_parallel_size=2,
                   engine_autoscaling={"max_replicas": 5}).max_engines == 5
    fixed = build_app({"model": "mock", "data_parallel_size": 2})
    fixed_engines = {d.name: d for d in serve_build(fixed, name="y").deployments}["EngineServer"]
    assert fixed_engines._deployment_config.autoscaling_config is None
    assert fixed_engines._deployment_config.num_replicas == 2
    with pytest.raises(ValueError, match="initial engine count"):
        build_app({"model": "mock", "data_parallel_size": 4,
                   "engine_autoscaling": {"max_replicas": 3}})


def test_engines_that_cannot_fit_a_fixed_cluster_get_a_clear_error():
    from deployments.config import AppArgs
    args = AppArgs(model="mock", data_parallel_size=2, tensor_parallel_size=2,
                   engine_num_cpus=1, engine_num_gpus=1, ingress_num_cpus=0.5)
    args.check_fits({"CPU": 4.5, "GPU": 4})  # exactly enough
    with pytest.raises(ValueError, match="need 4 GPUs, the cluster has 2"):
        args.check_fits({"CPU": 16, "GPU": 2})
    with pytest.raises(ValueError, match="need 4.5 CPUs, the cluster has 2"):
        args.check_fits({"CPU": 2, "GPU": 8})


def test_ingress_replicas_start_with_an_allocator_that_gives_memory_back(monkeypatch):
    from ray.serve._private.build_app import build_app as serve_build
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the operator's own value is kept
    deployments = {d.name: d for d in serve_build(build_app({"model": "mock"}),
                                                  name="x").deployments}
    ingress = deployments["OpenAIIngress"].ray_actor_options
    assert ingress["runtime_env"]["env_vars"] == {"PYTHONMALLOC": "malloc",
                                                  "MALLOC_MMAP_THRESHOLD_": "65536"}
    assert "runtime_env" not in deployments["EngineServer"].ray_actor_options
