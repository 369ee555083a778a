"""Which engine takes a request: the glue between the engines' health and load
(engine/wire/engine_set.py) and the routing policy (engine/wire/routing.py).

The policy ranks candidates by cost; this module decides who the candidates are (live,
not draining, not stalled in a step, with fallbacks when none is), and the rules that
come before or after the policy: an explicit data_parallel_rank wins, a session stays
on its engine while that one is live and staying, and a request with a LoRA adapter
goes back to an engine that ran it unless that one is overloaded. Apart from the client
so that the choice can be read and tested without sockets.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Sequence

from engine.errors import EngineDeadError, InvalidRequestError, NoEnginesError
from engine.wire.engine_set import EngineLink, EngineSet
from engine.wire.routing import Router


def others_than(members: EngineSet, engine: EngineLink) -> bool:
    """Whether another engine could take a request this one cannot."""
    return any(e is not engine and not e.dead and not e.draining for e in members.engines)


def route(members: EngineSet, router: Router, turns: Iterator[int], rank: int | None,
          lora_id: int | None, num_tokens: int, hashes: Sequence[int],
          session_id: str | None) -> tuple[EngineLink, int]:
    """(engine, prompt tokens it will prefill, about) for a request: the named rank,
    else the session's engine while it is live and staying, else the policy's
    choice (then pinned to the session)."""
    if rank is None and session_id is not None:
        staying = [e for e in members.engines if not e.dead and not e.draining]
        engine = router.session_engine(session_id, staying)
        if engine is not None:
            return engine, num_tokens - router.block_size * \
                router.index.cached_prefix(engine.index, hashes)
    engine, uncached = pick(members, router, turns, rank, lora_id, num_tokens, hashes)
    if rank is None:
        router.remember_session(session_id, engine)
    return engine, uncached


def pick(members: EngineSet, router: Router, turns: Iterator[int], rank: int | None,
         lora_id: int | None = None, num_tokens: int = 0, hashes: Sequence[int] = ()
         ) -> tuple[EngineLink, int]:
    """(engine, its prefill tokens) for a request: the named rank, else the routing
    policy's choice (prefix-cache cost, least loaded or round robin), except that a
    request with an adapter goes to an engine it was sent to before (which holds it
    in a slot or its host cache) unless that one is overloaded: more than max(2, a
    quarter of the least load) requests above the chosen one. turns: the round-robin
    counter that breaks ties, advanced once per choice by the policy."""
    engines = members.engines

    def uncached(e: EngineLink) -> int:
        return num_tokens - router.block_size * router.index.cached_prefix(e.index, hashes)
    alive = [e for e in engines if not e.dead and not e.draining] or \
        [e for e in engines if not e.dead]
    alive = [e for e in alive if e.step_running_s < members.stalled_step_s] or alive
    if rank is not None:
        if not 0 <= rank < len(engines):
            raise InvalidRequestError(
                f"data_parallel_rank {rank} out of range [0, {len(engines)})")
        if engines[rank].dead:
            raise members.dead_error or EngineDeadError(f"engine {rank} is dead")
        return engines[rank], uncached(engines[rank])
    if not alive:
        raise members.dead_error or NoEnginesError("no live engine")
    turn = next(turns)

    def score(e: EngineLink) -> tuple:
        waiting = e.stats.num_waiting_reqs if e.stats else 0
        return (e.in_flight + waiting, (e.index - turn) % len(engines))
    best, best_uncached = router.choose(alive, lambda e: score(e)[0], num_tokens, hashes)
    if lora_id is not None and lora_id not in best.adapters:
        holders = [e for e in alive if lora_id in e.adapters]
        if holders:
            holder = min(holders, key=score)
            least = score(best)[0]
            if score(holder)[0] <= least + max(2, least // 4):
                return holder, uncached(holder)
    return best, best_uncached
