"""AppArgs: the one validated argument object of the Serve app (build_app(args)).

The same fields come from `serve run deployments.app:build_app key=value`, from a
`serve build` config file's `args:`, from Python, and from `flotilla serve` flags.
"""
from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.autoscaling import EngineAutoscaling
from engine.config import EngineConfig
from engine.mock import MockConfig

MOCK_MODEL = "mock"


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
    model_config = ConfigDict(extra="forbid")

    model: str = "default"  # a checkpoint dir, a .gguf file, "default", or "mock"
    served_model_name: str | None = None
    data_parallel_size: int = Field(1, ge=1, le=256)
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    engine_num_cpus: float = Field(1.0, ge=0)  # Ray CPUs per engine replica
    engine_num_gpus: float = Field(0.0, ge=0)  # Ray GPUs per engine replica (per TP rank)
    placement_strategy: str = "STRICT_PACK"  # of each engine's placement group
    ingress_num_cpus: float = Field(0.5, ge=0)
    ingress_autoscaling: IngressAutoscaling = IngressAutoscaling()
    # None: a fixed data_parallel_size engines; else engines scale between its min and
    # max on queue depth and KV usage (deployments.autoscaling), starting at
    # data_parallel_size
    engine_autoscaling: EngineAutoscaling | None = None
    api_key: str | None = None
    admin_key: str | None = None
    dev_mode: bool = False
    max_body_bytes: int = Field(1 << 20, ge=1024)
    # mock engine options (model=mock)
    mock_itl_s: float = Field(0.0, ge=0)
    mock_ttft_s: float = Field(0.0, ge=0)
    mock_output_chunk_size: int = Field(1, ge=1)
    mock_max_model_len: int = Field(4096, ge=2)
    mock_force_is_sleeping_rank: int | None = None  # test knob: that rank reports asleep
    mock_force_reset_false_rank: int | None = None  # test knob: that rank refuses resets

    @model_validator(mode="after")
    def _checks(self) -> "AppArgs":
        if self.placement_strategy not in ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError("placement_strategy must be STRICT_PACK, PACK, SPREAD or "
                             "STRICT_SPREAD")
        scaling = self.engine_autoscaling
        if scaling is not None and not (scaling.min_replicas <= self.data_parallel_size
                                        <= scaling.max_replicas):
            raise ValueError("data_parallel_size (the initial engine count) must be within "
                             "engine_autoscaling.min_replicas..max_replicas")
        if self.ingress_autoscaling.min_replicas > self.ingress_autoscaling.max_replicas:
            raise ValueError("ingress_autoscaling.min_replicas > max_replicas")
        if not self.is_mock:
            self.engine_config(0)  # EngineConfig's own checks, at build time
            self._check_tensor_parallel()
        return self

    def _check_tensor_parallel(self) -> None:
        """Heads that do not divide by tensor_parallel_size fail at build time when the
        model is readable here (else the engine replica reports it when it starts)."""
        if self.tensor_parallel_size == 1:
            return
        from engine.errors import FlotillaError
        from engine.model_loader import load_hf_config, resolve_model
        from engine.models.llama import ModelShape
        from engine.parallel import check_divisible
        try:
            shape = ModelShape.from_hf_config(load_hf_config(resolve_model(self.model)))
        except (FlotillaError, OSError):
            return  # not on this machine (e.g. only on the GPU workers)
        try:
            check_divisible(shape, self.tensor_parallel_size)
        except FlotillaError as exc:
            raise ValueError(str(exc)) from None

    def engine_bundles(self) -> list[dict[str, float]] | None:
        """Placement-group bundles of one engine replica: one per TP rank.
        None when the engine asks for no resources (tests give it 0 CPUs)."""
        bundle = {k: v for k, v in (("CPU", self.engine_num_cpus),
                                    ("GPU", self.engine_num_gpus)) if v > 0}
        return [bundle] * self.tensor_parallel_size if bundle else None

    def keys(self) -> tuple[str | None, str | None]:
        """(api_key, admin_key): the args' values, else $FLOTILLA_API_KEY and
        $FLOTILLA_ADMIN_KEY of the replica's process. Keys from the environment (a
        Kubernetes Secret, say) stay out of the Serve config that Ray stores and shows."""
        return (self.api_key or os.environ.get("FLOTILLA_API_KEY") or None,
                self.admin_key or os.environ.get("FLOTILLA_ADMIN_KEY") or None)

    def check_fits(self, cluster: dict[str, float]) -> None:
        """Raise a clear ValueError when a fixed-size cluster (`cluster`: Ray's total
        resources) cannot hold the starting engines: their placement groups would wait
        forever. Clusters with an autoscaler add nodes instead; do not call it there."""
        engines, tp = self.data_parallel_size, self.tensor_parallel_size
        need = {"CPU": engines * tp * self.engine_num_cpus
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
        return self.model == MOCK_MODEL

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "SmolLM2-135M-Instruct" if self.model == "default" else self.model

    def engine_config(self, rank: int) -> EngineConfig:
        return EngineConfig(model=self.model, dtype=self.dtype, block_size=self.block_size,
                            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            enable_prefix_caching=self.enable_prefix_caching,
                            num_threads=self.num_threads, seed=rank,
                            tensor_parallel_size=self.tensor_parallel_size)

    def mock_config(self, rank: int, vocab_size: int) -> MockConfig:
        return MockConfig(engine_index=rank, vocab_size=vocab_size, block_size=self.block_size,
                          max_model_len=self.mock_max_model_len, itl_s=self.mock_itl_s,
                          ttft_s=self.mock_ttft_s, max_num_seqs=self.max_num_seqs,
                          output_chunk_size=self.mock_output_chunk_size,
                          force_is_sleeping=True if rank == self.mock_force_is_sleeping_rank
                          else None,
                          force_reset_prefix_cache=False if rank == self.mock_force_reset_false_rank
                          else None)
