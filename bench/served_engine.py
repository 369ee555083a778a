"""The engine served over ZMQ alone, and beside what `flotilla serve` runs: where the
served path's throughput goes before HTTP.

The engine (default model) runs behind EngineCoreServer in a process of its own; a
client in this process sends `bench/serve.py`'s model workload over ZMQ (random
64-token prompts, 128 sampled tokens, ignore_eos) as a closed loop at the given
concurrency. Each round measures it three ways, one after the other:

    alone        nothing else running
    beside-ray   beside an idle local Ray (ray.init in another process)
    beside-serve beside an idle `flotilla serve --model mock` (Ray, Serve's controller
                 and proxy, HAProxy, an ingress, an engine replica, the coordinator)

after one untimed pass of the workload, so the cost of Ray's and Serve's background
processes to the engine's two compute threads is read off one run:

    python bench/served_engine.py --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.serve import _cpu_name, stop_server  # noqa: E402

_SERVER = """
import asyncio, sys, time
from deployments.serve.engine_server import build_on_own_thread
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.wire.core_server import EngineCoreServer
core = asyncio.run(build_on_own_thread(lambda: EngineCore(EngineConfig(model="default"))))
EngineCoreServer(core, sys.argv[1], 0).start()
print("engine serving", flush=True)
time.sleep(10**6)
"""

_IDLE_RAY = """
import time, ray
ray.init(include_dashboard=False)
print("ray up", flush=True)
time.sleep(10**6)
"""


async def closed_loop(address: str, concurrency: int, num_prompts: int,
                      input_len: int, output_len: int) -> tuple[float, float]:
    """Output tokens/s and TTFT p50 (ms) of one closed-loop run (after a warm-up)."""
    from engine import SamplingParams
    from engine.model.loader import load_tokenizer, resolve_model
    from engine.wire.core_client import EngineClient
    client = await EngineClient.connect([address], load_tokenizer(resolve_model("default")),
                                        handshake_timeout_s=600)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(input_len)]
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    slots = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(request_id: str, prompt: list[int]) -> int:
        async with slots:
            start, first, tokens = time.perf_counter(), None, 0
            async for out in client.generate(request_id, {"prompt_token_ids": prompt}, params):
                first = first if first is not None else time.perf_counter() - start
                tokens += len(out.outputs[0].token_ids)
            ttfts.append(first)
            return tokens

    try:
        await asyncio.gather(*(one(f"warm-{i}", p) for i, p in enumerate(prompts[:concurrency])))
        ttfts.clear()
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(f"r-{i}", p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    finally:
        await client.shutdown()
    ttfts.sort()
    return sum(tokens) / elapsed, 1000 * ttfts[len(ttfts) // 2]


def _start(argv: list[str], ready: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    handle = open(log, "wb")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    deadline = time.monotonic() + 600
    while ready not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"{argv[:3]} did not start; see {log}")
        time.sleep(1)
    return proc


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:  # SIGTERM, then the whole process group
        stop_server(proc)


def _background(kind: str, work: Path) -> subprocess.Popen | None:
    if kind == "alone":
        return None
    if kind == "beside-ray":
        return _start([sys.executable, "-c", _IDLE_RAY], "ray up", work / "ray.log")
    from engine.wire.ports import free_port
    flotilla = str(Path(sys.executable).parent / "flotilla")
    return _start([flotilla, "serve", "--model", "mock", "--port",
                   str(free_port("127.0.0.1"))], "Flotilla is serving", work / "serve.log")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    import tempfile

    from engine.wire.ports import free_port
    work = Path(tempfile.mkdtemp(prefix="bench-served-engine-"))
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    engine = _start([sys.executable, "-c", _SERVER, address], "engine serving",
                    work / "engine.log", {"PYTHONPATH": str(REPO)})
    rows = []
    workload = (address, args.concurrency, args.num_prompts, args.input_len, args.output_len)
    try:
        asyncio.run(closed_loop(*workload))  # untimed: the first pass over new shapes is slow
        for r in range(args.rounds):
            for kind in ("alone", "beside-ray", "beside-serve"):
                background = _background(kind, work)
                try:
                    time.sleep(5)  # the background settles into its idle loops
                    tok_s, ttft = asyncio.run(closed_loop(*workload))
                finally:
                    _stop(background)
                rows.append((r + 1, kind, tok_s, ttft))
                print(f"round {r + 1} {kind}: {tok_s:.1f} tok/s, TTFT p50 {ttft:.0f} ms",
                      flush=True)
    finally:
        _stop(engine)
    print(f"\nengine over ZMQ, closed loop c={args.concurrency}, {args.num_prompts} x "
          f"{args.input_len} -> {args.output_len} tokens, CPU: {_cpu_name()}")
    print("| round | engine | output tok/s | vs alone | TTFT p50 ms |\n|---|---|---|---|---|")
    for r, kind, tok_s, ttft in rows:
        alone = next(t for rr, k, t, _ in rows if rr == r and k == "alone")
        print(f"| {r} | {kind} | {tok_s:.1f} | {tok_s / alone:.2f}x | {ttft:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
