"""The streamed response every API answers with: its body runs in the request's own task,
and a client that goes away cancels that task with plain asyncio.

Starlette's StreamingResponse runs the body in an anyio task group beside a task that
listens for the disconnect, and on a disconnect cancels the group's scope. anyio
delivers a scope's cancellation only to a task whose awaited future is still pending,
and retries on the next loop pass otherwise. Under load a stream's task is woken by
new engine outputs on nearly every pass of the ingress's loop, so its future is done
whenever anyio looks: 256 dropped streams on one Serve ingress replica (the mock
engine at 20 ms a token) were cancelled 2-7 s after their disconnect (issue 62;
instrumented session 43: the disconnect seen within 1.2 s, anyio's cancel of the body
tasks at 5.7-7.3 s), and longer still the longer they had streamed, up to their
natural end 30 s on. Serve's own cancellation of the request (its proxy's
`ray.cancel`) waited behind the same task group. asyncio's Task.cancel marks a task
whose future is done and cancels it at its next step, so here the body runs in the
calling task and the listener cancels that task directly: each dropped stream's engine
request is aborted on the next pass of the loop.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """A stream that closes its body, and the engine stream behind it, however it ends:
    a client that goes away mid-stream, a body never started (whose request still opened
    an engine stream), Serve cancelling the request. close: that engine stream's."""

    def __init__(self, content, close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        listener = asyncio.ensure_future(self._cancel_on_disconnect(receive, task))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # ours (the client left): the response ends quietly, as Starlette's does;
            # anyone else's (Serve's, a shutdown's) goes on up
            gone = listener.done() and not listener.cancelled() and listener.result()
            if not gone or task.uncancel() > 0:
                raise
        except OSError as exc:  # ASGI 2.4 servers: a send to a closed connection
            raise ClientDisconnect() from exc
        finally:
            listener.cancel()
            closing = getattr(self.body_iterator, "aclose", None)
            if closing is not None:
                await closing()
            await self._close()
        if self.background is not None:
            await self.background()

    async def _cancel_on_disconnect(self, receive: Receive, task: asyncio.Task) -> bool:
        """Wait for the client's disconnect (Starlette's own listener: the request's
        body was read before the stream began), then cancel the streaming task; True
        when it did."""
        try:
            await self.listen_for_disconnect(receive)
        except Exception:  # noqa: BLE001 - a receive channel that broke tells nothing
            return False
        task.cancel()
        return True
