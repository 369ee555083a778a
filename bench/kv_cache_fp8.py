"""Decode attention from an fp8 KV cache (kv_cache_dtype fp8) against the activation
dtype's cache, on the native CPU kernel (issue 42).

Each call attends SEQS decoding sequences over CONTEXT cached tokens (the default
model's heads: 9 query heads, 3 kv heads, head size 64; block size 16, blocks shuffled
over the pool) and is made on the next of LAYERS layers' caches, as a decode step streams
every layer's KV from memory. Prints microseconds per call and the KV bytes a call
reads, per cache dtype, with the CPU named.

    python bench/kv_cache_fp8.py [--dtype bfloat16] [--context 512] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, KV_HEADS, HEAD_DIM, BS = 9, 3, 64, 16


def time_calls(kernels, dtype, cache_dtype, seqs: int, context: int, layers: int,
               reps: int) -> float:
    """Microseconds per call, each on the next layer's cache."""
    torch.manual_seed(0)
    per_seq = -(-(context + 1) // BS)
    blocks = seqs * per_seq
    tables = torch.randperm(blocks).view(seqs, per_seq)
    caches = []
    for _ in range(layers):
        k = torch.randn(KV_HEADS, blocks, HEAD_DIM, BS)
        v = torch.randn(KV_HEADS, blocks, BS, HEAD_DIM)
        caches.append((k.to(cache_dtype), v.to(cache_dtype)))
    lens = torch.full((seqs,), context + 1)
    starts = torch.arange(seqs + 1)
    slots = torch.tensor([int(tables[s][context // BS]) * BS + context % BS for s in range(seqs)])
    q = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    k_new = torch.randn(seqs, KV_HEADS, HEAD_DIM).to(dtype)
    v_new = torch.randn(seqs, KV_HEADS, HEAD_DIM).to(dtype)
    scales = (0.05, 0.05) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)

    def call(i):
        kc, vc = caches[i % layers]
        kernels.paged_attention(q, k_new, v_new, kc, vc, slots, tables, lens, starts,
                                HEAD_DIM ** -0.5, *scales)

    for i in range(layers):
        call(i)
    start = time.perf_counter()
    for i in range(reps):
        call(i)
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    from bench.throughput import _cpu_model
    from engine.model.kernels import cpu_kernels
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {_cpu_model()}, {args.threads} threads, kernels {kernels.isa}; decode "
          f"attention, {args.seqs} sequences x {args.context} cached tokens, each call on "
          f"the next of {args.layers} layers")
    kv_elems = 2 * args.seqs * (args.context + 1) * KV_HEADS * HEAD_DIM
    results = {}
    for name, cache in ((args.dtype, dtype), ("fp8", torch.float8_e4m3fn)):
        us = time_calls(kernels, dtype, cache, args.seqs, args.context, args.layers, args.reps)
        results[name] = us
        mb = kv_elems * torch.empty((), dtype=cache).element_size() / 1e6
        print(f"  cache {name:9s} {us:8.1f} us a call, {mb:5.2f} MB of KV read "
              f"({mb / us * 1e3:.1f} GB/s)")
    print(f"  fp8 / {args.dtype}: {results['fp8'] / results[args.dtype]:.2f}x the time")


if __name__ == "__main__":
    main()
