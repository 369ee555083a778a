"""/metrics while the ingress autoscales under live streams (issue 41, item 1).

    python bench/scrape.py                  # 256 live streams, 20 scrapes
    python bench/scrape.py --streams 64 --scrapes 40

Starts `flotilla serve --model mock` (DP=2, mock engines) with the ingress autoscaled
from one replica (target 64 ongoing requests each, as the default, up to three), opens
`streams` streamed completions that outlive the run, waits until the ingress has
scaled out (and kept its size for a few seconds) and every stream has its first
token, then scrapes /metrics `scrapes` times
through the server's load balancer, each on a new connection, so the scrapes reach
every replica, the ones made by the scale-out (which never served a request) included.

Printed per scrape: how long it took and each engine's running, waiting and KV usage;
then the scrape latency p50 / max. The checks (what tests/e2e/test_metrics_scale_out.py
asserts): every scrape shows every engine's gauges, and the requests the engines count
(running + waiting) are the live streams, within the streams that started or ended in
the last stats interval.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench.serve import (  # noqa: E402
    FLOTILLA, Server, dump_replica_stacks, start_server, stop_server)
from bench.soak import descendants  # noqa: E402

ENGINES = ("0", "1")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:kv_cache_usage_perc")
# how old an engine gauge may be: a scrape asks the engines for their stats
# (deployments/apis/server.py, STATS_WAIT_S) and falls back to the last stats an output
# carried; a stream that started or ended within this window may or may not be counted
STATS_INTERVAL_S = 1.0
SCALE_OUT_TIMEOUT_S = 120.0
SETTLED_S = 5.0
SCRAPE_TIMEOUT_S = 15.0  # Prometheus' default scrape_timeout is 10 s


def scaled_server(port: int, max_replicas: int = 3, itl_s: float = 0.2) -> Server:
    """`flotilla serve --model mock`, DP=2, the ingress autoscaled 1..max_replicas at the
    default target (64 ongoing requests a replica), scaling up after 1 s of load."""
    scaling = {"min_replicas": 1, "max_replicas": max_replicas, "upscale_delay_s": 1.0}
    return Server("flotilla mock", [FLOTILLA, "serve", "--model", "mock", "--port", str(port),
                                    "--data-parallel-size", "2", "--mock-itl-s", str(itl_s),
                                    "--served-model-name", "mock", "--ingress-num-cpus", "0",
                                    "--ingress-autoscaling", json.dumps(scaling)], "mock")


def ingress_replicas(root: int) -> int:
    """The server's ingress replica processes (Ray names them by deployment)."""
    count = 0
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        count += b"ServeReplica" in cmd and b"OpenAIIngress" in cmd
    return count


@dataclass
class Streams:
    """Long streams kept open, and when each got its first token or ended."""

    opened: int = 0
    first_token_at: list[float] = field(default_factory=list)
    ended_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def live(self) -> int:
        return len(self.first_token_at) - len(self.ended_at)

    def churn(self, since: float) -> int:
        """Streams that started or ended after `since`."""
        return sum(t >= since for t in self.first_token_at + self.ended_at)


async def _stream(http: aiohttp.ClientSession, base_url: str, max_tokens: int,
                  streams: Streams) -> None:
    body = {"model": "mock", "prompt": "keep streaming", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    streams.opened += 1
    started = False
    try:
        async with http.post(f"{base_url}/v1/completions", json=body) as r:
            if r.status != 200:
                streams.errors.append(f"HTTP {r.status} {(await r.text())[:200]}")
                return
            async for raw in r.content:
                if not started and raw.startswith(b"data: "):
                    started = True
                    streams.first_token_at.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        streams.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        if started:
            streams.ended_at.append(time.monotonic())


@dataclass
class Scrape:
    seconds: float
    at: float  # monotonic, when it was answered
    gauges: dict[str, dict[str, float]]  # gauge name -> engine -> value
    live: int  # streams live when it was answered
    churn: int  # streams that started or ended in the stats interval before it

    def engines(self, gauge: str) -> set[str]:
        return set(self.gauges.get(gauge, {}))

    def counted(self) -> float:
        """Requests the engines count: running + waiting, over the engines."""
        return sum(sum(self.gauges.get(g, {}).values()) for g in GAUGES[:2])


def parse_gauges(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in GAUGES and 'engine="' in line:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out.setdefault(name, {})[engine] = float(line.rsplit(" ", 1)[1])
    return out


# one scrape, timed in a process of its own: in this one the streams' event loop holds
# the GIL most of the time (256 streams' events), which a thread's request waits behind
_SCRAPER = """
import sys, time, httpx
began = time.monotonic()
try:
    r = httpx.get(sys.argv[1], timeout=float(sys.argv[2]), headers={"Connection": "close"})
    status, text = r.status_code, r.text
except httpx.HTTPError as exc:
    status, text = 0, repr(exc)
print(f"{time.monotonic() - began} {status}")
sys.stdout.write(text)
"""


def scrape(base_url: str, streams: Streams) -> Scrape:
    """One scrape on a new connection (the load balancer picks a replica for each)."""
    sent = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _SCRAPER, f"{base_url}/metrics",
                          str(SCRAPE_TIMEOUT_S)], capture_output=True, text=True,
                         timeout=SCRAPE_TIMEOUT_S + 30)
    head, _, text = out.stdout.partition("\n")
    seconds, status = head.split()
    if status != "200":  # no answer is a scrape without gauges
        print(f"scrape failed after {float(seconds):.1f} s: {status} {text[:200]}")
    gauges = parse_gauges(text) if status == "200" else {}
    return Scrape(float(seconds), time.monotonic(), gauges, streams.live,
                  streams.churn(sent - STATS_INTERVAL_S))


@dataclass
class Report:
    streams: int
    replicas: int  # ingress replicas when the scrapes began
    scale_out_s: float  # from the first stream to the scaled-out ingress
    scrapes: list[Scrape]
    errors: list[str]

    def check(self) -> list[str]:
        problems = list(self.errors)
        if self.replicas < 2:
            problems.append(f"the ingress did not scale out: {self.replicas} replica")
        for i, s in enumerate(self.scrapes):
            for gauge in GAUGES:
                if s.engines(gauge) != set(ENGINES):
                    problems.append(f"scrape {i}: {gauge} for engines {sorted(s.engines(gauge))}")
            if abs(s.counted() - s.live) > s.churn:
                problems.append(f"scrape {i}: the engines count {s.counted():.0f} requests, "
                                f"{s.live} streams live, {s.churn} started or ended")
        return problems

    def latencies(self) -> list[float]:
        return sorted(s.seconds for s in self.scrapes)

    def print(self) -> None:
        print(f"{self.streams} live streams, ingress scaled out to {self.replicas} replicas "
              f"in {self.scale_out_s:.1f} s")
        for i, s in enumerate(self.scrapes):
            per_engine = "  ".join(
                f"engine {e}: running {s.gauges.get(GAUGES[0], {}).get(e, float('nan')):.0f} "
                f"waiting {s.gauges.get(GAUGES[1], {}).get(e, float('nan')):.0f} "
                f"kv {s.gauges.get(GAUGES[2], {}).get(e, float('nan')):.3f}" for e in ENGINES)
            print(f"scrape {i:2d}: {s.seconds * 1000:6.0f} ms  {per_engine}  (live {s.live})")
        lat = self.latencies()
        if lat:
            print(f"scrape latency: p50 {lat[len(lat) // 2] * 1000:.0f} ms, "
                  f"max {lat[-1] * 1000:.0f} ms over {len(lat)}")
        problems = self.check()
        print("checks: " + ("all passed" if not problems else "; ".join(problems[:10])))


async def scale_out_and_scrape(base_url: str, root: int, streams: int = 256,
                               scrapes: int = 20, max_tokens: int = 2000,
                               interval_s: float = 0.25,
                               stacks: Path | None = None) -> Report:
    """Open `streams` long streams, wait for the scale-out and every first token, scrape
    `scrapes` times (in a thread: the streams' loop keeps reading meanwhile), then close
    the streams. A scrape that times out has the replicas' stacks written to `stacks`."""
    state = Streams()
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = [asyncio.ensure_future(_stream(http, base_url, max_tokens, state))
                 for _ in range(streams)]
        began = changed = time.monotonic()
        replicas = ingress_replicas(root)
        try:
            # until every stream has its first token and the ingress has scaled out and
            # kept its replica count for SETTLED_S (a replica still starting takes a
            # core of a small machine)
            while time.monotonic() - began < SCALE_OUT_TIMEOUT_S and not state.errors:
                now_replicas = ingress_replicas(root)
                if now_replicas != replicas:
                    replicas, changed = now_replicas, time.monotonic()
                if (replicas >= 2 and len(state.first_token_at) == streams
                        and time.monotonic() - changed >= SETTLED_S):
                    break
                await asyncio.sleep(0.5)
            scale_out_s = time.monotonic() - began
            replicas = ingress_replicas(root)
            done: list[Scrape] = []
            for _ in range(scrapes if not state.errors else 0):
                done.append(await asyncio.to_thread(scrape, base_url, state))
                if done[-1].seconds >= SCRAPE_TIMEOUT_S and stacks is not None:
                    await asyncio.to_thread(dump_replica_stacks, stacks)
                    print(f"replica stacks of a scrape that timed out: {stacks}")
                    stacks = None  # once
                await asyncio.sleep(interval_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return Report(streams, replicas, scale_out_s, done, state.errors)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--scrapes", type=int, default=20)
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args()
    log = Path(tempfile.mkdtemp(prefix="scrape-")) / "server.log"
    proc = start_server(scaled_server(args.port), args.port, log)
    try:
        report = asyncio.run(scale_out_and_scrape(f"http://127.0.0.1:{args.port}", proc.pid,
                                                  args.streams, args.scrapes,
                                                  stacks=log.with_suffix(".stacks")))
    finally:
        stop_server(proc)
    report.print()
    return 1 if report.check() else 0


if __name__ == "__main__":
    sys.exit(main())
