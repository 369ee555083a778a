"""The attention and fused-op kernels side by side on one GPU (issue: the GPU decode
step within 2x of the memory bound).

  python bench/gpu_kernels.py [--skip-flashinfer]

Every time is the device's alone: ten calls captured in a CUDA graph, the replay's
CUDA-event median over ten (bench.gpu.graph_time; the first run timed single eager calls,
whose host launch cost hid the kernels).

1. Paged attention at block size 16, bf16, pages scattered over the pool: Flotilla's Triton kernel (engine.model.triton_kernels), FlexAttention (the
   engine's compiled FlexPagedAttention), SDPA over the same keys laid out densely (what
   a non-paged kernel takes) and, where it imports, FlashInfer's paged decode kernel as
   a yardstick. Decode rows also show the time to read the batch's K and V once at the
   measured copy bandwidth, bytes read + written over time (the target: the 8B shape at
   batch 64 x 512 within 2x).
2. The fused element-wise kernels at 8B shapes (batch 64) against the torch ops they
   replace.
3. The int4 linear (engine/model/triton_kernels/int4_linear.py: AWQ / GPTQ / GGUF Q4_1
   weights unpacked in registers) at 8B layer shapes and batch 64, against the read of
   its own bytes at the measured copy bandwidth and against torch's bf16 matmul.
4. The fp8 linear (engine/quant/fp8.py's Fp8ScaledMM: torch._scaled_mm, x rounded to e4m3
   per token) at the same shapes: against its bytes' read, bf16's matmul, and its error
   against the decoded weight's bf16 product.
Prints its tables; needs a CUDA device.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import ceilings, graph_time  # noqa: E402
from engine.model.layers import flex_paged  # noqa: E402
from engine.model.layers.triton_paged import BLOCK_N, TritonPagedAttention  # noqa: E402
from engine.model.triton_kernels.paged_attention import attend  # noqa: E402

BLOCK = 16
SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # heads, kv heads, head dim
CASES = [  # (shape, case name, [(context, new tokens)] per sequence)
    ("8b", "decode 64 x 512", [(511, 1)] * 64),
    ("8b", "decode 1 x 4096", [(4095, 1)]),
    ("8b", "decode 16 x 2048", [(2047, 1)] * 16),
    ("1b", "decode 64 x 1024", [(1023, 1)] * 64),
    ("1b", "decode 256 x 512", [(511, 1)] * 256),
    ("8b", "prefill 2048 fresh", [(0, 2048)]),
    ("1b", "prefill 2048 fresh", [(0, 2048)]),
    ("1b", "prefill 512 after 1536", [(1536, 512)]),
]


def _layout(seqs: list[tuple[int, int]]) -> tuple[list[list[int]], int]:
    pages = [-(-(c + n) // BLOCK) for c, n in seqs]
    num_blocks = sum(pages) + 8
    perm = torch.randperm(num_blocks).tolist()
    tables, at = [], 0
    for p in pages:
        tables.append(perm[at:at + p])
        at += p
    return tables, num_blocks


def _flashinfer_decode(q, kc, vc, tables, seqs, heads, kv_heads, dim):
    """FlashInfer's paged decode over its own HND copy of the cache: a timed closure."""
    import flashinfer
    dev = q.device
    pages = kc.view(kv_heads, -1, BLOCK, dim).transpose(0, 1).contiguous()
    vpages = vc.view(kv_heads, -1, BLOCK, dim).transpose(0, 1).contiguous()
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    last = [(c + n - 1) % BLOCK + 1 for c, n in seqs]
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    wrapper.plan(torch.tensor(indptr, dtype=torch.int32, device=dev),
                 torch.tensor([p for t in tables for p in t], dtype=torch.int32, device=dev),
                 torch.tensor(last, dtype=torch.int32, device=dev), heads, kv_heads, dim,
                 BLOCK, q_data_type=q.dtype, kv_data_type=kc.dtype)
    return lambda: wrapper.run(q, (pages, vpages))


def attention_rows(bandwidth: float, flashinfer: bool) -> list[tuple]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    flex = flex_paged.FlexPagedAttention(True, BLOCK)
    rows = []
    for shape, case, seqs in CASES:
        heads, kv_heads, dim = SHAPES[shape]
        scale = dim ** -0.5
        tables, num_blocks = _layout(seqs)
        qlens, slens = [n for _, n in seqs], [c + n for c, n in seqs]
        t = sum(qlens)
        decode = qlens[0] == 1
        q = torch.randn(t, heads, dim, device=dev, dtype=dt)
        cache = torch.randn(flex_paged.cache_shape(1, num_blocks, kv_heads, BLOCK, dim),
                            device=dev, dtype=dt)
        kc, vc = cache[0, 0], cache[0, 1]
        # Triton
        backend = TritonPagedAttention(BLOCK, heads, kv_heads, dim, 256, dev)
        step = backend.step(qlens, slens, tables, len(seqs) if decode else 0)
        out = torch.empty_like(q)
        launches = step.launches()

        def triton_call():
            for launch in launches:
                attend(q, kc, vc, out, launch, scale, BLOCK, BLOCK_N, backend.scratch)
        triton_ms = graph_time(triton_call) * 1e3
        splits = launches[0].num_splits
        # FlexAttention
        slot_mapping = torch.tensor([tb[p // BLOCK] * BLOCK + p % BLOCK
                                     for (c, n), tb in zip(seqs, tables)
                                     for p in range(c, c + n)], device=dev)
        groups = [flex_paged.build_group(0, qlens, slens, tables, num_blocks, BLOCK, dev,
                                         page_map=False)]
        slot_pos = torch.full((kc.shape[1],), 2 ** 31 - 1, dtype=torch.int32, device=dev)
        positions = torch.tensor([p for c, n in seqs for p in range(c, c + n)], device=dev)
        flex_paged.write_positions(slot_pos, slot_mapping, positions, BLOCK)
        groups[0].fresh = False
        kf = torch.randn(t, kv_heads, dim, device=dev, dtype=dt)
        kcf, vcf = kc.unsqueeze(0), vc.unsqueeze(0)
        try:
            flex_ms = graph_time(lambda: flex(q, kf, kf, kcf, vcf, slot_pos, groups, scale)) * 1e3
        except Exception as exc:  # noqa: BLE001 - a table cell, not a crash
            print(f"  flex failed on {case}: {str(exc).splitlines()[0][:120]}", flush=True)
            flex_ms = float("nan")
        # SDPA over dense copies of each sequence's keys (no paging)
        b, ctx = len(seqs), slens[0]
        kd = torch.randn(b, kv_heads, ctx, dim, device=dev, dtype=dt)
        qd = q.view(b, qlens[0], heads, dim).transpose(1, 2)
        sdpa_ms = graph_time(lambda: F.scaled_dot_product_attention(
            qd, kd, kd, is_causal=not decode and seqs[0][0] == 0, scale=scale,
            enable_gqa=True)) * 1e3
        fi_ms = float("nan")
        if flashinfer and decode:
            try:
                fi_ms = graph_time(_flashinfer_decode(q, kc, vc, tables, seqs, heads,
                                                     kv_heads, dim)) * 1e3
            except Exception as exc:  # noqa: BLE001
                print(f"  flashinfer failed on {case}: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)
        kv_ms = 2 * sum(slens) * kv_heads * dim * 2 / bandwidth * 1e3 if decode else None
        rows.append((shape, case, splits, triton_ms, flex_ms, sdpa_ms, fi_ms, kv_ms))
        print(f"  {shape} {case}: triton {triton_ms:.3f} ms", flush=True)
        torch.cuda.empty_cache()
    return rows


def fused_rows() -> list[tuple[str, float, float]]:
    """(op, triton ms, torch ms) at 8B shapes, 64 tokens."""
    from engine.model.triton_kernels.fused_ops import rms_norm, rope_write_kv, silu_and_mul
    dev, dt, t = torch.device("cuda"), torch.bfloat16, 64
    hidden, inter, heads, kv_heads, dim = 4096, 14336, 32, 8, 128
    x = torch.randn(t, hidden, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=dev, dtype=dt)

    def torch_norm():
        r = res + x
        return w * F.rms_norm(r.float(), (hidden,), None, 1e-5).to(dt), r
    xt = x.clone()  # normalised in place, again and again
    rows = [("residual add + RMSNorm", graph_time(lambda: rms_norm(xt, w, 1e-5, res, out=xt)),
             graph_time(torch_norm))]
    gu = torch.randn(t, 2 * inter, device=dev, dtype=dt)
    rows.append(("SiLU x mul", graph_time(lambda: silu_and_mul(gu)),
                 graph_time(lambda: F.silu(gu[:, :inter]) * gu[:, inter:])))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=dev, dtype=dt)
    pos = torch.arange(500, 500 + t, device=dev)
    cos = torch.randn(4096, dim, device=dev)
    sin = torch.randn(4096, dim, device=dev)
    cache = torch.zeros(2, kv_heads, 1 << 16, dim, device=dev, dtype=dt)
    slots = torch.randperm(1 << 16, device=dev)[:t]

    def torch_rope():
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        c, s = cos[pos].unsqueeze(1).to(dt), sin[pos].unsqueeze(1).to(dt)
        out = []
        for y in (q.view(t, heads, dim), k.view(t, kv_heads, dim)):
            y1, y2 = y[..., :dim // 2], y[..., dim // 2:]
            out.append(y * c + torch.cat((-y2, y1), -1) * s)
        cache[0].index_copy_(1, slots, out[1].transpose(0, 1))
        cache[1].index_copy_(1, slots, v.view(t, kv_heads, dim).transpose(0, 1))
    rows.append(("rotary + KV-cache write",
                 graph_time(lambda: rope_write_kv(qkv, pos, cos, sin, heads, kv_heads, dim,
                                                 cache[0], cache[1], slots)),
                 graph_time(torch_rope)))
    return [(name, a * 1e3, b * 1e3) for name, a, b in rows]


INT4_SHAPES = [("q/k/v", 6144, 4096), ("o", 4096, 4096), ("gate/up", 28672, 4096),
               ("down", 4096, 14336)]  # Llama 8B's linears: (name, out, in)


def _bf16_ms(x: torch.Tensor, n: int, k: int) -> float:
    dense = torch.randn(n, k, device=x.device, dtype=x.dtype)
    return graph_time(lambda: F.linear(x, dense)) * 1e3


def int4_rows(bandwidth: float, batch: int = 64) -> list[tuple]:
    """(linear, int4 ms, its bytes' read ms, bf16 ms) at 8B shapes."""
    from engine.model.triton_kernels.int4_linear import Int4Weight
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, n, k in INT4_SHAPES:
        weight = Int4Weight(torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32,
                                          device=dev),
                            (torch.rand(k // 32, n, device=dev) * 0.01).half(),
                            (torch.rand(k // 32, n, device=dev) * -0.05).half(), n, k)
        x = torch.randn(batch, k, device=dev, dtype=dt)
        int4_ms = graph_time(lambda: weight.matmul(x, None)) * 1e3
        rows.append((name, int4_ms, weight.nbytes / bandwidth * 1e3,
                     _bf16_ms(x, n, k)))
        torch.cuda.empty_cache()
    return rows


def fp8_rows(bandwidth: float, batch: int = 64) -> list[tuple]:
    """(linear, fp8 ms, its bytes' read ms, bf16 ms, relative error) at 8B shapes."""
    from engine.quant.fp8 import Fp8ScaledMM
    from engine.quant.scaled_pieces import ScaledWeight
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, n, k in INT4_SHAPES:
        w = torch.randn(n, k, device=dev) * 0.02
        scales = w.abs().amax(1) / 448
        q = (w / scales[:, None]).to(torch.float8_e4m3fn)
        weight = Fp8ScaledMM.of(ScaledWeight(q, scales, 0.0), dev)
        x = torch.randn(batch, k, device=dev, dtype=dt)
        fp8_ms = graph_time(lambda: weight.matmul(x, None)) * 1e3
        want = F.linear(x, (q.float() * scales[:, None]).to(dt)).float()
        err = ((weight.matmul(x, None).float() - want).norm() / want.norm()).item()
        rows.append((name, fp8_ms, weight.nbytes / bandwidth * 1e3, _bf16_ms(x, n, k), err))
        del w, q, weight
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-flashinfer", action="store_true")
    args = ap.parse_args()
    import triton
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    flashinfer = not args.skip_flashinfer
    if flashinfer:
        start = time.perf_counter()
        try:
            import flashinfer as fi
            print(f"flashinfer {fi.__version__} imported in "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
        except Exception as exc:  # noqa: BLE001 - say why, time the rest
            print(f"flashinfer unavailable: {type(exc).__name__}: {exc}", flush=True)
            flashinfer = False
    bandwidth, _ = ceilings()
    print(f"copy {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = attention_rows(bandwidth, flashinfer)
    print(f"\npaged attention, block {BLOCK}, bf16, ms (KV read: the batch's K and V bytes "
          "over the copy rate; sdpa: dense keys, no paging)")
    print(f"{'shape':<6}{'case':<24}{'splits':>7}{'triton':>9}{'flex':>9}{'sdpa':>9}"
          f"{'flashinf':>10}{'KV read':>9}{'triton/KV':>10}")
    for shape, case, splits, tr, fx, sd, fi_ms, kv in rows:
        kv_cells = f"{kv:>9.3f}{tr / kv:>9.2f}x" if kv else f"{'':>9}{'':>10}"
        print(f"{shape:<6}{case:<24}{splits:>7}{tr:>9.3f}{fx:>9.3f}{sd:>9.3f}{fi_ms:>10.3f}"
              f"{kv_cells}")
    print("\nfused element-wise ops, 8B shapes, 64 tokens, bf16 (ms)")
    print(f"{'op':<26}{'triton':>9}{'torch':>9}")
    for name, tr, to in fused_rows():
        print(f"{name:<26}{tr:>9.4f}{to:>9.4f}")
    print("\nint4 linears (Q4_1: 4.5 bits a weight), 8B shapes, batch 64, ms (read: its "
          "bytes at the copy rate)")
    print(f"{'linear':<10}{'int4':>9}{'read':>9}{'int4/read':>11}{'bf16':>9}")
    for name, q, read, dense in int4_rows(bandwidth):
        print(f"{name:<10}{q:>9.3f}{read:>9.3f}{q / read:>10.2f}x{dense:>9.3f}")
    print("\nfp8 linears (e4m3, torch._scaled_mm, x rounded per token), 8B shapes, batch 64, "
          "ms (read: its bytes at the copy rate; err: relative to the decoded bf16 product)")
    print(f"{'linear':<10}{'fp8':>9}{'read':>9}{'fp8/read':>10}{'bf16':>9}{'err':>9}")
    for name, q, read, dense, err in fp8_rows(bandwidth):
        print(f"{name:<10}{q:>9.3f}{read:>9.3f}{q / read:>9.2f}x{dense:>9.3f}{err:>9.4f}")


if __name__ == "__main__":
    main()
