"""The engine autoscaling policy on hand-built Serve contexts (no Ray cluster, no clock)."""
from __future__ import annotations

import pytest
from ray._common.utils import import_attr
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.serve.autoscaling import (
    KV_USAGE_KEY,
    RUNNING_KEY,
    WAITING_KEY,
    EngineAutoscaling,
    EngineQueuePolicy,
    autoscaling_stats,
)

DEPLOYMENT = DeploymentID(name="EngineServer", app_name="flotilla")
SETTINGS = EngineAutoscaling()  # target 4 waiting, 0.8 KV, up after 30 s, down after 120 s
T0 = 1_000.0


def replica(i: int) -> ReplicaID:
    return ReplicaID(unique_id=f"engine-{i}", deployment_id=DEPLOYMENT)


def context(waiting: list[float] | None, kv: list[float] | None = None, *, target: int = 2,
            now: float = T0, state: dict | None = None, min_replicas: int = 1,
            max_replicas: int = 4) -> AutoscalingContext:
    """A context as Serve's controller builds it; waiting/kv are per running engine
    (None: no engine has reported yet)."""
    engines = [replica(i) for i in range(len(waiting if waiting is not None else []))]
    metrics = None
    if waiting is not None:
        kv = kv if kv is not None else [0.0] * len(waiting)
        metrics = {WAITING_KEY: dict(zip(engines, waiting)),
                   RUNNING_KEY: {r: 1.0 for r in engines},
                   KV_USAGE_KEY: dict(zip(engines, kv))}
    config = AutoscalingConfig(**EngineAutoscaling(min_replicas=min_replicas,
                                                   max_replicas=max_replicas).serve_config())
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name, current_num_replicas=len(engines),
        target_num_replicas=target, running_replicas=engines, total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas, policy_state=dict(state or {}),
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config)


def run(policy, ticks: list[tuple[float, dict]], target: int = 2, **kw) -> list[int]:
    """Feed the policy a sequence of (time, {"waiting": [...], "kv": [...]}) ticks the way
    Serve does: the state it returns comes back on the next tick, and a decision becomes
    the new target."""
    state: dict = {}
    decisions = []
    for now, load in ticks:
        n, state = policy(context(load["waiting"], load.get("kv"), target=target, now=now,
                                  state=state, **kw))
        decisions.append(n)
        target = n
    return decisions


def test_stays_at_current_with_no_load():
    policy = SETTINGS.policy()
    n, state = policy(context([0.0, 0.0], [0.5, 0.5], target=2))
    assert n == 2
    assert run(policy, [(T0 + t, {"waiting": [1.0, 2.0], "kv": [0.5, 0.5]})
                        for t in range(0, 600, 10)]) == [2] * 60


def test_no_metrics_keeps_the_current_count():
    policy = SETTINGS.policy()
    assert policy(context(None, target=3))[0] == 3
    assert policy(context([], target=3))[0] == 3
    assert policy.desired_replicas(context(None, target=3)) is None


def test_waiting_requests_scale_up_after_the_upscale_delay_not_before():
    busy = {"waiting": [10.0, 10.0]}  # 20 waiting, 4 per engine wanted: 5 engines
    decisions = run(SETTINGS.policy(), [(T0, busy), (T0 + 10, busy), (T0 + 29.5, busy),
                                        (T0 + 30, busy)], max_replicas=8)
    assert decisions == [2, 2, 2, 5]


def test_a_short_burst_does_not_scale_up():
    busy, idle = {"waiting": [10.0, 10.0]}, {"waiting": [0.0, 0.0], "kv": [0.3, 0.3]}
    decisions = run(SETTINGS.policy(), [(T0, busy), (T0 + 20, idle), (T0 + 25, busy),
                                        (T0 + 50, busy), (T0 + 55, busy)])
    assert decisions == [2, 2, 2, 2, 4]  # the wish restarted at T0 + 25; capped at max 4


def test_a_small_excess_adds_one_engine():
    n, _ = SETTINGS.policy()(context([5.0, 4.0], target=2, state={}, now=T0))
    policy = EngineQueuePolicy(upscale_delay_s=0.0)
    assert n == 2 and policy(context([5.0, 4.0], target=2))[0] == 3


def test_high_kv_cache_usage_scales_up():
    policy = EngineQueuePolicy(upscale_delay_s=0.0)
    # no waiting, but the caches are 95% full: 1.9 / 0.8 -> 3 engines
    assert policy(context([0.0, 0.0], [0.95, 0.95], target=2))[0] == 3
    assert policy(context([0.0, 0.0], [0.8, 0.8], target=2))[0] == 2  # at target: stay
    hot = {"waiting": [0.0], "kv": [0.99]}
    assert run(SETTINGS.policy(), [(T0, hot), (T0 + 30, hot)], target=1) == [1, 2]


def test_an_engine_still_loading_is_not_asked_for_twice():
    policy = EngineQueuePolicy(upscale_delay_s=0.0)
    # target 3, only 2 engines report yet, modestly overloaded: the third is on its way
    assert policy(context([5.0, 5.0], target=3))[0] == 3


def test_idle_engines_scale_down_after_the_downscale_delay_one_at_a_time():
    idle = {"waiting": [0.0, 0.0, 0.0], "kv": [0.05, 0.05, 0.0]}
    decisions = run(SETTINGS.policy(), [(T0, idle), (T0 + 60, idle), (T0 + 119, idle),
                                        (T0 + 120, idle), (T0 + 130, idle), (T0 + 250, idle)],
                    target=3)
    assert decisions == [3, 3, 3, 2, 2, 1]


def test_no_scale_down_while_anything_waits_or_the_rest_would_be_busy():
    policy = EngineQueuePolicy(downscale_delay_s=0.0)
    assert policy(context([0.0, 1.0], [0.05, 0.05], target=2))[0] == 2  # one waits
    # 0.45 of KV on one engine is above half the 0.8 target
    assert policy(context([0.0, 0.0], [0.25, 0.2], target=2))[0] == 2
    assert policy(context([0.0, 0.0], [0.2, 0.15], target=2))[0] == 1


def test_never_below_min_replicas():
    idle = {"waiting": [0.0, 0.0], "kv": [0.0, 0.0]}
    assert run(SETTINGS.policy(), [(T0 + t, idle) for t in range(0, 1000, 50)],
               min_replicas=2) == [2] * 20
    assert run(SETTINGS.policy(), [(T0 + t, {"waiting": [0.0], "kv": [0.0]})
                                   for t in range(0, 1000, 50)], target=1) == [1] * 20


def test_never_above_max_replicas():
    policy = EngineQueuePolicy(upscale_delay_s=0.0)
    assert policy(context([500.0, 500.0], [1.0, 1.0], target=2, max_replicas=3))[0] == 3
    assert policy(context([500.0] * 3, target=3, max_replicas=3))[0] == 3
    flood = {"waiting": [100.0, 100.0], "kv": [1.0, 1.0]}
    assert max(run(SETTINGS.policy(), [(T0 + t, flood) for t in range(0, 300, 10)])) == 4


def test_serves_own_state_keys_pass_through():
    state = {"__decision_counters": 0, "__decision_timestamp": None}
    _, out = SETTINGS.policy()(context([10.0, 10.0], state=state))
    assert out["__decision_counters"] == 0 and "__decision_timestamp" in out


def test_settings_validate():
    with pytest.raises(ValueError):
        EngineAutoscaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        EngineAutoscaling(min_replicas=0)  # engines get no handle traffic to wake them
    with pytest.raises(ValueError):
        EngineAutoscaling(target_kv_cache_usage=1.5)
    with pytest.raises(ValueError):
        EngineQueuePolicy(target_waiting_per_engine=0)


def test_serve_config_validates_and_points_at_the_policy():
    settings = EngineAutoscaling(max_replicas=6, target_waiting_per_engine=2.0,
                                 downscale_delay_s=300.0)
    d = settings.serve_config(initial_replicas=2)
    config = AutoscalingConfig(**d)
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 6, 2)
    assert config.upscale_delay_s == 0 and config.downscale_delay_s == 0  # the policy's job
    assert import_attr(d["policy"]["policy_function"]) is EngineQueuePolicy
    assert config.policy.policy_kwargs == settings.policy_kwargs()
    assert settings.serve_config(initial_replicas=10)["initial_replicas"] == 6
    # what the controller runs: the cloudpickled class, built with the kwargs
    policy = config.policy.get_policy()(**config.policy.policy_kwargs)
    assert policy.target_waiting_per_engine == 2.0 and policy.downscale_delay_s == 300.0
    assert policy(context([3.0, 3.0], target=2, max_replicas=6, state={
        "flotilla_engine_scale_direction": "up",
        "flotilla_engine_scale_since": T0 - 30}))[0] == 3


def test_serves_wrapper_adds_no_second_delay():
    """Ray 2.60 wraps custom policies with its own delay logic (private API): with the
    delays serve_config() sets, our decision passes through on the tick it is made."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    wrapped = _apply_autoscaling_config(EngineQueuePolicy(upscale_delay_s=0.0))
    n, _ = wrapped(context([10.0, 10.0], target=2))
    assert n == 4


def test_engine_stats_become_float_metrics():
    class Stats:
        num_waiting_reqs, num_running_reqs, kv_cache_usage = 3, 7, 0.25
    assert autoscaling_stats(Stats()) == {WAITING_KEY: 3.0, RUNNING_KEY: 7.0,
                                          KV_USAGE_KEY: 0.25}
    assert all(type(v) is float for v in autoscaling_stats(Stats()).values())
