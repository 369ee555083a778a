"""Completions with several prompts: one engine request per prompt, one response.

OpenAI's /v1/completions takes a list of prompts and returns their choices
prompt-major (prompt i's choice c is choice i * n + c). Each prompt is its own
engine request, so the router spreads them over the data-parallel engines like any
other requests; merge_prompt_streams() interleaves their outputs as they come and
closes every stream (aborting at the engines) when the response is closed, on a
client disconnect included. echo_prompt() puts each prompt's text in front of its
choices' first output, as `echo` asks.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from engine.outputs import RequestOutput

_DONE = object()


def _reindex(out: RequestOutput, prompt_index: int, n: int) -> RequestOutput:
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(c, index=prompt_index * n + c.index) for c in out.outputs])


async def merge_prompt_streams(streams: list[AsyncIterator[RequestOutput]], n: int
                               ) -> AsyncIterator[RequestOutput]:
    """The outputs of every prompt's stream in arrival order, choice indexes
    prompt-major; the first error ends the whole response."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield _reindex(item, i, n)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # aborts what is still running at its engine


async def echo_prompt(stream: AsyncIterator[RequestOutput], prompt_text: str
                      ) -> AsyncIterator[RequestOutput]:
    """The stream with prompt_text in front of each choice's first output."""
    echoed: set[int] = set()
    try:
        async for out in stream:
            for c in out.outputs:
                if c.index not in echoed:
                    echoed.add(c.index)
                    c.text = prompt_text + c.text
            yield out
    finally:
        await stream.aclose()
