"""The OpenAI app served for real (uvicorn on a free port, its own thread and event loop)
over mock engines, for tests that need real HTTP: the fuzzer, hostile inputs, faults.

Engines are mock engine-core servers, in this process (threads) or, with
processes=True, each in its own process so that a test can SIGKILL or SIGSTOP it.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

MODEL = "mock-model"


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AppServer:
    url: str
    addresses: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)  # processes=True only
    clients: list = field(default_factory=list)  # the EngineClient the app made, once made


def check_openai_error(status: int, body: dict, where: str = "") -> None:
    """OpenAI's error shape: {"error": {"message": str, "type": str, "param", "code"}}."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{where}: {body}"
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], f"{where}: {body}"
    assert isinstance(err.get("type"), str) and err["type"], f"{where}: {body}"
    assert "param" in err and err.get("code") in (status, str(status)), f"{where}: {body}"


def _mock_process(address: str, vocab_size: int, itl_s: float,
                  ttft_s: float | None = None, scripted: bool = False) -> subprocess.Popen:
    extra = ([] if ttft_s is None else ["--ttft-s", str(ttft_s)]) + (
        ["--scripted"] if scripted else [])
    return subprocess.Popen([sys.executable, "-m", "engine.mock", "--address", address,
                             "--vocab-size", str(vocab_size), "--itl-s", str(itl_s), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def serve_app_over_mocks(tokenizer, engines: int = 2, *, processes: bool = False,
                         itl_s: float = 0.0, heartbeat_timeout_s: float = 10.0,
                         watch_processes: bool = False, scripted: bool = False,
                         **options) -> Iterator[AppServer]:
    """Yields the running server; stops the app, its client and the engines after.
    watch_processes: the client also polls the engine processes (a local deployment);
    without it, as in Serve, only dropped connections and heartbeats reveal a death.
    scripted: the engines emit a prompt's last [[emit]]text[[/emit]] directive, then
    EOS (engine/mock/script.py; in processes, the default model's tokenizer)."""
    import uvicorn

    from deployments.apis.server import IngressOptions, build_api_app
    from engine.wire.core_client import EngineClient
    from engine.wire.core_server import EngineCoreServer
    from engine.mock.config import MockConfig
    from engine.mock.core import MockEngineCore

    addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(engines)]
    servers, procs = [], []
    if processes:
        procs = [_mock_process(a, len(tokenizer), itl_s, scripted=scripted)
                 for a in addresses]
    else:
        for i, address in enumerate(addresses):
            core = MockEngineCore(MockConfig(engine_index=i, vocab_size=len(tokenizer),
                                             itl_s=itl_s, scripted=scripted),
                                  tokenizer=tokenizer if scripted else None)
            servers.append(EngineCoreServer(core, address, i, heartbeat_interval_s=0.2).start())
    server = AppServer("", addresses, procs)
    lock = None

    async def get_client():
        nonlocal lock
        import asyncio
        lock = lock or asyncio.Lock()
        async with lock:
            if not server.clients:
                alive = ([(lambda p=p: p.poll() is None) for p in procs]
                         if procs and watch_processes else None)
                server.clients.append(await EngineClient.connect(
                    addresses, tokenizer, handshake_timeout_s=30,
                    heartbeat_timeout_s=heartbeat_timeout_s, is_alive=alive))
        return server.clients[-1]

    app = build_api_app(get_client, IngressOptions(MODEL, **options))

    async def with_client_shutdown(scope, receive, send):
        """The app, plus: the engine client closes in the server's loop as it stops."""
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def receive_then_close():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                for client in server.clients:
                    await client.shutdown()
            return message
        return await app(scope, receive_then_close, send)

    port = free_tcp_port()
    uv = uvicorn.Server(uvicorn.Config(with_client_shutdown, host="127.0.0.1", port=port,
                                       log_level="warning", lifespan="on",
                                       timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200
        yield server
    finally:
        uv.should_exit = True
        thread.join(15)
        for s in servers:
            s.shutdown()
        for p in procs:
            p.kill()
            p.wait()
