"""Native CPU kernels per vector path, at the default model's W1 shapes, beside torch.

Builds the kernels for each target (native, and the narrower paths of this CPU family:
x86-64-v3 = AVX2 + FMA, x86-64 = SSE2, whose 4-lane code is the one NEON builds use) and
times, per call, single-threaded by default (--threads): decode attention for 64
sequences over a 128-token context in a churned (shuffled) block pool, the same with
each call on the next of 30 layers' caches in the engine's block-major layout (W1's
decode: every layer's KV streams from memory, ~190 MB at bf16), one prefill chunk
of 64 rows, one of 512 rows after 512 cached tokens (the second chunk of a 1,024-token
prompt at the default step budget) on the per-row kernels and, in bf16 where the CPU
has AMX, on tiles, add+RMSNorm, RoPE, SiLU*up, greedy argmax over the vocabulary, and a layer's
four linears at 64 rows (with one layer's weights, and with each call on the next of 30
layers' weights, as a decode step streams them); the torch column is what the engine runs
without native kernels, except for the linears, where it is oneDNN's prepacked matmul
(the engine's packing where the native build lacks the dtype; "n/a" marks such a build).
Prints microseconds per call, the CPU and the dtype.

    python bench/kernels.py [--dtype float32|bfloat16] [--threads 1] [--targets native,x86-64-v3]
"""
from __future__ import annotations

import argparse
import itertools
import platform
import time
from typing import Callable

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, BS = 9, 3, 64, 576, 1536, 49152, 16
SEQS, CONTEXT, PREFILL = 64, 128, 64
CHUNK = 512  # a prefill chunk at the default step budget, after as many cached tokens
STREAM_LAYERS = 30


def cpu_name() -> str:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "?")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split()
    isa = ("AVX-512" + (" + bf16" if "avx512_bf16" in flags else "") if "avx512bw" in flags
           else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{model}, {isa}"


def timed(fn: Callable[[], object], min_s: float = 0.3) -> float:
    """Microseconds per call: the best of 5 rounds of repeated calls."""
    fn()
    n, start = 1, time.perf_counter()
    while time.perf_counter() - start < min_s / 5:
        fn()
        n += 1
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def cases(dtype: torch.dtype) -> dict[str, tuple[Callable, Callable, Callable]]:
    """name -> (call with a kernel module, the torch equivalent, whether a module has
    that kernel for dtype)."""
    g = torch.Generator().manual_seed(0)
    blocks = SEQS * (CONTEXT // BS) * 2
    k_cache = torch.randn(KV_HEADS, blocks, HEAD_DIM, BS, generator=g).to(dtype)
    v_cache = torch.randn(KV_HEADS, blocks, BS, HEAD_DIM, generator=g).to(dtype)
    width = CONTEXT // BS
    tables = torch.randperm(blocks, generator=g)[:SEQS * width].view(SEQS, width)
    lens = torch.full((SEQS,), CONTEXT)
    slots = tables[:, -1] * BS + BS - 1
    q = torch.randn(SEQS, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(SEQS, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(SEQS, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    starts = torch.arange(SEQS + 1)
    scale = HEAD_DIM ** -0.5

    def decode(m):
        return m.paged_attention(q, k, v, k_cache, v_cache, slots, tables, lens, starts, scale)

    def sdpa_decode(k_layer, v_layer):
        keys = k_layer[:, tables].permute(1, 0, 2, 4, 3).reshape(SEQS, KV_HEADS, -1, HEAD_DIM)
        vals = v_layer[:, tables].permute(1, 0, 2, 3, 4).reshape(SEQS, KV_HEADS, -1, HEAD_DIM)
        return F.scaled_dot_product_attention(q[:, :, None], keys, vals, scale=scale,
                                              enable_gqa=True)

    def decode_torch(_):
        return sdpa_decode(k_cache, v_cache)

    from engine.model.attention.block_major import cache_views
    pool = torch.randn(STREAM_LAYERS, blocks, 2, KV_HEADS, BS, HEAD_DIM, generator=g).to(dtype)
    layer_caches = [cache_views(layer) for layer in pool]
    turns = itertools.cycle(layer_caches)

    def streamed(m):
        k_layer, v_layer = next(turns)
        return m.paged_attention(q, k, v, k_layer, v_layer, slots, tables, lens, starts, scale)

    def streamed_torch(_):
        return sdpa_decode(*next(turns))

    pq = torch.randn(PREFILL, HEADS, HEAD_DIM, generator=g).to(dtype)
    pk = torch.randn(PREFILL, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    pv = torch.randn(PREFILL, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    ptable = tables[:1, :PREFILL // BS].contiguous()
    pslots = (ptable[0][:, None] * BS + torch.arange(BS)).flatten()

    def prefill(m):
        return m.paged_attention(pq, pk, pv, k_cache, v_cache, pslots, ptable,
                                 torch.tensor([PREFILL]), torch.tensor([0, PREFILL]), scale)

    def prefill_torch(_):
        return F.scaled_dot_product_attention(pq.transpose(0, 1), pk.transpose(0, 1),
                                              pv.transpose(0, 1), is_causal=True, scale=scale,
                                              enable_gqa=True)

    cq = torch.randn(CHUNK, HEADS, HEAD_DIM, generator=g).to(dtype)
    ck = torch.randn(CHUNK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    cv = torch.randn(CHUNK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    ctable = torch.randperm(blocks, generator=g)[:2 * CHUNK // BS].view(1, -1)
    cslots = (ctable[0, CHUNK // BS:][:, None] * BS + torch.arange(BS)).flatten()

    def chunk_with(kernel):
        def call(m):
            m.set_attention_prefill_kernel(kernel)
            return m.paged_attention(cq, ck, cv, k_cache, v_cache, cslots, ctable,
                                     torch.tensor([2 * CHUNK]), torch.tensor([0, CHUNK]), scale)
        return call

    ckeys = torch.cat((torch.randn(KV_HEADS, CHUNK, HEAD_DIM, generator=g).to(dtype),
                       ck.transpose(0, 1)), 1)  # cached context, then the chunk's own
    cmask = torch.ones(CHUNK, 2 * CHUNK, dtype=torch.bool).tril(CHUNK)

    def chunk_torch(_):
        return F.scaled_dot_product_attention(cq.transpose(0, 1), ckeys, ckeys, attn_mask=cmask,
                                              scale=scale, enable_gqa=True)

    def has_amx(m):
        return dtype == torch.bfloat16 and m.set_attention_prefill_kernel("amx")

    x = torch.randn(SEQS, HIDDEN, generator=g).to(dtype)
    res = torch.randn(SEQS, HIDDEN, generator=g).to(dtype)
    w = torch.ones(HIDDEN, dtype=dtype)

    def norm_torch(_):
        h = res + x
        return F.rms_norm(h.float(), (HIDDEN,), None, 1e-5).to(dtype) * w, h

    gate_up = torch.randn(SEQS, 2 * INTER, generator=g).to(dtype)

    def silu_torch(_):
        gate, up = gate_up.split(INTER, dim=-1)
        return F.silu(gate) * up

    width_qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(SEQS, width_qkv, generator=g).to(dtype)
    # position 0 (cos 1, sin 0): the same work as any position, and the rotation in place
    # leaves the values as they were, so repeated calls do not drift them (bf16)
    positions = torch.zeros(SEQS, dtype=torch.long)
    freqs = torch.outer(torch.arange(2048).float(),
                        1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos = torch.cat((freqs, freqs), -1).cos().to(dtype)
    sin = torch.cat((freqs, freqs), -1).sin().to(dtype)

    def rope_torch(_):
        t = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(SEQS, -1, HEAD_DIM)
        c, s = cos[positions][:, None], sin[positions][:, None]
        return t * c + torch.cat((-t[..., HEAD_DIM // 2:], t[..., :HEAD_DIM // 2]), -1) * s

    logits = torch.randn(SEQS, VOCAB, generator=g)

    from engine.model.layers.linear import Linear
    shapes = [(width_qkv, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN),
              (HIDDEN, INTER)]  # (out, in): qkv, o, gate+up, down
    weights = [[(torch.randn(o, i, generator=g) * i ** -0.5).to(dtype) for o, i in shapes]
               for _ in range(STREAM_LAYERS)]
    inputs = [torch.randn(SEQS, i, generator=g).to(dtype) for _, i in shapes]
    onednn = []
    for layer in weights:
        onednn.append([Linear(t.shape[1], t.shape[0], bias=False, dtype=dtype) for t in layer])
        for module, t in zip(onednn[-1], layer):
            module.weight.data.copy_(t)
            module.pack()
    packs: dict[int, list[list[torch.Tensor]]] = {}
    layer_turns = itertools.cycle(range(STREAM_LAYERS))

    def has_linear(m):
        return str(dtype).removeprefix("torch.") in m.linear_dtypes()

    def linears(m, layer=None):
        if id(m) not in packs:
            packs[id(m)] = [[m.pack_linear(w) for w in ws] for ws in weights]
        i = next(layer_turns) if layer is None else layer
        return [m.linear(x, p, None, o) for x, p, (o, _) in zip(inputs, packs[id(m)][i], shapes)]

    def linears_torch(layer=None):
        i = next(layer_turns) if layer is None else layer
        return [module(x) for module, x in zip(onednn[i], inputs)]

    def always(_):
        return True

    return {
        f"decode attention ({SEQS} seqs x {CONTEXT} ctx)": (decode, decode_torch, always),
        f"  same, {STREAM_LAYERS} layers' caches in turn": (streamed, streamed_torch, always),
        f"prefill attention ({PREFILL} rows)": (prefill, prefill_torch, always),
        f"prefill chunk ({CHUNK} rows after {CHUNK}), rows": (chunk_with("rows"), chunk_torch,
                                                              always),
        "  same, AMX tiles": (chunk_with("amx"), chunk_torch, has_amx),
        f"add + RMSNorm ({SEQS} x {HIDDEN})": (
            lambda m: m.fused_add_rms_norm(x, res, w, 1e-5), norm_torch, always),
        f"RoPE ({SEQS} rows, 12 heads)": (
            lambda m: m.rotary_inplace(qkv, positions, cos, sin, HEADS + KV_HEADS, HEAD_DIM),
            rope_torch, always),
        f"SiLU * up ({SEQS} x {INTER})": (lambda m: m.silu_and_mul(gate_up), silu_torch, always),
        f"argmax ({SEQS} x {VOCAB}, float32)": (
            lambda m: m.argmax_rows(logits), lambda _: logits.argmax(dim=-1), always),
        f"a layer's 4 linears ({SEQS} rows)": (lambda m: linears(m, 0),
                                               lambda _: linears_torch(0), has_linear),
        f"  same, {STREAM_LAYERS} layers' weights in turn": (
            linears, lambda _: linears_torch(), has_linear),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    default_targets = "native,x86-64-v3,x86-64" if platform.machine() == "x86_64" else "native"
    parser.add_argument("--targets", default=default_targets,
                        help="comma-separated -march targets to build and time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from engine.model.kernels import cpu_kernels
    modules = {}
    for target in args.targets.split(","):
        module = cpu_kernels(target)
        if module is None:
            raise SystemExit(f"the kernels did not build for {target}")
        modules[f"{target} ({module.isa})"] = module
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_name()}; {args.dtype}, {args.threads} thread(s); microseconds per call")
    names = list(modules) + ["torch"]
    print(f"{'kernel':<42}" + "".join(f"{n:>22}" for n in names))
    for name, (native, reference, available) in cases(dtype).items():
        cells = [f"{timed(lambda m=m: native(m)):>22.1f}" if available(m) else f"{'n/a':>22}"
                 for m in modules.values()]
        cells.append(f"{timed(lambda: reference(None)):>22.1f}")
        print(f"{name:<42}" + "".join(cells))


if __name__ == "__main__":
    main()
