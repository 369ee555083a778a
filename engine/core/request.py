"""Request: one sequence's state inside the engine core (tokens, blocks, progress)."""
from __future__ import annotations

import enum
import time

import torch

from engine.lora.request import LoRARequest
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"  # its blocks are being filled by a KV connector
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    """Engine-side request. Progress is num_computed_tokens over all_token_ids.

    A request samples a token only in the step that computes its last known
    token; chunked prefill steps before that advance num_computed_tokens only.
    """

    @property
    def block_ids(self) -> list[int]:
        """The first KV group's block table (the only one of most models)."""
        return self.group_blocks[0]

    @property
    def num_freed_blocks(self) -> int:
        return self.group_freed[0]

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], arrival_time: float | None = None,
                 priority: int = 0, pooling: PoolingParams | None = None,
                 lora: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first schedule; -1 = not yet
        # each KV group's block table (engine.core.kv_groups; one group for most models)
        self.group_blocks: list[list[int]] = [[]]
        self.block_hashes: list[int] = []  # hash chain of the full blocks registered so far
        self.group_freed = [0]  # each group's leading blocks given back (slid out)
        self.spec_tokens: list[int] = []  # proposed next tokens this step (spec_decode)
        self.state_block = -1  # a hybrid model's state block (engine.model.layers.mamba)
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.kv_load_failed = False  # a connector's load failed: it recomputes instead
        self.pending_external = 0  # tokens a connector is loading (WAITING_FOR_KV)
        # what a KV connector gave its final output (engine.kv_transfer.base)
        self.kv_transfer_params: dict | None = None
        # engine clock (monotonic): in the queue, first scheduled, first token sampled;
        # they become the request's RequestTimings when it finishes
        self.queued_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.trace_headers: dict[str, str] | None = None  # traced: its caller's context
        self.generator: torch.Generator | None = None
        self.grammar = None  # GrammarState of a structured-outputs request (engine.structured)
        self.logit_controls = None  # its RowControls, built at its first sampled step
        self.pooling = pooling  # an embedding request: pools its prompt, samples nothing
        self.lora = lora  # the adapter it runs with (None: the base model)
        self.lora_slot = -1  # its adapter's device slot this step (-1: none)
        self.pool_sum: torch.Tensor | None = None  # mean pooling: sum of its hidden states
        # prompt_logprobs: one (ids, logprobs, ranks) per prompt position from 1, gathered
        # chunk by chunk; None when not asked or once sent with the first token
        self.prompt_logprobs: list[tuple[list[int], list[float], list[int]]] | None = (
            [] if params.prompt_logprobs is not None else None)
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def cache_root(self) -> tuple[str, int, str] | None:
        """What the prefix cache keys this request's blocks under besides the tokens: KV
        computed under one adapter is never reused under another or the base model."""
        return None if self.lora is None else ("lora", self.lora.lora_int_id,
                                               self.lora.lora_path)

    @property
    def waiting_for_grammar(self) -> bool:
        """Its constraint is still compiling: the scheduler leaves it waiting."""
        return self.grammar is not None and self.grammar.matcher is None

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs are asked and not all gathered: every prompt position must be
        computed here (no prefix-cache hits), its logits kept."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
