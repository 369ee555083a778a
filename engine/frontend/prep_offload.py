"""PrepOffload: a frontend's CPU-heavy request preparation, off its event loop.

Tokenizing a long prompt, rendering a chat template over a long conversation or a
tools section, tokenizing bad words and checking a structured-outputs grammar all ran
on the ingress's event loop, so one large request stalled every stream the replica
served (their tokens waited behind it). Such work goes to a small thread pool here:
HF's fast tokenizers drop the GIL while they encode, and even pure-Python work
(Jinja) yields the loop at the interpreter's switch interval. Small requests, the
common case, stay inline: a thread hop costs ~90 us (Intel Xeon with AMX), more than
their whole preparation.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
from typing import Any, Callable, TypeVar

T = TypeVar("T")

PREP_THREADS = 2
INLINE_CHARS = 2048  # prompt text or request body up to this size is prepared inline


def heavy_prompt(prompt: Any, params: Any) -> bool:
    """Whether preparing this generate() call is worth a thread: long prompt text to
    tokenize, bad words to tokenize, or a grammar to check."""
    if params.structured_outputs is not None or params.bad_words:
        return True
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return False
        prompt = prompt.get("prompt")
    return isinstance(prompt, str) and len(prompt) > INLINE_CHARS


class PrepOffload:
    def __init__(self, threads: int = PREP_THREADS) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="prepare")

    async def run(self, heavy: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs), on a thread when heavy, else inline. The thread runs it in
        a copy of the caller's context variables, as asyncio.to_thread does (the
        request's grammar-check deadline: engine/structured/check_limit.py)."""
        if not heavy:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Work already handed over finishes (its caller sees the client closed)."""
        self._pool.shutdown(wait=False)
