"""Frontend benchmark: the async EngineClient against mock engines in other processes.

Starts `python -m engine.mock --engines E` (zero latency model by default, so the
engines answer as fast as they can), opens N concurrent streams of T tokens each,
and prints streamed tokens/s and requests/s, plus the client's own cost per token
(CPU time of this process / tokens received), which is what the ingress pays.
--curve serves and connects over ZMQ CURVE (engine/wire/curve_auth.py), as engines
deployed under Serve do: run it beside a plain run to see what the encryption costs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

from engine import SamplingParams
from engine.model.loader import load_tokenizer, resolve_model
from engine.wire.core_client import EngineClient
from engine.wire.core_server import engine_addresses
from engine.wire.curve_auth import EngineKeys


def free_port_block(count: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65535:
            return base


async def run(args, addresses, tokenizer, keys: EngineKeys | None = None) -> None:
    client = await EngineClient.connect(
        addresses, tokenizer, handshake_timeout_s=60,
        keys={a: keys.for_clients() for a in addresses} if keys else None)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = list(range(100, 100 + args.prompt_len))

    async def one(i: int) -> int:
        n = 0
        async for out in client.generate(f"b{i}", prompt, params):
            n += len(out.outputs[0].token_ids)
        return n

    await asyncio.gather(*(one(-i - 1) for i in range(min(8, args.requests))))  # warm-up
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(i: int) -> int:
        async with sem:
            return await one(i)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    counts = await asyncio.gather(*(limited(i) for i in range(args.requests)))
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    await client.shutdown()
    tokens = sum(counts)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(f"engines={len(addresses)} concurrency={args.concurrency} requests={args.requests} "
          f"tokens/request={args.tokens} chunk={args.chunk_size} curve={keys is not None}")
    print(f"streamed tokens/s: {tokens / wall:.0f}   requests/s: {args.requests / wall:.1f}")
    print(f"client CPU per token: {cpu / tokens * 1e6:.1f} us   "
          f"(client CPU {cpu:.2f}s over {wall:.2f}s wall)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=1)
    parser.add_argument("--itl", type=float, default=0.0)
    parser.add_argument("--curve", action="store_true", help="engines serve over CURVE")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model("default"))
    base = f"tcp://127.0.0.1:{free_port_block(args.engines)}"
    addresses = engine_addresses(base, args.engines)
    keys = EngineKeys.generate() if args.curve else None
    keys_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    with keys_file:
        json.dump(dataclasses.asdict(keys) if keys else {}, keys_file)
    proc = subprocess.Popen([sys.executable, "-m", "engine.mock", "--address", base,
                             "--engines", str(args.engines), "--vocab-size", str(len(tokenizer)),
                             "--output-chunk-size", str(args.chunk_size), "--itl-s", str(args.itl),
                             *(["--curve-keys", keys_file.name] if keys else [])],
                            stderr=subprocess.DEVNULL)
    try:
        asyncio.run(run(args, addresses, tokenizer, keys))
    finally:
        os.unlink(keys_file.name)
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
