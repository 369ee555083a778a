"""The shared KV tier (issue 64's tier targets): what a tier hit saves.

1. TTFT of a long prompt (--prompt-len, 4,096 by default, random token ids, max_tokens 1,
   greedy) recomputed, against the same prompt found in the tier: loaded from the disk
   tier by a fresh engine sharing the directory (the first engine shut down: the tier
   outlived it), and from the host tier by that engine after its pool forgot the prompt
   (reset_prefix_cache). A pool hit is printed beside them. Each figure is the median of
   --rounds fresh prompts. The disk tier was just written, so its files are likely in
   the OS page cache, unless --cold drops it (root) before each of those reads.
2. Prefill tokens computed on a shared-prefix load across two engines (--threads each,
   one core apiece by default): --prefixes long prefixes (--prefix-len tokens) each
   asked --per-prefix times with its own 32-token suffix, requests alternating between
   the engines; private caches (no connector) against one shared disk tier. Computed =
   prompt tokens - cached tokens, summed. The engines run one request at a time in this
   process, alternately: the order in which a served load would let the second engine
   find what the first computed, not its timing.

    python bench/kv_tier.py [--model default] [--prompt-len 4096] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def _engine(args, directory: Path | None, threads: int | None = None):
    from engine import LLM
    kwargs = dict(dtype=args.dtype, max_model_len=args.max_model_len)
    if threads is not None:
        kwargs["num_threads"] = threads
    if directory is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30,
                                          "disk_path": str(directory),
                                          "disk_bytes_to_use": 16 << 30}}
    return LLM(args.model, **kwargs)


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the one output token, and how many prompt tokens were cached."""
    from engine import SamplingParams
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def ttft(args) -> None:
    rng = random.Random(7)
    prompts = [_prompt(rng, args.prompt_len) for _ in range(args.rounds)]
    with tempfile.TemporaryDirectory(prefix="flotilla-kv-tier-") as tmp:
        first = _engine(args, Path(tmp))
        _ttft(first, _prompt(rng, 64))  # warm-up
        recompute = [_ttft(first, p) for p in prompts]
        pool = [_ttft(first, p) for p in prompts]
        saved = first.llm_engine.engine_core.kv_transfer.connector.worker.blocks_saved
        first.shutdown()  # its disk writes flushed: the tier outlives it
        second = _engine(args, Path(tmp))
        _ttft(second, _prompt(rng, 64))
        disk = []
        for p in prompts:
            if args.cold:
                _drop_page_cache()
            disk.append(_ttft(second, p))
        second.reset_prefix_cache()
        host = [_ttft(second, p) for p in prompts]
        second.shutdown()
    cold = ", cold: page cache dropped before each" if args.cold else ""
    rows = [("recomputed", recompute), ("pool hit", pool),
            (f"disk tier hit (other engine{cold})", disk),
            ("host tier hit", host)]
    base = statistics.median(t for t, _ in recompute)
    print(f"TTFT of a {args.prompt_len}-token prompt, median of {args.rounds} "
          f"({saved} blocks saved by the first engine):")
    for name, runs in rows:
        t = statistics.median(s for s, _ in runs)
        print(f"  {name:30s} {t * 1000:9.1f} ms  {t / base:5.3f}x  cached "
              f"{[c for _, c in runs]}")


def _drop_page_cache() -> None:
    """A cold disk tier: the OS page cache written back and dropped (Linux, root)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def shared_prefixes(args) -> None:
    rng = random.Random(11)
    prefixes = [_prompt(rng, args.prefix_len) for _ in range(args.prefixes)]
    load = [prefix + _prompt(rng, 32) for prefix in prefixes for _ in range(args.per_prefix)]
    rng.shuffle(load)
    computed = {}
    for label in ("private caches", "shared disk tier"):
        with tempfile.TemporaryDirectory(prefix="flotilla-kv-tier-") as tmp:
            directory = Path(tmp) if label == "shared disk tier" else None
            engines = [_engine(args, directory, args.threads) for _ in range(2)]
            total = 0
            for i, prompt in enumerate(load):
                llm = engines[i % 2]
                if directory is not None:  # what the other engine wrote is on disk now
                    other = engines[(i + 1) % 2].llm_engine.engine_core
                    other.kv_transfer.connector.worker.store.disk.flush(30)
                _, cached = _ttft(llm, prompt)
                total += len(prompt) - cached
            for llm in engines:
                llm.shutdown()
        computed[label] = total
    prompt_tokens = sum(len(p) for p in load)
    print(f"shared prefixes: {args.prefixes} x {args.prefix_len} tokens, {args.per_prefix} "
          f"requests each, alternating between 2 engines ({prompt_tokens} prompt tokens):")
    for label, total in computed.items():
        print(f"  {label:18s} prefill tokens computed {total:7d}  "
              f"{total / computed['private caches']:5.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--per-prefix", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="each engine's threads")
    parser.add_argument("--only", choices=["ttft", "shared"], default=None)
    parser.add_argument("--cold", action="store_true",
                        help="drop the OS page cache before each disk-tier read (root)")
    args = parser.parse_args()
    if args.only in (None, "ttft"):
        ttft(args)
    if args.only in (None, "shared"):
        shared_prefixes(args)


if __name__ == "__main__":
    main()
