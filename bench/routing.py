"""Routing benchmark: prefix-cache-aware routing vs least-loaded vs round robin.

Starts DP=4 mock engine-core servers (`python -m engine.mock`, one process each)
whose latency model charges prefill per uncached prompt token (one prefill at a time
per engine: --serial-prefill, a compute-bound engine) and decode per token, with the
mock's prefix cache (an LRU of --num-blocks blocks per engine). The same load goes
through EngineClient with routing = round_robin, least_loaded and prefix; the caches
are reset between runs.

Workloads:
  zipf  32 system prompts of 1-2k tokens, 1,024 requests whose system prompt follows a
        Zipf(1) popularity, each with its own 32-128-token question; closed loop at
        --concurrency requests in flight.
  chat  --conversations multi-turn chats arriving over --arrival-s: each turn re-sends
        the whole conversation (a shared 512-token system prompt of 4, the earlier
        turns with the answers the engine gave) plus a 64-256-token message after a
        think time; answers are 8-32 tokens.

Reported per policy: prefix-cache hit rate (engine stats: hit tokens / prompt tokens)
and its share of the ideal (one engine with all the engines' cache blocks that saw
every request in order; the unbounded-cache figure is printed too), TTFT p50 / p99 (generate() to first output, client side), throughput, and
the load spread: requests and computed prefill tokens of the busiest engine over the
mean.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from frontend import free_port_block  # bench/ is on the path when run as a script

from engine import SamplingParams
from engine.core.block_hash import cacheable_blocks, prefix_block_hashes
from engine.model.loader import load_tokenizer, resolve_model
from engine.wire.core_client import EngineClient
from engine.wire.core_server import engine_addresses

POLICIES = ("round_robin", "least_loaded", "prefix")
# --served: what two CPU cores running the default model get through in minutes
SERVED_DEFAULTS = {"engines": 2, "prompts": 16, "requests": 128, "concurrency": 4,
                   "max_tokens": 4, "policies": "least_loaded,prefix"}
BLOCK = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def zipf_workload(rng: random.Random, prompts: int, requests: int,
                  system_len: tuple[int, int] = (1024, 2048),
                  question_len: tuple[int, int] = (32, 128)) -> list[list[int]]:
    """Prompts of `requests` requests: a Zipf(1)-popular system prompt plus a question."""
    systems = [_tokens(rng, rng.randint(*system_len)) for _ in range(prompts)]
    weights = [1 / (k + 1) for k in range(prompts)]
    picks = rng.choices(range(prompts), weights, k=requests)
    return [systems[p] + _tokens(rng, rng.randint(*question_len)) for p in picks]


def ideal_hit_rate(prompts: list[list[int]], capacity: int | None) -> float:
    """The hit rate of one engine that saw every prompt in order with `capacity` cache
    blocks (LRU, as the mock's cache; None: unbounded): what routing could reach if
    all the engines' caches were one."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ids in prompts:
        hashes = prefix_block_hashes(ids, BLOCK)
        n = 0
        for h in hashes[:cacheable_blocks(len(ids), BLOCK)]:
            if h not in cache:
                break
            n += 1
        hits += n * BLOCK
        total += len(ids)
        for h in reversed(hashes):
            cache[h] = None
            cache.move_to_end(h)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hits / total


@dataclass
class Result:
    ttfts: list[float]
    wall: float
    requests: int
    tokens: int
    per_engine: list[int]
    hit_rate: float
    prefill: list[int]  # prompt tokens each engine computed (not served from cache)


async def _one(client: EngineClient, rid: str, ids: list[int], max_tokens: int,
               ttfts: list[float], engine_of: dict[str, int]) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out_ids: list[int] = []
    async for out in client.generate(rid, ids, params):
        if not out_ids:
            ttfts.append(time.perf_counter() - start)
            engine_of[rid] = client._engine_of.get(rid, -1)  # where it ran (n=1: same id)
        out_ids += out.outputs[0].token_ids
    return out_ids


async def run_zipf(client: EngineClient, prompts: list[list[int]], concurrency: int,
                   max_tokens: int, tag: str) -> tuple[list[float], int, dict[str, int], float]:
    ttfts: list[float] = []
    engine_of: dict[str, int] = {}
    queue = list(enumerate(prompts))
    queue.reverse()
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i, ids = queue.pop()
            n = len(await _one(client, f"{tag}-{i}", ids, max_tokens, ttfts, engine_of))
            tokens += n
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, tokens, engine_of, time.perf_counter() - start


async def run_chat(client: EngineClient, rng: random.Random, args, tag: str
                   ) -> tuple[list[float], int, dict[str, int], float, list[list[int]]]:
    """Conversations arrive over --arrival-s (Poisson); each turn re-sends the whole
    conversation plus the user's next message after a think time (exponential, mean
    --think-s); answers are 8-32 tokens. The randomness is drawn up front from the seed,
    so every policy gets the same trace."""
    ttfts: list[float] = []
    engine_of: dict[str, int] = {}
    conversations, turns = args.conversations, args.turns
    systems = [_tokens(rng, 512) for _ in range(4)]
    starts = sorted(rng.uniform(0, args.arrival_s) for _ in range(conversations))
    plan = [[(_tokens(rng, rng.randint(64, 256)), rng.expovariate(1 / args.think_s),
              rng.randint(8, 32)) for _ in range(turns)] for _ in range(conversations)]
    sent: list[tuple[float, list[int]]] = []
    tokens = 0
    t0 = time.perf_counter()

    async def chat(c: int) -> None:
        nonlocal tokens
        await asyncio.sleep(starts[c])
        history = list(systems[c % len(systems)])
        for t, (message, think, max_tokens) in enumerate(plan[c]):
            if t:
                await asyncio.sleep(think)
            history += message
            sent.append((time.perf_counter(), list(history)))
            answer = await _one(client, f"{tag}-{c}-{t}", history, max_tokens, ttfts, engine_of)
            tokens += len(answer)
            history += answer
    await asyncio.gather(*(chat(c) for c in range(conversations)))
    return (ttfts, tokens, engine_of, time.perf_counter() - t0,
            [ids for _, ids in sorted(sent, key=lambda x: x[0])])


async def bench_policy(addresses, tokenizer, policy: str, args, workload: str) -> tuple[
        Result, list[list[int]]]:
    client = await EngineClient.connect(addresses, tokenizer, handshake_timeout_s=60,
                                        routing=policy)
    try:
        assert await client.reset_prefix_cache(), "engines busy: could not reset"
        rng = random.Random(args.seed)
        if workload == "zipf":
            prompts = zipf_workload(rng, args.prompts, args.requests)
            ttfts, tokens, engine_of, wall = await run_zipf(
                client, prompts, args.concurrency, args.max_tokens, f"{policy}-z")
        else:
            ttfts, tokens, engine_of, wall, prompts = await run_chat(
                client, rng, args, f"{policy}-c")
        stats = await client.get_stats()
    finally:
        await client.shutdown()
    per_engine = [0] * len(addresses)
    for index in engine_of.values():
        per_engine[index] += 1
    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    prefill = [s.prefix_cache_queries - s.prefix_cache_hits for s in stats]
    return Result(ttfts, wall, len(ttfts), tokens, per_engine, hits / max(queries, 1),
                  prefill), prompts


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def print_table(workload: str, results: dict[str, Result], ideal: float,
                unbounded: float) -> None:
    ll = results.get("least_loaded")
    print(f"\nworkload {workload}: ideal hit rate {ideal:.1%} (one engine with all the "
          f"engines' cache blocks, LRU; {unbounded:.1%} with an unbounded cache)")
    print(f"{'routing':<13} {'hit rate':>8} {'of ideal':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'p50/LL':>7} {'req/s':>7} {'tok/s':>7} {'req max/mean':>12} "
          f"{'prefill max/mean':>16}  requests per engine")
    for policy, r in results.items():
        p50, p99 = _q(r.ttfts, 0.5), _q(r.ttfts, 0.99)
        ratio = p50 / _q(ll.ttfts, 0.5) if ll else float("nan")
        mean_req = statistics.mean(r.per_engine) if r.per_engine else float("nan")
        req_spread = max(r.per_engine) / mean_req if r.per_engine else float("nan")
        mean_prefill = statistics.mean(r.prefill) or 1
        print(f"{policy:<13} {r.hit_rate:>8.1%} {r.hit_rate / ideal:>8.1%} "
              f"{p50 * 1e3:>7.1f}ms {p99 * 1e3:>7.1f}ms {ratio:>7.2f} "
              f"{r.requests / r.wall:>7.1f} {r.tokens / r.wall:>7.0f} "
              f"{req_spread:>12.2f} {max(r.prefill) / mean_prefill:>16.2f}"
              f"  {r.per_engine or ''}")


# ---- the default model, served: flotilla serve with DP=2 engines -------------------------
async def _served_request(http, port: int, ids: list[int], max_tokens: int,
                          ttfts: list[float]) -> int:
    """One streamed completion; its TTFT (to the first text) goes to `ttfts`; returns its
    output tokens (from the usage chunk: one SSE event may carry several tokens)."""
    body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = True, 0
    async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                           json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first and chunk.get("choices"):
                ttfts.append(time.perf_counter() - start)
                first = False
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


def _prefix_counters(port: int) -> dict[str, tuple[float, float]]:
    """Engine label -> (prefix-cache queries, hits), from /metrics. Engines report their
    stats with their outputs and heartbeats: wait a heartbeat after the load first."""
    import urllib.request
    time.sleep(3.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name not in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            continue
        engine = line.split('engine="', 1)[1].split('"', 1)[0]
        out.setdefault(engine, [0.0, 0.0])[name.endswith("hits")] += float(
            line.rsplit(" ", 1)[1])
    return {e: (q, h) for e, (q, h) in out.items()}


def run_served(args) -> None:
    """The Zipf workload (scaled down for a CPU) against `flotilla serve` of the default
    model on DP=2 engines, one server per policy; hits from vllm:prefix_cache_hits."""
    import httpx
    from serve import FLOTILLA, Server, start_server, stop_server

    from engine.wire.ports import free_port
    rng = random.Random(args.seed)
    prompts = zipf_workload(rng, args.prompts, args.requests, (256, 768), (16, 48))
    work = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    print(f"flotilla serve --model default, DP={args.engines} ({args.engine_num_cpus} CPU "
          f"each), {args.prompts} system prompts of 256-768 tokens, {args.requests} requests "
          f"(Zipf), {args.max_tokens} output tokens, concurrency {args.concurrency}; "
          f"CPU: {_cpu_name()}")
    results: dict[str, Result] = {}
    for policy in args.policies.split(","):
        port = free_port("127.0.0.1")
        argv = [FLOTILLA, "serve", "--model", "default", "--served-model-name", "default",
                "--port", str(port), "--data-parallel-size", str(args.engines),
                "--engine-num-cpus", str(args.engine_num_cpus), "--ingress-num-cpus", "0",
                "--routing", policy, "--log-stats-interval-s", "0"]
        proc = start_server(Server(f"flotilla serve --routing {policy}", argv, "default"),
                            port, work / f"{policy}.log")
        try:
            asyncio.run(_served_warmup(port))
            before = _prefix_counters(port)
            ttfts: list[float] = []
            tokens = 0

            async def load() -> float:
                nonlocal tokens
                queue = list(reversed(prompts))
                async with httpx.AsyncClient(timeout=600) as http:
                    async def worker() -> None:
                        nonlocal tokens
                        while queue:
                            n = await _served_request(http, port, queue.pop(),
                                                      args.max_tokens, ttfts)
                            tokens += n  # not `tokens += await ...`: that reads before
                    start = time.perf_counter()
                    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
                    return time.perf_counter() - start
            wall = asyncio.run(load())
            after = _prefix_counters(port)
        finally:
            stop_server(proc)
        deltas = {e: (q - before.get(e, (0, 0))[0], h - before.get(e, (0, 0))[1])
                  for e, (q, h) in sorted(after.items())}
        queries = sum(q for q, _ in deltas.values())
        hits = sum(h for _, h in deltas.values())
        results[policy] = Result(ttfts, wall, len(ttfts), tokens, [],
                                 hits / max(queries, 1), [int(q - h) for q, h in deltas.values()])
        print(f"  {policy}: prefix_cache_queries +{queries:.0f}, prefix_cache_hits "
              f"+{hits:.0f}", flush=True)
    ideal = ideal_hit_rate(prompts, None)
    print_table("zipf (served, default model)", results, ideal, ideal)


async def _served_warmup(port: int) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=600) as http:
        await _served_request(http, port, list(range(1000, 1040)), 2, [])


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            flags = open("/proc/cpuinfo").read()
            isa = "AVX-512" if " avx512f" in flags else "AVX2"
            return f"{line.split(':', 1)[1].strip()} ({isa})"
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("zipf", "chat", "both"), default="both")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32, help="zipf: system prompts")
    parser.add_argument("--requests", type=int, default=1024, help="zipf: requests")
    parser.add_argument("--concurrency", type=int, default=64, help="zipf: in flight")
    parser.add_argument("--conversations", type=int, default=64, help="chat: conversations")
    parser.add_argument("--turns", type=int, default=10, help="chat: turns per conversation")
    parser.add_argument("--arrival-s", type=float, default=4.0,
                        help="chat: conversations start over this many seconds")
    parser.add_argument("--think-s", type=float, default=0.3,
                        help="chat: mean pause between an answer and the next message")
    parser.add_argument("--max-tokens", type=int, default=16, help="zipf: output tokens")
    parser.add_argument("--prefill-us-per-token", type=float, default=20.0,
                        help="engine prefill cost per uncached prompt token (microseconds)")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="decode cost per token")
    parser.add_argument("--num-blocks", type=int, default=1024,
                        help="prefix-cache blocks per engine (16 tokens each)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--served", action="store_true",
                        help="the default model under flotilla serve instead of the mocks "
                             "(Zipf workload, scaled down: " + ", ".join(
                                 f"{k}={v}" for k, v in SERVED_DEFAULTS.items()) + ")")
    parser.add_argument("--engine-num-cpus", type=float, default=1.0,
                        help="--served: CPUs per engine")
    args = parser.parse_args()
    if args.served:
        for name, value in SERVED_DEFAULTS.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
        run_served(args)
        return
    tokenizer = load_tokenizer(resolve_model("default"))
    base = f"tcp://127.0.0.1:{free_port_block(args.engines)}"
    addresses = engine_addresses(base, args.engines)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.mock", "--address", base,
         "--engines", str(args.engines), "--vocab-size", str(len(tokenizer)),
         "--prefill-s-per-token", str(args.prefill_us_per_token * 1e-6), "--serial-prefill",
         "--itl-s", str(args.itl_ms * 1e-3), "--num-blocks", str(args.num_blocks),
         "--max-model-len", str(args.num_blocks * BLOCK), "--block-size", str(BLOCK)],
        stderr=subprocess.DEVNULL)
    print(f"DP={args.engines} mock engines: prefill {args.prefill_us_per_token:g} us per "
          f"uncached token (serial), decode {args.itl_ms:g} ms per token, "
          f"{args.max_tokens} output tokens, {args.num_blocks} cache blocks of {BLOCK} "
          f"per engine")
    workloads = ("zipf", "chat") if args.workload == "both" else (args.workload,)
    try:
        for workload in workloads:
            results: dict[str, Result] = {}
            prompts: list[list[int]] = []
            for policy in args.policies.split(","):
                results[policy], prompts = asyncio.run(
                    bench_policy(addresses, tokenizer, policy, args, workload))
            print_table(workload, results,
                        ideal_hit_rate(prompts, args.engines * args.num_blocks),
                        ideal_hit_rate(prompts, None))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
