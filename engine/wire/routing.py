"""Router: which data-parallel engine a request goes to, by policy.

Policies (EngineClient.connect(routing=...), the app's `routing` option):
- "prefix" (default): the engine where the request costs least, the cost being the
  prefill it would need there (its prompt minus the prefix that engine has cached,
  from the engines' KV events, engine/wire/prefix_index.py; a prefix a KV tier holds
  past that counts TIER_WEIGHT a token; weighted MISS_WEIGHT,
  since a recompute delays the requests after it too) plus that engine's queue:
  the prefill tokens already waiting there, its running requests, KV pressure. Cache
  affinity therefore holds until an imbalance costs more than the cache saves; a hot
  prefix spreads once its engine's queue outgrows the cost of recomputing it
  elsewhere, and then both engines hold it.
- "least_loaded": the fewest in-flight plus waiting requests (ties rotate).
- "round_robin": the live engines in turn.

Whatever the policy, an explicit data_parallel_rank wins (EngineClient._pick), then a
session (x-session-id): the same session goes to the same engine while that engine
is live and not leaving; otherwise it is routed anew and pinned to the new engine.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable

from engine.core.block_hash import cacheable_blocks, prefix_block_hashes
from engine.core_messages import KVEvents
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.wire.prefix_index import PrefixIndex

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")
MAX_SESSIONS = 65536  # sessions remembered per client (least recently used go first)
# The longest session id taken, so the session table is bounded in bytes as well as in
# count (65,536 ids of 256 characters: ~16 MiB at most, with their addresses).
MAX_SESSION_ID_CHARS = 256
# A running request slows each step of its engine about as much as this many blocks
# of prefill would (its decode token and its KV reads): decode load counts, a little.
RUNNING_COST_BLOCKS = 1.0
# A prompt token computed on an engine delays this request, and, since that compute is
# added to the engine's queue, every request routed there after it: uncached tokens
# weigh twice what tokens already queued do. Measured with bench/routing.py (Zipf, DP=4
# mocks): weight 1 reaches 88 % of the ideal hit rate, 2 reaches 99 % with TTFT p50 down
# a third and the busiest engine within 1.21x the mean; 3 overloads one engine (1.7x).
MISS_WEIGHT = 2.0
# A token a KV tier supplies (engine/kv_transfer), in prefill tokens: loaded, not
# computed, so far cheaper than a miss, dearer than a pool hit (free). Measured on Zen 4
# (bench/kv_tier.py): a 4,096-token prompt from the host tier 0.010x of recomputing it,
# from the disk tier 0.023x (warm); 0.1 leaves room for a cold disk.
TIER_WEIGHT = 0.1 * MISS_WEIGHT
KV_PRESSURE_FROM = 0.9  # KV usage above which an engine's cost grows to a full recompute
_MEAN_DECAY = 0.05  # weight of the newest request in the mean uncached prompt length


def check_routing(policy: str) -> str:
    """The policy, or ValueError naming the choices."""
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, "
                         f"got {policy!r}")
    return policy


class Router:
    """Per-client routing state: the prefix index, sessions, and the prefill this client
    has queued on each engine that has not produced its first token yet."""

    def __init__(self, policy: str = "prefix", block_size: int = 16) -> None:
        self.policy = check_routing(policy)
        self.block_size = block_size
        self.index = PrefixIndex()
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session id -> engine address
        self._pending: dict[str, tuple[int, int]] = {}  # engine request id -> (engine, tokens)
        self._queued: dict[int, int] = {}  # engine index -> prefill tokens pending there
        self._mean_uncached = 0.0
        self._turn = itertools.count()

    # ---- what the engines say -----------------------------------------------------------
    def on_kv_events(self, engine: int, events: KVEvents) -> None:
        self.index.apply(engine, events)

    def on_output(self, request_id: str) -> None:
        """A request produced output: its prefill is no longer queued."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            self._queued[entry[0]] -= entry[1]

    def engine_gone(self, engine: int) -> None:
        """The engine died or left: its cache and queue are gone with it."""
        self.index.drop(engine)
        self._queued.pop(engine, None)
        for request_id in [r for r, (e, _) in self._pending.items() if e == engine]:
            del self._pending[request_id]

    # ---- choosing -----------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], lora: LoRARequest | None) -> list[int]:
        """The prompt's hash chain, as far as an engine could serve it from cache (only
        the prefix policy needs it)."""
        if self.policy != "prefix":
            return []
        return prefix_block_hashes(token_ids, self.block_size, lora,
                                   cacheable_blocks(len(token_ids), self.block_size))

    def session_engine(self, session_id: str | None, candidates: Sequence[Any]) -> Any | None:
        """The session's engine if it is among the live, non-leaving candidates."""
        if session_id is not None and len(session_id) > MAX_SESSION_ID_CHARS:
            raise InvalidRequestError(f"a session id of {len(session_id)} characters; at "
                                      f"most {MAX_SESSION_ID_CHARS}")
        if session_id is None:
            return None
        address = self.sessions.get(session_id)
        if address is None:
            return None
        for e in candidates:
            if e.address == address:
                self.sessions.move_to_end(session_id)
                return e
        return None

    def adopt_sessions(self, other: "Router") -> None:
        """Take over another client's sessions (the ingress replaces its client when the
        engine set changes): a session whose engine is still there stays on it."""
        for session_id, address in other.sessions.items():
            self.sessions.setdefault(session_id, address)

    def remember_session(self, session_id: str | None, engine: Any) -> None:
        if session_id is None:
            return
        self.sessions[session_id] = engine.address
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def choose(self, candidates: Sequence[Any], load: Callable[[Any], int],
               num_tokens: int, hashes: list[int]) -> tuple[Any, int]:
        """(engine, prompt tokens it has to prefill) by the policy; `load` is the
        least-loaded score (in-flight plus waiting requests)."""
        turn = next(self._turn)
        n = max(len(candidates), 1)
        if self.policy == "round_robin":
            return candidates[turn % len(candidates)], num_tokens
        if self.policy == "least_loaded":
            best = min(candidates, key=lambda e: (load(e), (e.index - turn) % n))
            return best, num_tokens

        def found(e) -> tuple[int, int]:  # tokens in its pool, then in a KV tier
            pool = self.index.cached_prefix(e.index, hashes)
            return pool * self.block_size, self.index.tier_prefix(
                e.index, hashes, pool) * self.block_size

        def cost(e) -> tuple[float, int]:
            pool, tier = found(e)
            return (self.cost(e, num_tokens - pool - tier, num_tokens) + TIER_WEIGHT * tier,
                    (e.index - turn) % n)
        best = min(candidates, key=cost)
        pool, tier = found(best)
        return best, num_tokens - pool - tier

    def cost(self, engine: Any, uncached: int, num_tokens: int) -> float:
        """What a request with `uncached` prompt tokens to compute costs on `engine`, in
        prefill tokens: its own prefill (MISS_WEIGHT times), the prefill queued ahead of it (this client's
        exactly; the engine's waiting requests at the mean size, for other clients'),
        its running requests, and near a full KV cache up to a recompute."""
        stats = engine.stats
        waiting = stats.num_waiting_reqs if stats else 0
        running = max(engine.in_flight,
                      (stats.num_running_reqs + waiting) if stats else 0)
        queued = max(self._queued.get(engine.index, 0), waiting * self._mean_uncached)
        cost = MISS_WEIGHT * uncached + queued + RUNNING_COST_BLOCKS * self.block_size * running
        if stats and stats.kv_cache_usage > KV_PRESSURE_FROM:
            cost += num_tokens * (stats.kv_cache_usage - KV_PRESSURE_FROM) / (1 - KV_PRESSURE_FROM)
        return cost

    def submitted(self, engine: int, request_id: str, uncached: int,
                  hashes: list[int] = ()) -> None:
        """A request went to `engine` with about `uncached` tokens to prefill; its
        prompt's blocks will be cached there."""
        self.index.routed(engine, hashes)
        self._pending[request_id] = (engine, uncached)
        self._queued[engine] = self._queued.get(engine, 0) + uncached
        self._mean_uncached += _MEAN_DECAY * (uncached - self._mean_uncached)

    def forget(self, request_id: str) -> None:
        """The request ended (or was resubmitted): nothing of it stays queued."""
        self.on_output(request_id)
