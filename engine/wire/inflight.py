"""The client's in-flight requests: one record per request, and output delivery to it.

A user request used to live in three of the client's tables (its stream by user id,
its user id and its engine by engine request id), kept in step by hand at submit,
forget, dispatch, death and shutdown. Here one record holds all three, found by either
id, so a request is added and removed in one place. (The OutputProcessor's two maps,
which hold its text state, and the router's pending map, which holds the engines'
queued prefill, stay with them.)

A record also is the request's link from the output reader to its consumer: a flag
saying the OutputProcessor holds something new for it, or the error that ended it.
Nothing is queued per step, so a consumer behind the engine pays once for everything
that arrived meanwhile.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Callable

from engine.core_messages import FINISH_ERROR, EngineCoreOutput
from engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRequestError,
    EngineSleepingError,
    FlotillaError,
    InvalidRequestError,
    PromptTooLongError,
)
from engine.frontend.output_processor import OutputProcessor


def typed_error(message: str) -> FlotillaError:
    """Rebuild the engine's typed error from its "TypeName: message" error output."""
    name, _, text = message.partition(": ")
    cls = {c.__name__: c for c in (EngineSleepingError, PromptTooLongError, EngineDrainingError,
                                   DuplicateRequestError, InvalidRequestError,
                                   EngineDeadError, EngineOverloadedError)}.get(name)
    return cls(text) if cls else EngineRequestError(message)


class InFlightRequest:
    """One user request on one engine (a resubmission makes a new record): its user id,
    its engine request ids (n > 1 fans out to several, all on one engine), that
    engine's index, and its consumer's wake-up state."""

    __slots__ = ("request_id", "engine_ids", "engine", "wake", "pending", "error")

    def __init__(self, request_id: str, engine_ids: tuple[str, ...], engine: int) -> None:
        self.request_id = request_id
        self.engine_ids = engine_ids
        self.engine = engine
        self.wake = asyncio.Event()
        self.pending = False
        self.error: BaseException | None = None

    def touch(self) -> None:
        self.pending = True
        self.wake.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:  # the first error is the cause
            self.error = error
        self.wake.set()


class _EngineIndexView(Mapping):
    """engine request id -> engine index, read-only (tests and bench/routing.py ask
    where a request ran)."""

    def __init__(self, by_engine_id: dict[str, InFlightRequest]) -> None:
        self._by_engine_id = by_engine_id

    def __getitem__(self, engine_id: str) -> int:
        return self._by_engine_id[engine_id].engine

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_engine_id)

    def __len__(self) -> int:
        return len(self._by_engine_id)


class InFlight:
    """The records, by user request id and by engine request id."""

    def __init__(self) -> None:
        self._by_id: dict[str, InFlightRequest] = {}
        self._by_engine_id: dict[str, InFlightRequest] = {}
        self.engine_index: Mapping[str, int] = _EngineIndexView(self._by_engine_id)

    def add(self, request_id: str, engine_ids: tuple[str, ...], engine: int
            ) -> InFlightRequest:
        record = InFlightRequest(request_id, engine_ids, engine)
        self._by_id[request_id] = record
        for engine_id in engine_ids:
            self._by_engine_id[engine_id] = record
        return record

    def remove(self, request_id: str) -> InFlightRequest | None:
        record = self._by_id.pop(request_id, None)
        if record is not None:
            for engine_id in record.engine_ids:
                self._by_engine_id.pop(engine_id, None)
        return record

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[InFlightRequest]:
        return iter(self._by_id.values())

    def get(self, request_id: str) -> InFlightRequest | None:
        return self._by_id.get(request_id)

    def engine_of(self, engine_id: str) -> int | None:
        """The engine an engine request id runs on, None once it is gone."""
        record = self._by_engine_id.get(engine_id)
        return None if record is None else record.engine

    def on_engine(self, index: int) -> list[InFlightRequest]:
        return [r for r in self._by_id.values() if r.engine == index]

    def deliver(self, outputs: list[EngineCoreOutput], processor: OutputProcessor,
                engine_timestamp: float | None, engine_index: int | None,
                queue_abort: Callable[[str, str], None],
                engine_failed: Callable[[int, EngineDeadError], None]) -> None:
        """Hand an engine's outputs to the OutputProcessor and wake their consumers.
        An error output fails its request (and aborts its n > 1 siblings), except an
        EngineDeadError, which condemns the whole engine (engine_failed). Outputs from
        an engine a request no longer runs on are stale and dropped."""
        normal = []
        for out in outputs:
            record = self._by_engine_id.get(out.request_id)
            if engine_index is not None and (
                    None if record is None else record.engine) != engine_index:
                continue  # stale: the request was resubmitted elsewhere, or is gone
            if out.finish_reason == FINISH_ERROR:
                if record is None:
                    continue
                for engine_id in processor.abort_requests([record.request_id]):
                    if engine_id != out.request_id:
                        queue_abort(engine_id, "sibling_error")
                error = typed_error(out.error or "the engine refused the request")
                if isinstance(error, EngineDeadError):
                    engine_failed(record.engine, error)
                    continue
                record.fail(error)
            else:
                normal.append(out)
        updated = processor.update(normal, engine_timestamp)
        for engine_id in updated.reqs_to_abort:
            queue_abort(engine_id, "stop_string")
        for request_id in updated.request_ids:
            record = self._by_id.get(request_id)
            if record is not None:
                record.touch()
