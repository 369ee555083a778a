"""Disconnect storm: N live streams dropped by their clients at once, and how long the
engines take to stop running them.

    python bench/disconnect_storm.py                        # flotilla serve, 256 and 1,024
    python bench/disconnect_storm.py --launch serve-run     # `serve run deployments.app:build_app`
    python bench/disconnect_storm.py --launch serve-run-haproxy  # the same, HAProxy in front
    python bench/disconnect_storm.py --url http://127.0.0.1:8000 --streams 256
    python bench/disconnect_storm.py --launch bare-serve-run  # no Flotilla: Serve's floor

The server runs the mock engine (DP=2, 20 ms a token, so a 1,500-token stream would run
30 s on its own). Each stream is a raw socket (so a thousand clients cost the benchmark
little CPU); once every stream has had its first event and /metrics reports all of them
running, every socket is closed in one loop pass. Then /metrics is scraped back to back
until the engines run nothing: printed are the time from the drop to 0 running
("cleared"), and the slowest /metrics answers while every stream ran (scraped every
0.25 s for --hold-s seconds before the drop) and after the drop (issue 62: cleared
within 1 s, /metrics within 1 s throughout).

`serve-run-haproxy` runs `serve run` with `RAY_SERVE_ENABLE_HA_PROXY=1`, as cluster.yaml,
the Helm chart and `flotilla serve` run Serve. `bare-serve-run` runs no Flotilla code: bench/bare_sse.py's paced app (one replica, one
ticker waking every stream each 20 ms, its own /metrics count) behind the same `serve run`
proxy, so the time Serve alone takes to cancel a dropped storm is measured beside ours.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench.serve import FLOTILLA, REPO, Server, start_server, stop_server  # noqa: E402
from deployments.cli import haproxy_env, stop_haproxy  # noqa: E402

MODEL = "mock"
ITL_S = 0.02
MAX_TOKENS = 1500
MAX_NUM_SEQS = 1024  # per engine: 1,024 streams all run (the default 256 would queue some)
EXTRA: list[str] = []  # more `key=value` app options for serve run (--option)


def launch_argv(kind: str, port: int) -> list[str]:
    """The server's command line: `flotilla serve` or Serve's own `serve run`."""
    if kind == "flotilla":
        return [FLOTILLA, "serve", "--model", MODEL, "--data-parallel-size", "2",
                "--mock-itl-s", str(ITL_S), "--max-num-seqs", str(MAX_NUM_SEQS),
                "--port", str(port)]
    serve = str(Path(sys.executable).parent / "serve")  # serve-run[-haproxy]: env differs
    if kind == "bare-serve-run":
        return [serve, "run", "bench.bare_sse:paced_app", f"itl_s={ITL_S}"]
    return [serve, "run", "deployments.app:build_app", f"model={MODEL}",
            "data_parallel_size=2", f"mock_itl_s={ITL_S}",
            f"max_num_seqs={MAX_NUM_SEQS}", *EXTRA]  # on Serve's own port, 8000


def running(host: str, port: int) -> tuple[float, float]:
    """(requests running over the engines, seconds /metrics took to answer)."""
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                  .encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    took = time.monotonic() - start
    total = 0.0
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total, took


async def open_stream(host: str, port: int, index: int, model: str = MODEL,
                      max_tokens: int = MAX_TOKENS, prefix: str = "") -> asyncio.StreamWriter:
    """One streamed completion, read up to its first event; returns its writer (the
    suite's storm test opens its streams with this too: tests/e2e/test_serve_app.py)."""
    body = json.dumps({"model": model, "prompt": f"storm {index}", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST %s/v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (prefix.encode(), host.encode(), len(body), body))
    await writer.drain()
    seen = b""
    while b"data: " not in seen:
        chunk = await asyncio.wait_for(reader.read(4096), 120)
        if not chunk:
            raise RuntimeError(f"stream {index} closed before its first event: {seen[:300]!r}")
        seen += chunk
    if not seen.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"stream {index}: {seen[:300]!r}")
    return writer


async def storm(host: str, port: int, streams: int, hold_s: float = 0.0) -> dict:
    """Open `streams` streams, wait until all run, drop them at once, time the clearing."""
    slowest = 0.0  # the slowest /metrics answer while the streams ran
    writers = await asyncio.gather(*(open_stream(host, port, i) for i in range(streams)))
    deadline = time.monotonic() + 60
    while True:
        count, took = await asyncio.to_thread(running, host, port)
        slowest = max(slowest, took)
        if count >= streams or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    if count < streams:
        raise RuntimeError(f"only {count} of {streams} streams running")
    held = time.monotonic() + hold_s  # streaming on: the server at its steady load
    while time.monotonic() < held:
        count, took = await asyncio.to_thread(running, host, port)
        slowest = max(slowest, took)
        await asyncio.sleep(0.25)
    for w in writers:
        w.transport.abort()  # a reset, as a killed client's kernel sends
    dropped = time.monotonic()
    cleared, slowest_after = None, 0.0
    while time.monotonic() - dropped < 120:
        count, took = await asyncio.to_thread(running, host, port)
        slowest_after = max(slowest_after, took)
        if count == 0:
            cleared = time.monotonic() - dropped
            break
    return {"streams": streams, "cleared_s": cleared, "metrics_under_load_s": slowest,
            "metrics_after_drop_s": slowest_after, "running_at_end": count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an already running server (the mock model, DP=2)")
    ap.add_argument("--launch", default="flotilla", choices=(
        "flotilla", "serve-run", "serve-run-haproxy", "bare-serve-run"))
    ap.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--option", action="append", default=[],
                    help="an app option for serve run, key=value (e.g. stream_interval_s=0.05)")
    ap.add_argument("--hold-s", type=float, default=5.0,
                    help="seconds the streams run, all of them running, before the drop")
    args = ap.parse_args()
    if args.hold_s > MAX_TOKENS * ITL_S / 3:  # the streams would end on their own meanwhile
        ap.error(f"--hold-s must stay under {MAX_TOKENS * ITL_S / 3:g} s: streams that near "
                 "their natural end clear without any abort")
    EXTRA.extend(args.option)
    proc = haproxy_dir = None
    if args.url:
        host, _, port = args.url.removeprefix("http://").rstrip("/").partition(":")
        port = int(port or 80)
    else:
        host, port = "127.0.0.1", args.port if args.launch == "flotilla" else 8000
        log = Path(tempfile.mkdtemp(prefix="storm-")) / "server.log"
        env = {"RAY_TMPDIR": tempfile.mkdtemp(prefix="ray-", dir="/tmp")}
        if args.launch == "serve-run-haproxy":  # as cluster.yaml's `ray start` lines run Serve
            haproxy_dir = tempfile.mkdtemp(prefix="sh-", dir="/tmp")  # short: haproxy_env
            env.update(haproxy_env(haproxy_dir))
        proc = start_server(Server(args.launch, launch_argv(args.launch, port), MODEL,
                                   env=env, cwd=REPO), port, log)
        print(f"server: {args.launch} (log {log})", flush=True)
    try:
        for n in args.streams:
            result = asyncio.run(storm(host, port, n, args.hold_s))
            print(json.dumps(result), flush=True)
            time.sleep(2)
    finally:
        if proc is not None:
            stop_server(proc)
        if haproxy_dir is not None:
            stop_haproxy(haproxy_dir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
