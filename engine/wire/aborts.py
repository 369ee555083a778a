"""Aborts to the engines: batched, never blocking, retried until sent.

An abort that is not sent leaves a request generating on its engine for nothing (a
dropped stream decodes on to max_tokens), and a burst of them (a disconnect storm, a
stop string per stream) must not become a message per request nor stall the event
loop. So ids to abort go to a queue; one loop drains it, up to ABORT_BATCH at a time,
and sends one ABORT per engine with NOBLOCK; a send that fails is logged and retried
after ABORT_RETRY_S until it goes out or its engine is declared dead (then the engine
keeps the ids, sent should it speak again: engine/wire/engine_set.py revives it).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict

import msgspec
import zmq

from engine.wire.engine_set import EngineSet
from engine.wire.protocol import ABORT

logger = logging.getLogger(__name__)

ABORT_BATCH = 1024
ABORT_RETRY_S = 0.2  # wait before resending aborts whose send failed


class AbortSender:
    """The queue of (engine request id, engine index, cause) to abort, and its loop.
    cause None: an id sent again, counted once already."""

    def __init__(self, members: EngineSet) -> None:
        self._members = members
        self._queue: asyncio.Queue = asyncio.Queue()
        self._encoder = msgspec.msgpack.Encoder()
        self.causes: Counter = Counter()  # why requests were aborted (metrics, tests)
        self.messages_sent = 0
        self.send_failures = 0  # ABORT sends that raised (each is retried)

    def queue(self, engine_id: str, index: int | None, cause: str | None) -> None:
        """Hand an id to the loop (which coalesces bursts into one ABORT per engine)."""
        self._queue.put_nowait((engine_id, index, cause))

    async def run(self) -> None:
        """Runs until shutdown: no error ends this loop. Ids whose send failed go back
        to the queue after ABORT_RETRY_S (cause None: counted once already)."""
        while True:
            try:
                batch = [await self._queue.get()]
                while len(batch) < ABORT_BATCH:
                    try:
                        batch.append(self._queue.get_nowait())
                    except asyncio.QueueEmpty:
                        break
                unsent = await self.send(batch)
                if unsent:  # queued again first: a shutdown meanwhile still sends them
                    for engine_id, index in unsent:
                        self._queue.put_nowait((engine_id, index, None))
                    await asyncio.sleep(ABORT_RETRY_S)
            except asyncio.CancelledError:
                return
            except Exception:  # a bug here must not stop every later abort
                logger.exception("abort loop: unexpected error; continuing")

    async def send(self, items: list[tuple[str, int | None, str | None]]
                   ) -> list[tuple[str, int]]:
        """One ABORT per engine; returns the (id, engine) pairs whose send failed."""
        per_engine: dict[int, list[str]] = defaultdict(list)
        for engine_id, index, cause in items:
            if cause is not None:
                self.causes[cause] += 1
            if index is not None:
                per_engine[index].append(engine_id)
        unsent = []
        for index, ids in per_engine.items():
            engine = self._members.engines[index]
            if engine.dead:  # kept: a quiet engine that speaks again gets them then
                engine.pending_aborts.extend(ids)
                continue
            try:  # NOBLOCK: at the high-water mark an awaited send would stall every
                # engine's aborts behind this one; Again is retried instead
                await engine.socket.send_multipart([ABORT, self._encoder.encode(ids)],
                                                   flags=zmq.NOBLOCK)
                self.messages_sent += 1
            except Exception as exc:  # zmq.Again past the high-water mark, ZMQError, ...
                self.send_failures += 1
                logger.warning("aborting %d requests at engine %d failed (%s: %s); retrying "
                               "in %.1fs", len(ids), index, type(exc).__name__, exc,
                               ABORT_RETRY_S)
                unsent += [(i, index) for i in ids]
        return unsent

    async def abort_everything(self, running: list[tuple[int, tuple[str, ...]]]) -> bool:
        """At shutdown (a retired client, a replica going away), with the loop stopped:
        abort at once what the client still has running ((engine, ids) pairs), queued
        to abort or kept for a quiet engine, which would otherwise run on with nobody to
        read it. Whether any ABORT went out."""
        owned: dict[int, list[str]] = defaultdict(list)
        for index, ids in running:
            owned[index] += ids
        while not self._queue.empty():
            engine_id, index, _ = self._queue.get_nowait()
            if index is not None:
                owned[index].append(engine_id)
        for engine in self._members.engines:
            owned[engine.index] += engine.pending_aborts
        sent = False
        for index, ids in owned.items():
            if not ids:
                continue
            try:
                await self._members.engines[index].socket.send_multipart(
                    [ABORT, self._encoder.encode(sorted(set(ids)))], flags=zmq.NOBLOCK)
                sent = True
            except zmq.ZMQError:
                pass  # the engine's own client timeout ends them
        return sent
