"""AppArgs: the one validated argument object of the Serve app (build_app(args)).

The same fields come from `serve run deployments.app:build_app key=value`, from a
`serve build` config file's `args:`, from Python, and from `flotilla serve` flags.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deployments.serve.autoscaling import EngineAutoscaling
from deployments.apis.common.reasoning import REASONING_PARSERS
from deployments.apis.common.tool_calls import TOOL_PARSERS
from engine.config import EngineConfig
from engine.mock.config import MockConfig, MockTiming
from engine.options import Option, dataclass_options, option_kind
from engine.wire.routing import ROUTING_POLICIES

MOCK_MODEL = "mock"
# a streamed response's pace (AppArgs.stream_interval_s): every output as it comes, as
# vLLM streams. Ray Serve LLM's 50 ms did not bring serve run's disconnect storm under 1 s
# on 2 shared cores (bench/disconnect_storm.py, session 43: 1.2-2.6 s at 50 ms, 1.1-1.7 s
# at 100 ms, 1.3-3.8 s at 0): the per-event work was not what held the aborts back
STREAM_INTERVAL_S = 0.0
MOCK_MAX_MODEL_LEN = 4096  # the mock engine's context length when max_model_len is none
# Ray CPUs an engine replica asks for when engine_num_cpus is not set: a model engine
# computes on its CPU; the mock engine only encodes messages, so it asks for almost
# none and `flotilla serve --model mock --data-parallel-size 2` fits a 2-core laptop.
REAL_ENGINE_CPUS = 1.0
MOCK_ENGINE_CPUS = 0.05
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


class IngressAutoscaling(BaseModel):
    """Serve autoscaling of the ingress replicas (they are cheap: tokenize + stream).

    One replica streams tens of thousands of tokens/s (docs/benchmarks.md), so a
    target of 64 ongoing requests per replica keeps the CPU per replica low while
    letting Serve add replicas on bursts; min 1 keeps the API up.
    """

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(64, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    def serve_config(self) -> dict[str, Any]:
        return self.model_dump()


class AppArgs(BaseModel):
    """The app's options. Engine options are EngineConfig's fields and the mock engine's
    are MockTiming's, carried by composition (`engine`, `mock`); they may also be given
    flat, under their own names (`max_num_seqs=128`) and as `mock_<name>`
    (`mock_itl_s=0.02`), which is how `serve run ... key=value`, the Helm values and
    `flotilla serve` flags spell them (flat_options() lists every flat name)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig,
                                 description="the engine options (EngineConfig)")
    mock: MockTiming = Field(default_factory=MockTiming,
                             description="the mock engine's timing (model=mock)")
    served_model_name: str | None = Field(
        None, description="the model name clients send and see; none: derived from model")
    data_parallel_size: int = Field(1, ge=1, le=256, description="engine replicas, one "
                                    "per data-parallel rank (the start count when autoscaled)")
    engine_num_cpus: float | None = Field(
        None, ge=0, description="Ray CPUs per engine replica (per tensor-parallel rank); "
        f"none: {REAL_ENGINE_CPUS:g} for a model, {MOCK_ENGINE_CPUS:g} for the mock engine")
    engine_num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per engine replica "
                                   "(per tensor-parallel rank)")
    placement_strategy: str = Field(
        "STRICT_PACK", description="placement-group strategy of each engine's TP ranks",
        json_schema_extra={"enum": list(PLACEMENT_STRATEGIES)})
    engine_step_timeout_s: float = Field(
        300.0, gt=0, description="an engine whose core loop has completed nothing (a "
        "step, a utility call such as wake_up or add_lora, an input) for this long fails "
        "its health check and Serve replaces it (a hung device, collective or load: its "
        "io thread still answers, so it looked alive)")
    ingress_num_cpus: float = Field(0.5, ge=0, description="Ray CPUs per ingress replica")
    ingress_autoscaling: IngressAutoscaling = Field(
        default_factory=IngressAutoscaling,
        description="Serve autoscaling of the ingress replicas (JSON)")
    engine_autoscaling: EngineAutoscaling | None = Field(
        None, description="engine autoscaling on queue depth and KV usage between its "
        "min_replicas and max_replicas, starting at data_parallel_size (JSON); none: a "
        "fixed data_parallel_size engines")
    api_key: str | None = Field(None, repr=False, description="bearer key of the API; "
                                "none: $FLOTILLA_API_KEY, else open")
    admin_key: str | None = Field(None, repr=False, description="bearer key of the control "
                                  "endpoints; none: $FLOTILLA_ADMIN_KEY")
    dev_mode: bool = Field(False, description="open the control endpoints without an "
                           "admin key (development only)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body "
                                "accepted (bytes)")
    metrics_need_api_key: bool = Field(False, description="/metrics asks for the API key "
                                       "like /v1/* (off: open to scrapers)")
    chat_template: str | None = Field(
        None, description="chat template of /v1/chat/completions: a Jinja file's path or "
        "the template text; none: the tokenizer's (one without a tools section gets "
        "Flotilla's default tool prompt, docs/api.md)")
    tool_call_parser: str = Field(
        "hermes", description="how tool calls are read from the model's text when "
        "tool_choice is auto", json_schema_extra={"enum": list(TOOL_PARSERS)})
    reasoning_parser: str | None = Field(
        None, description="how a reasoning model's thinking is split from its answer in "
        "chat completions (reasoning_content), Responses (reasoning items) and Messages "
        "(thinking blocks), as vLLM's --reasoning-parser: "
        + ", ".join(REASONING_PARSERS) + "; none: not split",
        json_schema_extra={"enum": [*REASONING_PARSERS, None]})
    response_store_max: int = Field(
        10_000, ge=1, description="stored Responses (POST /v1/responses with store) kept "
        "at most, in the coordinator, reachable from every ingress replica; the oldest go "
        "first")
    response_store_ttl_s: float = Field(
        3600.0, gt=0, description="seconds a stored Response is kept")
    response_store_max_bytes: int = Field(
        256 << 20, ge=1, description="bytes of stored Responses kept at most (their JSON, "
        "each holding its conversation so far); the oldest go first")
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="seconds a request may take from arrival when it names no "
        "timeout of its own; past it the request is aborted and answered with 408, so a "
        "wedged engine cannot hold a request for ever (none: no deadline)")
    max_request_timeout_s: float = Field(
        600.0, gt=0, allow_inf_nan=False, description="the longest `timeout` a request may "
        "name; a longer one (or a non-finite one) is refused with 400, so a client cannot "
        "switch its deadline off")
    stream_interval_s: float = Field(
        STREAM_INTERVAL_S, ge=0, le=1, description="a streamed response sends at most one "
        "event per engine output this often: the outputs that arrive meanwhile go out "
        "merged (0: every output as it comes). Each event costs the ingress and Serve's "
        "proxy the same whatever it holds, so under many streams this bounds their work "
        "(Ray Serve LLM batches streams every 50 ms too)")
    routing: str = Field(
        "prefix", description="how an ingress picks the engine of a request: prefix (least "
        "uncached prefill plus queue, from the engines' KV events), least_loaded, or "
        "round_robin", json_schema_extra={"enum": list(ROUTING_POLICIES)})
    mock_force_is_sleeping_rank: int | None = Field(
        None, description="test knob: the mock engine of this rank reports it is asleep")
    mock_force_reset_false_rank: int | None = Field(
        None, description="test knob: the mock engine of this rank refuses prefix-cache "
        "resets")

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        """Move flat engine / mock names into `engine` / `mock`; JSON text is accepted
        for the structured options (`serve run` passes every value as a string)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = _as_dict(data.get("engine"))
        mock = _as_dict(data.get("mock"))
        for name in list(data):
            if name in _ENGINE_FIELDS:
                engine[name] = data.pop(name)
            elif name.startswith("mock_") and name[5:] in _MOCK_FIELDS:
                mock[name[5:]] = data.pop(name)
        for holder, name in [(data, "ingress_autoscaling"), (data, "engine_autoscaling")] + [
                (engine, name) for name in _ENGINE_JSON_FIELDS]:
            if isinstance(holder.get(name), str):
                try:
                    holder[name] = json.loads(holder[name])
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{name}: not valid JSON ({exc.msg})") from None
        data["engine"], data["mock"] = engine, mock
        return data

    @model_validator(mode="after")
    def _checks(self) -> "AppArgs":
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError("tool_call_parser must be " + ", ".join(TOOL_PARSERS))
        reasoning = self.reasoning_parser
        if reasoning is not None and reasoning not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning_parser {reasoning!r}; known: "
                             + ", ".join(REASONING_PARSERS))
        if self.routing not in ROUTING_POLICIES:
            raise ValueError("routing must be " + ", ".join(ROUTING_POLICIES))
        self.chat_template_text()  # a missing template file fails at build time
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError("placement_strategy must be " + ", ".join(PLACEMENT_STRATEGIES))
        scaling = self.engine_autoscaling
        if scaling is not None and not (scaling.min_replicas <= self.data_parallel_size
                                        <= scaling.max_replicas):
            raise ValueError("data_parallel_size (the initial engine count) must be within "
                             "engine_autoscaling.min_replicas..max_replicas")
        if self.ingress_autoscaling.min_replicas > self.ingress_autoscaling.max_replicas:
            raise ValueError("ingress_autoscaling.min_replicas > max_replicas")
        if (self.request_timeout_s is not None
                and self.request_timeout_s > self.max_request_timeout_s):
            raise ValueError("request_timeout_s must not exceed max_request_timeout_s")
        if not self.is_mock:
            self._check_tensor_parallel()
        return self

    def _check_tensor_parallel(self) -> None:
        """Heads that do not divide by tensor_parallel_size fail at build time when the
        model is readable here (else the engine replica reports it when it starts)."""
        if self.tensor_parallel_size == 1:
            return
        from engine.errors import FlotillaError
        from engine.executor.parallel import check_divisible
        from engine.model.shape import ModelShape
        from engine.model.loader import load_hf_config, resolve_model
        try:
            shape = ModelShape.from_hf_config(load_hf_config(resolve_model(self.engine.model)))
        except (FlotillaError, OSError):
            return  # not on this machine (e.g. only on the GPU workers)
        try:
            check_divisible(shape, self.tensor_parallel_size)
        except FlotillaError as exc:
            raise ValueError(str(exc)) from None

    def chat_template_text(self) -> str | None:
        """chat_template as Jinja text: a file's content when it names one."""
        value = self.chat_template
        if value is None or "{{" in value or "{%" in value:
            return value
        try:
            with open(os.path.expanduser(value), encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise ValueError(f"chat_template: cannot read {value!r} ({exc.strerror}); give "
                             "a Jinja file's path or the template text") from None

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.tensor_parallel_size

    @property
    def engine_cpus(self) -> float:
        """Ray CPUs per engine replica (per TP rank): engine_num_cpus, else a default that
        fits what the engine uses: a model computes, the mock engine barely does."""
        if self.engine_num_cpus is not None:
            return self.engine_num_cpus
        return MOCK_ENGINE_CPUS if self.is_mock else REAL_ENGINE_CPUS

    def engine_bundles(self) -> list[dict[str, float]] | None:
        """Placement-group bundles of one engine replica: one per TP rank.
        None when the engine asks for no resources (tests give it 0 CPUs)."""
        bundle = {k: v for k, v in (("CPU", self.engine_cpus),
                                    ("GPU", self.engine_num_gpus)) if v > 0}
        return [bundle] * self.tensor_parallel_size if bundle else None

    def keys(self) -> tuple[str | None, str | None]:
        """(api_key, admin_key): the args' values, else $FLOTILLA_API_KEY and
        $FLOTILLA_ADMIN_KEY of the replica's process. Keys from the environment (a
        Kubernetes Secret, say) stay out of the Serve config that Ray stores and shows."""
        from deployments.serve_keys import KEY_ENV
        return (self.api_key or os.environ.get(KEY_ENV["api_key"]) or None,
                self.admin_key or os.environ.get(KEY_ENV["admin_key"]) or None)

    def check_fits(self, cluster: dict[str, float]) -> None:
        """Raise a clear ValueError when a fixed-size cluster (`cluster`: Ray's total
        resources) cannot hold the starting engines: their placement groups would wait
        forever. Clusters with an autoscaler add nodes instead; do not call it there."""
        engines, tp = self.data_parallel_size, self.tensor_parallel_size
        need = {"CPU": engines * tp * self.engine_cpus
                + self.ingress_autoscaling.min_replicas * self.ingress_num_cpus,
                "GPU": engines * tp * self.engine_num_gpus}
        short = [f"{need[k]:g} {k}s, the cluster has {cluster.get(k, 0):g}"
                 for k in need if need[k] > cluster.get(k, 0) + 1e-9]
        if short:
            raise ValueError(
                f"{engines} engine(s) x tensor_parallel_size {tp} need " + "; ".join(short)
                + " (lower data_parallel_size / tensor_parallel_size / engine_num_cpus / "
                  "engine_num_gpus, or add nodes)")

    @property
    def max_engines(self) -> int:
        """The most engine replicas (data-parallel ranks) this app may run."""
        if self.engine_autoscaling is not None:
            return max(self.engine_autoscaling.max_replicas, self.data_parallel_size)
        return self.data_parallel_size

    @property
    def is_mock(self) -> bool:
        return self.engine.model == MOCK_MODEL

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model
        return "SmolLM2-135M-Instruct" if model == "default" else model

    def engine_config(self, rank: int) -> EngineConfig:
        """The engine options of data-parallel rank `rank`: its own sampling seed."""
        return dataclasses.replace(self.engine, seed=self.engine.seed + rank)

    def mock_config(self, rank: int, vocab_size: int) -> MockConfig:
        """The mock engine of rank `rank`: the timing options plus the engine options
        that mean the same (block size, batch size, context length, seed)."""
        engine = self.engine
        return MockConfig(
            **dataclasses.asdict(self.mock), engine_index=rank, vocab_size=vocab_size,
            seed=engine.seed, block_size=engine.block_size, max_num_seqs=engine.max_num_seqs,
            enable_prefix_caching=engine.enable_prefix_caching,
            max_model_len=engine.max_model_len or MOCK_MAX_MODEL_LEN,
            force_is_sleeping=True if rank == self.mock_force_is_sleeping_rank else None,
            force_reset_prefix_cache=False if rank == self.mock_force_reset_false_rank
            else None)


def parse_app_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    """AppArgs from a dict (flat or nested names), or ValueError with one clear line:
    `field: problem; field: problem`."""
    if isinstance(args, AppArgs):
        return args
    try:
        return AppArgs.model_validate(dict(args or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'args'}: "
            f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        raise ValueError(f"invalid Flotilla app args: {problems}") from None


def _as_dict(value: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return dict(value or {})


def flat_options() -> list[Option]:
    """Every option of the app under its flat name (`max_num_seqs`, `mock_itl_s`,
    `data_parallel_size`, ...): the names of `serve run ... key=value`, of the Helm
    chart's `app:` values and, dashed, of `flotilla serve`'s flags."""
    own = []
    for name, info in AppArgs.model_fields.items():
        if name in ("engine", "mock"):
            continue
        kind, nullable = option_kind(info.annotation)
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        own.append(Option(name, kind, default, info.description or "", nullable))
    return (dataclass_options(EngineConfig) + own
            + dataclass_options(MockTiming, prefix="mock_"))


_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_ENGINE_JSON_FIELDS = frozenset(o.name for o in dataclass_options(EngineConfig)
                                if o.kind is dict)
_MOCK_FIELDS = frozenset(f.name for f in dataclasses.fields(MockTiming))
