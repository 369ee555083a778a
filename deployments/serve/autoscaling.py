"""Autoscaling of the engine replicas (EngineServer) on queue depth and KV-cache usage.

Serve's default policy counts requests that pass through deployment handles. Engine
traffic does not: the ingress streams to the engines over ZMQ, so the only load an
engine's handle sees is `__call__` and health checks. Each EngineServer therefore
reports its scheduler's load as custom autoscaling metrics (`record_autoscaling_stats`,
see `autoscaling_stats`), and `EngineQueuePolicy` turns them into a replica count:

- add engines when requests wait (mean waiting per engine above a target) or the KV
  caches fill up (mean usage above a target), in proportion to the excess;
- remove one engine at a time, only when nothing waits anywhere and the remaining
  engines would stay under half the KV target;
- hold a wish for `upscale_delay_s` / `downscale_delay_s` before acting on it.

How it plugs into Ray Serve 2.60:

- `autoscaling_config["policy"] = {"policy_function": "module:Name", "policy_kwargs":
  {...}}`. Serve imports the target once where the config is validated, cloudpickles it
  *by value* (the controller never imports this module), and, when the target is a
  class, instantiates it once with `policy_kwargs`; a plain function gets no kwargs.
  That is why the policy is a class: its targets and delays travel as kwargs.
- Serve wraps every custom policy with its own delay logic (the config's
  `upscale_delay_s` / `downscale_delay_s`, timed with the controller's clock) and
  clamps the result to min/max. The policy keeps its own delays, timed with
  `ctx.current_time` so it stays a deterministic function of its context, and
  `EngineAutoscaling.serve_config` sets Serve's delays to 0 so the two never add up.
- The policy is called every control-loop tick with an `AutoscalingContext` and
  returns `(num_replicas, policy_state)`; Serve hands the state back on the next tick.
  Because of the by-value pickling, the policy class uses nothing from this module
  but the helpers and constants below (no pydantic, no Ray).
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Keys of an engine's custom autoscaling metrics (the SchedulerStats field names).
WAITING_KEY = "num_waiting_reqs"
RUNNING_KEY = "num_running_reqs"
KV_USAGE_KEY = "kv_cache_usage"

# Scale down only if the engines left would use under this fraction of the KV target:
# a margin so that the next request burst does not scale straight back up.
DOWNSCALE_KV_FRACTION = 0.5

# How often replicas push metrics to the controller. Serve's default: the field is
# deprecated in 2.60 and any other value logs a DeprecationWarning.
METRICS_INTERVAL_S = 10.0

POLICY_PATH = "deployments.serve.autoscaling:EngineQueuePolicy"

# policy_state keys: the direction of a pending wish and when it began.
_PENDING_KEY = "flotilla_engine_scale_direction"
_SINCE_KEY = "flotilla_engine_scale_since"
_EPS = 1e-9
_DELAY_EPS_S = 1e-6  # elapsed times of large timestamps may round just under a delay


def autoscaling_stats(stats: Any) -> dict[str, float]:
    """The custom autoscaling metrics of one engine, from its SchedulerStats (or any
    object with the same three fields): what EngineServer.record_autoscaling_stats
    returns."""
    return {WAITING_KEY: float(stats.num_waiting_reqs),
            RUNNING_KEY: float(stats.num_running_reqs),
            KV_USAGE_KEY: float(stats.kv_cache_usage)}


def _clamp(n: int, ctx: Any) -> int:
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, n))


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)  # 20 / 4 is 5 engines, not 6 after a rounding error


class EngineQueuePolicy:
    """Serve autoscaling policy for the engines: `policy(ctx) -> (replicas, state)`.

    Reads, per running engine replica, the look-back mean (Serve's aggregation) of
    `num_waiting_reqs` and `kv_cache_usage` from `ctx.aggregated_metrics`. Compares
    against `ctx.target_num_replicas`, the count Serve is already heading for, so an
    engine that is still loading its model is not asked for twice. Pure: no Ray calls,
    no clock but `ctx.current_time`; all memory is in the returned policy_state.
    """

    def __init__(self, target_waiting_per_engine: float = 4.0,
                 target_kv_cache_usage: float = 0.8, upscale_delay_s: float = 30.0,
                 downscale_delay_s: float = 120.0) -> None:
        if target_waiting_per_engine <= 0 or not 0 < target_kv_cache_usage <= 1:
            raise ValueError("target_waiting_per_engine must be > 0 and "
                             "target_kv_cache_usage in (0, 1]")
        if upscale_delay_s < 0 or downscale_delay_s < 0:
            raise ValueError("autoscaling delays must be >= 0")
        self.target_waiting_per_engine = float(target_waiting_per_engine)
        self.target_kv_cache_usage = float(target_kv_cache_usage)
        self.upscale_delay_s = float(upscale_delay_s)
        self.downscale_delay_s = float(downscale_delay_s)

    def desired_replicas(self, ctx: Any) -> int | None:
        """The engine count the current load asks for, before delays and clamped to the
        capacity-adjusted bounds; None when no engine has reported metrics yet."""
        metrics = ctx.aggregated_metrics or {}
        waiting = metrics.get(WAITING_KEY, {})
        kv = metrics.get(KV_USAGE_KEY, {})
        engines = len(set(waiting) | set(kv))
        if engines == 0:
            return None
        target = ctx.target_num_replicas
        total_waiting = sum(waiting.values())
        total_kv = sum(kv.values())
        wanted = target
        # Up: enough engines to bring both means to their targets, at least one more
        # than those running now (running, not target: a loading engine counts as help).
        base = min(engines, target) + 1
        if total_waiting / engines > self.target_waiting_per_engine:
            wanted = max(wanted, base, _ceil(total_waiting / self.target_waiting_per_engine))
        if total_kv / engines > self.target_kv_cache_usage:
            wanted = max(wanted, base, _ceil(total_kv / self.target_kv_cache_usage))
        # Down: one at a time, when idle enough that the rest stay far from the targets.
        if wanted == target and target > 1 and total_waiting <= 0 and \
                total_kv / (target - 1) < DOWNSCALE_KV_FRACTION * self.target_kv_cache_usage:
            wanted = target - 1
        return _clamp(wanted, ctx)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        previous = ctx.policy_state or {}
        state = {k: v for k, v in previous.items()
                 if k not in (_PENDING_KEY, _SINCE_KEY)}  # Serve's own keys pass through
        current = _clamp(ctx.target_num_replicas, ctx)
        wanted = self.desired_replicas(ctx)
        now = ctx.current_time
        if wanted is None or wanted == current or now is None:
            return current, state
        direction = "up" if wanted > current else "down"
        since = previous.get(_SINCE_KEY)
        if previous.get(_PENDING_KEY) != direction or since is None:
            since = now  # a new wish (or a reversed one): its delay starts now
        delay = self.upscale_delay_s if direction == "up" else self.downscale_delay_s
        if now - since + _DELAY_EPS_S >= delay:
            return wanted, state
        return current, {**state, _PENDING_KEY: direction, _SINCE_KEY: since}


class EngineAutoscaling(BaseModel):
    """Autoscaling settings of the engine replicas (one engine = one data-parallel rank).

    Defaults, and why:
    - min_replicas 1: the API needs an engine; Serve cannot wake a scaled-to-zero
      engine because engine traffic bypasses Serve's handles (so min >= 1).
    - max_replicas 4: a bound on GPUs one app may take; raise it with the cluster.
    - target_waiting_per_engine 4: waiting requests are ones the scheduler could not
      admit (batch or KV cache full); a few per engine is a short queue, a steady
      excess means every engine is saturated and another one would admit them.
    - target_kv_cache_usage 0.8: above it the scheduler starts to preempt and queue;
      add an engine before that rather than after.
    - upscale_delay_s 30: a new engine costs a model load (tens of seconds or more),
      so bursts shorter than that are over before it could help.
    - downscale_delay_s 120: slower than upscaling, since removing an engine that is
      needed again soon pays the model load twice.
    - look_back_period_s 30: each engine's metrics are averaged over this window
      (pushed every METRICS_INTERVAL_S), smoothing single-step spikes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_waiting_per_engine: float = Field(4.0, gt=0)
    target_kv_cache_usage: float = Field(0.8, gt=0, le=1)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=METRICS_INTERVAL_S)

    @model_validator(mode="after")
    def _bounds(self) -> "EngineAutoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError("engine autoscaling: min_replicas > max_replicas")
        return self

    def policy_kwargs(self) -> dict[str, float]:
        return {"target_waiting_per_engine": self.target_waiting_per_engine,
                "target_kv_cache_usage": self.target_kv_cache_usage,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s}

    def policy(self) -> EngineQueuePolicy:
        """The policy object Serve builds from serve_config()'s policy entry."""
        return EngineQueuePolicy(**self.policy_kwargs())

    def serve_config(self, initial_replicas: int | None = None) -> dict[str, Any]:
        """The EngineServer deployment's `autoscaling_config` (plain JSON values, so it
        also fits a `serve build` file). Serve's own delays are 0: the policy applies
        upscale_delay_s / downscale_delay_s itself (see the module docstring).
        `initial_replicas` (e.g. the app's data_parallel_size) is clamped to the bounds."""
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": self.look_back_period_s,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": self.policy_kwargs()},
        }
        if initial_replicas is not None:
            config["initial_replicas"] = max(self.min_replicas,
                                             min(self.max_replicas, initial_replicas))
        return config
