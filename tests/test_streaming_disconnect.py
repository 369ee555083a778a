"""ClosingStreamingResponse (deployments/apis/streaming.py): a stream whose client goes
away, or whose request Serve cancels, stops at once even while engine outputs wake its
task on every pass of the event loop (a loaded ingress replica: issue 62's storm)."""
import asyncio

from starlette.responses import StreamingResponse

from deployments.apis.streaming import ClosingStreamingResponse

WAKES = 5000  # passes of the loop on which a new output arrives


class BusyStream:
    """A body woken by new output on every loop pass, as a loaded replica's streams are;
    counts the chunks it made after the client had gone."""

    def __init__(self) -> None:
        self.woken = asyncio.Event()
        self.gone = asyncio.Event()
        self.after_gone = 0
        self.closed = 0

    async def body(self):
        while True:
            await self.woken.wait()
            self.woken.clear()
            if self.gone.is_set():
                self.after_gone += 1
            yield b"data: x\n\n"

    async def wake_every_pass(self) -> None:
        for _ in range(WAKES):
            self.woken.set()
            await asyncio.sleep(0)

    async def disconnect_after(self, passes: int):
        for _ in range(passes):
            await asyncio.sleep(0)
        self.gone.set()
        return {"type": "http.disconnect"}

    async def close(self) -> None:
        self.closed += 1


SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


async def _send(message) -> None:
    pass


def _drop(make_response) -> BusyStream:
    async def run() -> BusyStream:
        s = BusyStream()
        waker = asyncio.create_task(s.wake_every_pass())
        await make_response(s)(SCOPE, lambda: s.disconnect_after(20), _send)
        waker.cancel()
        return s
    return asyncio.run(run())


def test_a_dropped_stream_stops_on_the_next_pass_of_a_busy_loop():
    s = _drop(lambda s: ClosingStreamingResponse(s.body(), s.close,
                                                 media_type="text/event-stream"))
    assert s.after_gone <= 1 and s.closed == 1


def test_starlettes_own_stream_is_what_kept_dropped_streams_running():
    """The cause, kept as a check that the test above can fail: Starlette's anyio task
    group cancels the body only when its awaited future is pending, never the case here."""
    s = _drop(lambda s: StreamingResponse(s.body()))
    assert s.after_gone > WAKES // 2


def test_serve_cancelling_the_request_stops_the_stream_and_closes_it():
    async def run():
        s = BusyStream()
        waker = asyncio.create_task(s.wake_every_pass())
        never = asyncio.Event()

        async def receive():
            await never.wait()

        task = asyncio.create_task(ClosingStreamingResponse(s.body(), s.close)(
            SCOPE, receive, _send))
        for _ in range(20):
            await asyncio.sleep(0)
        s.gone.set()
        task.cancel()  # Serve's cancellation of the replica call
        try:
            await task
            raise AssertionError("the cancellation was swallowed")
        except asyncio.CancelledError:
            pass
        waker.cancel()
        return s
    s = asyncio.run(run())
    assert s.after_gone <= 1 and s.closed == 1


def test_a_finished_stream_sends_everything_and_closes_once():
    async def run():
        sent, closed = [], []

        async def body():
            for i in range(3):
                yield f"data: {i}\n\n"

        async def close():
            closed.append(1)

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        await ClosingStreamingResponse(body(), close)(SCOPE, receive, send)
        return sent, closed
    sent, closed = asyncio.run(run())
    assert [m.get("body") for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n",
                                                 b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False and closed == [1]
