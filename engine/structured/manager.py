"""StructuredOutputManager: the engine core's side of structured outputs.

A constrained request's grammar compiles on a thread of its own while the engine keeps
stepping (engine/structured/compile_pool.py bounds them); the scheduler leaves the request waiting until its matcher exists (poll()).
Each step the sampling rows with a matcher get their allowed-token bitmask, and every
sampled token advances its matcher. A matcher only ever sees output tokens, which
survive preemption (recompute rebuilds KV, not tokens), so it needs no reset.

A request with reasoning_end (a reasoning model's end-of-thinking tokens) starts
dormant: its rows are not masked and its tokens only advance a watch for that sequence
in its output; the token after the sequence's first occurrence is the grammar's first.
The watch lives on the request's GrammarState beside the matcher and, like it, sees
only output tokens, so preemption leaves it right too.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.core.request import Request
from engine.structured.compile_pool import CompilePool

if TYPE_CHECKING:
    from engine.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

POLL_WAIT_S = 0.02  # an idle engine waiting only on a compile sleeps this long per step
COMPILE_SLOTS = 2  # compiles running at once (abandoned ones not counted)
MAX_ABANDONED_COMPILES = 4  # past this many still running, new compiles get 429


class GrammarState:
    """One request's compile future, then its matcher; with a reasoning_end, the watch
    for it while the grammar is dormant."""

    __slots__ = ("future", "key", "matcher", "is_json", "trigger", "fallback", "matched")

    def __init__(self, future: concurrent.futures.Future, key: bytes, is_json: bool,
                 trigger: list[int] | None = None) -> None:
        self.future = future
        self.key = key  # the compile it waits on (CompilePool)
        self.matcher: Any = None
        self.is_json = is_json  # its mask also bans control characters (grammar.py)
        # Dormant while trigger is set: the token ids that wake the grammar, how many of
        # them end the output so far (matched), and for each prefix length the longest
        # proper prefix that is also its suffix (KMP), so a sequence that restarts
        # inside a partial match ([a, a, b] in "a a a b") is still found.
        self.trigger = tuple(trigger) if trigger else None
        self.fallback = _fallback(self.trigger) if trigger else ()
        self.matched = 0

    @property
    def dormant(self) -> bool:
        """The grammar has not started: the output is free."""
        return self.trigger is not None

    def advance(self, matched: int, token: int) -> int:
        """How many trigger tokens end the output after `token`, given `matched` before."""
        trigger = self.trigger
        while matched and trigger[matched] != token:
            matched = self.fallback[matched - 1]
        return matched + (trigger[matched] == token)

    def watch(self, token: int) -> None:
        """A dormant request's output token: the grammar wakes, fresh (its matcher has
        seen nothing), once the trigger is complete."""
        self.matched = self.advance(self.matched, token)
        if self.matched == len(self.trigger):
            self.trigger = None


def _fallback(trigger: tuple[int, ...]) -> list[int]:
    """KMP's failure table: entry i is the longest proper prefix of trigger[:i + 1] that
    is also a suffix of it."""
    table = [0] * len(trigger)
    k = 0
    for i in range(1, len(trigger)):
        while k and trigger[i] != trigger[k]:
            k = table[k - 1]
        if trigger[i] == trigger[k]:
            k += 1
        table[i] = k
    return table


class _DraftWalk:
    """One request's grammar walked along its proposed tokens while its rows are filled
    (_fill_along_drafts): tokens taken, the trigger's progress (None once the grammar is
    awake), tokens the matcher accepted (rolled back after), and whether the matcher
    refused one or terminated (its later rows are never used)."""

    __slots__ = ("grammar", "taken", "matched", "accepted", "stuck")

    def __init__(self, grammar: GrammarState) -> None:
        self.grammar = grammar
        self.taken = 0
        self.matched = grammar.matched if grammar.dormant else None
        self.accepted = 0
        self.stuck = False


class StructuredOutputManager:
    def __init__(self, checkpoint: Path, vocab_size: int, stop_token_ids: tuple[int, ...],
                 fill_threads: int = 1, compile_timeout_s: float = 60.0) -> None:
        """fill_threads: threads that fill a step's bitmask rows together (the engine's
        compute threads, idle at that point of the step); compile_timeout_s: a compile
        running longer is abandoned and its requests fail."""
        self.checkpoint = checkpoint
        self.fill_threads = max(1, fill_threads)
        self._batch_filler: Any = None
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._pool = CompilePool(COMPILE_SLOTS, compile_timeout_s, MAX_ABANDONED_COMPILES)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pending: list[Request] = []
        self._bitmask: torch.Tensor | None = None

    # ---- compiling ----------------------------------------------------------------------
    def _get_compiler(self) -> "GrammarCompiler":
        """Built on first use (the tokenizer's vocabulary scan costs ~0.25 s)."""
        with self._compiler_lock:
            if self._compiler is None:
                from engine.model.loader import load_tokenizer
                from engine.structured.grammar import GrammarCompiler
                self._compiler = GrammarCompiler(load_tokenizer(self.checkpoint),
                                                 self.vocab_size, list(self.stop_token_ids))
            return self._compiler

    def add(self, request: Request) -> None:
        """Start compiling the request's constraint (if it has one)."""
        spec = request.params.structured_outputs
        if spec is None:
            return
        key = spec.cache_key()
        compiled = self._compiler.cached(spec) if self._compiler is not None else None
        if compiled is not None:  # seen before: ready now, no thread hop
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(compiled)
        else:
            future = self._pool.submit(key, lambda: self._get_compiler().compile(spec))
        request.grammar = GrammarState(future, key, spec.kind in ("json", "json_object"),
                                       spec.reasoning_end)
        self._pending.append(request)

    def poll(self) -> list[tuple[Request, str]]:
        """Give finished compiles their matcher; return the requests whose compile failed,
        with why as "TypeName: message" (the engine finishes them with an error output,
        which the frontend turns back into that typed error)."""
        if not self._pending:
            return []
        self._pool.reap()
        failed, still = [], []
        for request in self._pending:
            future = request.grammar.future
            if request.status.finished:
                self._pool.release(request.grammar.key)
            elif not future.done():
                still.append(request)
            elif future.cancelled():  # cannot happen while a request waits on it
                failed.append((request, "EngineRequestError: its grammar compile was dropped"))
            elif (exc := future.exception()) is not None:
                self._pool.release(request.grammar.key)
                failed.append((request, f"{type(exc).__name__}: {exc}"))
            else:
                import xgrammar as xgr
                self._pool.release(request.grammar.key)
                request.grammar.matcher = xgr.GrammarMatcher(future.result())
        self._pending = still
        return failed

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout: float = POLL_WAIT_S) -> None:
        """Block until a pending compile finishes or timeout (the engine has nothing
        else to do)."""
        concurrent.futures.wait([r.grammar.future for r in self._pending]
                                + self._pool.running(), timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- each step ----------------------------------------------------------------------
    def bitmask(self, requests: list[Request]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed-token bitmask of the constrained rows among `requests` (the step's
        sampling rows, in order) and those rows' indices; None when no row is constrained.
        A dormant grammar's rows are not constrained."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        drafted = any(getattr(requests[i], "drafts", None) for i in rows)
        if not drafted:
            rows = [i for i in rows if not requests[i].grammar.dormant]
        if not rows:
            return None
        import xgrammar as xgr
        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            self._bitmask = xgr.allocate_token_bitmask(max(len(requests), 64), self.vocab_size)
        bitmask = self._bitmask[:len(requests)]
        if drafted:
            rows = self._fill_along_drafts(bitmask, requests, rows)
            if not rows:
                return None
        elif len(rows) == 1 or self.fill_threads == 1:
            for i in rows:
                requests[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
        else:  # rows in parallel: a bounded-string JSON schema costs ~0.2 ms a row (Zen 3)
            if self._batch_filler is None:
                self._batch_filler = xgr.BatchGrammarMatcher(self.fill_threads)
            self._batch_filler.batch_fill_next_token_bitmask(
                [requests[i].grammar.matcher for i in rows], bitmask, rows)
        json_rows = [i for i in rows if requests[i].grammar.is_json]
        if json_rows:
            bitmask[json_rows] &= self._compiler.no_control_mask
        return bitmask, rows

    @staticmethod
    def _fill_along_drafts(bitmask: torch.Tensor, requests: list,
                           rows: list[int]) -> list[int]:
        """Rows of requests with proposed tokens (engine/spec_decode/verify.py): a
        request's row j is filled with its matcher advanced over its first j proposed
        tokens, and the matcher is rolled back after its last row. Past a proposed token
        the grammar refuses, a row repeats the one before: the refused token can never
        be sampled there, so no later row of the request is used.

        A dormant grammar's proposed tokens advance a copy of its trigger watch instead:
        rows before the trigger completes are free (left out of the returned rows, those
        to mask); the grammar starts fresh at the row after it, and the matcher takes
        the proposed tokens from there. Only the copy moves, so nothing of the dormant
        state needs undoing; accept() moves the real one as tokens are emitted."""
        walks: dict[int, _DraftWalk] = {}
        masked: list[int] = []
        for i in rows:
            view = requests[i]
            grammar = view.grammar
            walk = walks.get(id(grammar))
            if walk is None:
                walk = walks[id(grammar)] = _DraftWalk(grammar)
            drafts = getattr(view, "drafts", ())
            if not walk.stuck and len(drafts) > walk.taken:  # rows come in order
                token = drafts[walk.taken]
                walk.taken += 1
                if walk.matched is not None:
                    walk.matched = grammar.advance(walk.matched, token)
                    if walk.matched == len(grammar.trigger):
                        walk.matched = None  # awake from the next row
                else:
                    ok = grammar.matcher.accept_token(token)
                    walk.accepted += ok
                    walk.stuck = not ok or grammar.matcher.is_terminated()
            if walk.matched is not None:
                continue  # still dormant at this row
            if walk.stuck:  # the row before was awake and filled (it took the token)
                bitmask[i] = bitmask[i - 1]
            else:
                grammar.matcher.fill_next_token_bitmask(bitmask, i)
            masked.append(i)
        for walk in walks.values():
            if walk.accepted:
                walk.grammar.matcher.rollback(walk.accepted)
        return masked

    @staticmethod
    def accept(request: Request, token: int) -> bool:
        """Advance the request's matcher; False if the grammar does not allow the token
        (cannot happen for a token sampled under its mask). A dormant grammar allows any
        token and only watches for its trigger."""
        grammar = request.grammar
        if grammar.dormant:
            grammar.watch(token)
            return True
        return grammar.matcher.accept_token(token)

    @staticmethod
    def terminated(request: Request) -> bool:
        """The constraint is complete: nothing more may be generated (never while it is
        dormant: the request is as free as one without a constraint)."""
        grammar = request.grammar
        return not grammar.dormant and grammar.matcher.is_terminated()

    def shutdown(self) -> None:
        """Nothing to join: compile threads are daemons, and their results go nowhere."""
