"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step has a token budget (max_num_batched_tokens; by default 512 on CPU,
8192 on CUDA). Running requests are served first, in arrival order, each taking
what it still needs (one token for a decode, the rest of its prompt, capped by
the budget, for a prefill in progress). When the pool cannot hold a running
request's next tokens, the request at the tail of the running queue is
preempted: its blocks are freed and it goes back to the front of the waiting
queue, to be recomputed later (its full blocks often survive in the prefix
cache). Waiting requests are
admitted with what budget and max_num_seqs leave; one whose structured-outputs
grammar is still compiling is passed over until it is ready, and so is one whose
LoRA adapter would make the running batch hold more than max_loras adapters.

Under scheduling_policy "priority" the waiting queue is ordered by (priority,
arrival) (engine.core.request_queue), running requests are served in that order
and preempted lowest first, and a waiting request that does not fit (no free
sequence slot or too few free blocks for its first chunk) preempts running
requests of a strictly lower priority (a higher value) until it does.

With a KV connector (engine/kv_transfer), a waiting request's prefix continues past the
pool's hits into what the connector holds: its blocks are allocated at admission, the
request waits apart (WAITING_FOR_KV, outside both queues) while the connector fills
them and other requests run, then rejoins the head of the waiting queue with those
tokens computed (kv_arrived). A failed load recomputes the request or fails it
(kv_load_failed, by kv_load_failure_policy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import PriorityQueue, make_queue

if TYPE_CHECKING:  # the connectors sit above the core
    from engine.kv_transfer.base import ConnectorScheduler


@dataclass
class SchedulerOutput:
    """The requests of one step and how many new tokens each computes."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 token_budget: int) -> None:
        self.config = config
        self.token_budget = token_budget  # tokens per step (EngineConfig.step_token_budget)
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.on_finish = None  # called with each request that finishes (its proposer's)
        self.connector: ConnectorScheduler | None = None  # a KV connector's scheduler half
        self.waiting_for_kv: dict[str, Request] = {}  # admitted, their KV being loaded
        self.held_for_send: dict[str, Request] = {}  # finished, blocks read by a send
        self.external_queries = self.external_hits = 0  # tokens asked of / found by it

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        scheduled: list[Request] = []
        if isinstance(self.waiting, PriorityQueue):
            self.running.sort(key=self.waiting.key)  # served first, preempted last
            self._make_room_for_head(out, budget)
        made_room = len(out.preempted)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            self.kv.free_slid_out(request)  # blocks past every layer's window
            spec = request.spec_tokens  # proposed tokens ride with its last one
            n = min(request.num_tokens - request.num_computed_tokens + len(spec), budget)
            if spec and n < 1 + len(spec):
                request.spec_tokens = spec[:max(0, n - 1)]
            while not self.kv.allocate(request, n):
                if request.spec_tokens:  # a proposal never preempts anyone: dropped first
                    n -= len(request.spec_tokens)
                    request.spec_tokens = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing after it can run either

        if len(out.preempted) == made_room:  # no running request had to give way
            # skipped, not blocking those behind them: a grammar still compiling, or an
            # adapter that would put more than max_loras adapters in the batch
            passed: list[Request] = []
            adapters = {r.lora.lora_int_id for r in self.running if r.lora is not None}
            # once an adapter request waits for room, adapter requests behind it wait too,
            # so the running adapters drain and it is not starved by their newcomers
            lora_blocked = False
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting.peek()
                if request.lora is not None and (lora_blocked or (
                        request.lora.lora_int_id not in adapters
                        and len(adapters) >= self.config.max_loras)):
                    lora_blocked = True
                    passed.append(self.waiting.pop())
                    continue
                if request.waiting_for_grammar:
                    passed.append(self.waiting.pop())
                    continue
                if request.block_ids:  # its KV arrived from a connector: blocks held
                    computed, hits = request.num_computed_tokens, None
                else:
                    # an embedding request computes every token (mean pooling needs them
                    # all), and so does one that asks for prompt logprobs (the logits)
                    recompute = request.pooling is not None or request.needs_prompt_logits
                    hits = None if recompute else self.kv.find_cached_prefix(request)
                    computed = self.kv.hit_tokens(hits)
                    if not recompute and self._load_external(request, computed, hits):
                        continue
                n = min(request.num_tokens - computed, budget)
                if not self.kv.allocate(request, n, hits):
                    break
                self.waiting.pop()
                request.num_computed_tokens = computed
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = computed
                if request.scheduled_at is None:
                    request.scheduled_at = time.monotonic()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                if request.lora is not None:
                    adapters.add(request.lora.lora_int_id)
                scheduled.append(request)
                out.num_new_tokens.append(n)
                budget -= n
            self.waiting.put_back(passed)
        out.requests = scheduled
        return out

    def _load_external(self, request: Request, computed: int,
                       hits: list[list[int]] | None) -> bool:
        """Admit the head request to wait for the KV a connector holds past its pool hits
        (True); False: the connector has none for it, or its blocks do not fit now
        (it is then computed, as without a connector)."""
        if self.connector is None or request.kv_load_failed:
            return False
        external, _ = self.connector.get_num_new_matched_tokens(request, computed)
        self.external_queries += request.num_tokens  # as vLLM counts them
        self.external_hits += max(0, external)
        if external <= 0 or not self.kv.allocate(request, external, hits, register=False):
            return False
        self.waiting.pop()
        request.num_computed_tokens = computed
        first = computed // self.kv.block_size
        blocks = request.block_ids[first:first + external // self.kv.block_size]
        self.connector.update_state_after_alloc(request, blocks, external)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = computed + external
        request.pending_external = external
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv[request.request_id] = request
        return True

    def kv_arrived(self, request_ids: set[str]) -> None:
        """Loads done: those requests rejoin the head of the waiting queue, their loaded
        tokens computed and their full blocks findable."""
        for request_id in request_ids:
            request = self.waiting_for_kv.pop(request_id, None)
            if request is None:
                continue
            request.num_computed_tokens += request.pending_external
            request.pending_external = 0
            self.kv.register_computed(request)
            request.status = RequestStatus.WAITING
            self.waiting.add_preempted(request)

    def kv_load_failed(self, request_id: str, recompute: bool) -> Request | None:
        """A failed load: recompute (its blocks freed, back to the waiting queue's head,
        never asking the connector again) or give the request back for the engine to fail
        (None when it is no longer waiting)."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return None
        self.connector.request_dropped(request)
        self.kv.free_request(request)
        request.num_computed_tokens = request.pending_external = 0
        request.kv_load_failed = True
        if not recompute:
            self.waiting_for_kv[request_id] = request  # finish() takes it out
            return request
        request.status = RequestStatus.WAITING
        self.waiting.add_preempted(request)
        return None

    def kv_sent(self, request_ids: set[str]) -> None:
        """Sends done: the finished requests' held blocks go back to the pool."""
        for request_id in request_ids:
            request = self.held_for_send.pop(request_id, None)
            if request is not None:
                self.kv.free_request(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free_request(request)
        request.num_computed_tokens = 0
        request.spec_tokens = []
        request.pool_sum = None  # an embedding request pools again from its first token
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _make_room_for_head(self, out: SchedulerOutput, budget: int) -> None:
        """Priority policy: preempt running requests of a strictly lower priority while
        the first waiting request that could run has no sequence slot or too few free
        blocks for its first chunk (counted without prefix-cache hits, so it may free
        a little more than needed; equal priorities never preempt each other here)."""
        adapters = {r.lora.lora_int_id for r in self.running if r.lora is not None}

        def could_run(r: Request) -> bool:  # else preempting for it would only churn
            return not r.waiting_for_grammar and (
                r.lora is None or r.lora.lora_int_id in adapters
                or len(adapters) < self.config.max_loras)
        head = next((r for r in self.waiting if could_run(r)), None)
        if head is None:
            return
        need = self.kv.blocks_needed(min(head.num_tokens, budget))
        while self.running and self.running[-1].priority > head.priority:
            if (len(self.running) < self.config.max_num_seqs
                    and need <= self.kv.num_free_blocks):
                return
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request that stopped or was aborted and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif self.waiting_for_kv.pop(request.request_id, None) is not None:
            if self.connector is not None:
                self.connector.request_dropped(request)
        else:
            self.waiting.remove(request)
        if isinstance(self.waiting, PriorityQueue):
            self.waiting.forget(request)
        hold = False
        if self.connector is not None:
            hold, request.kv_transfer_params = self.connector.request_finished(request)
        if hold:  # a send still reads its blocks: freed when the worker says it is done
            self.held_for_send[request.request_id] = request
        else:
            self.kv.free_request(request)
        if self.on_finish is not None:
            self.on_finish(request)

    def preempt_all(self) -> None:
        """Send every running request back to waiting (used to reset the prefix cache)."""
        while self.running:
            self._preempt(self.running.pop())
