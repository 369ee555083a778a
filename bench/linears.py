"""W1's layer linears per kernel: the native matmul's kinds beside oneDNN, 1 to 512 rows.

A decode step of the default model runs 30 layers x 4 linears (q/k/v, o, gate_up with
its SwiGLU, down) at one row per sequence; prefill runs them at many rows. This times
one layer's four per call, with each call on the next of 30 layers' weights (cold: a
step streams 212 MB of bf16 weights from memory) and on layer 0's again and again (hot:
they stay in cache). Kernels: each bf16 kind this CPU runs (amx, dpbf16: forced in
turn through set_linear_bf16_kernel), or the float32 native kernel; the same shapes
as GGUF Q4_1 blocks regrouped (`--gguf`, random blocks: the default model's format, the
kernels of quant_regrouped.cpp on AVX-512 VNNI and AVX2 builds), by their int8 products
and decoded as a prompt step's rows are (AVX2: into the float32 kernel's panels); and
oneDNN's prepacked matmul (what torch runs; on AMX CPUs its bf16 runs on AMX too); with
`--llama-python`, llama.cpp's own Q4_1 products of the layer (bench/ggml_linears.py).
Prints microseconds per layer and GFLOP/s (GOP/s for the int8 products), best of three
rounds, and the CPU.

    python bench/linears.py [--dtype bfloat16|float32] [--threads 2] [--rows 1 16 64 512] [--gguf]
        [--llama-python /path/to/llama-venv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from kernels import cpu_name  # bench/kernels.py

HIDDEN, INTER, QKV = 576, 1536, 576 + 2 * 192
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (out, in)
LAYERS = 30


def per_layer_us(call: Callable[[int], None], layers: int, reps: int) -> float:
    """Microseconds per layer call over `reps` sweeps of 30 calls, best of 3 rounds."""
    for i in range(LAYERS):
        call(i % layers)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            for i in range(LAYERS):
                call(i % layers)
        best = min(best, (time.perf_counter() - start) / (reps * LAYERS))
    return best * 1e6


def random_q4_1(rows: int, columns: int, g: torch.Generator) -> torch.Tensor:
    """[rows, columns / 32 * 20] uint8: Q4_1 blocks (f16 d and m, 16 bytes of nibbles)
    with random nibbles and scales of a layer's size."""
    runs = columns // 32
    raw = torch.randint(0, 256, (rows, runs, 20), dtype=torch.uint8, generator=g)
    d = (torch.rand(rows, runs, generator=g) * 0.02).to(torch.float16)
    m = (-8 * d.float()).to(torch.float16)
    raw[:, :, 0:2] = d.view(torch.uint8).view(rows, runs, 2)
    raw[:, :, 2:4] = m.view(torch.uint8).view(rows, runs, 2)
    return raw.reshape(rows, runs * 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--gguf", action="store_true",
                        help="also time the layer as regrouped Q4_1 blocks")
    parser.add_argument("--llama-python",
                        help="a Python with llama-cpp-python: also time llama.cpp's own Q4_1 "
                             "products of the layer (bench/ggml_linears.py)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from engine.model.kernels import cpu_kernels
    k = cpu_kernels()
    dtype = getattr(torch, args.dtype)
    if k is None or args.dtype not in k.linear_dtypes():
        raise SystemExit(f"the native kernels have no {args.dtype} linear on this CPU")
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(o, i, generator=g) * i ** -0.5).to(dtype) for o, i in SHAPES]
               for _ in range(LAYERS)]
    packed = [[k.pack_linear(w, paired=(j == 2)) for j, w in enumerate(ws)] for ws in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for ws in weights]
    pointwise = torch.ops.mkldnn._linear_pointwise.default

    kinds = k.linear_bf16_kernels() if dtype == torch.bfloat16 else ["float32"]
    if args.gguf:
        if not k.gguf_regroups():
            raise SystemExit("this build has no regrouped GGUF kernels (AVX-512 VNNI or AVX2)")
        blocks = [[k.gguf_regroup(random_q4_1(o, i, g), "Q4_1", i) for o, i in SHAPES]
                  for _ in range(LAYERS)]
        kinds = kinds + ["gguf Q4_1", "gguf decoded"]
    llama = None
    if args.llama_python:
        out = subprocess.run([args.llama_python, str(Path(__file__).with_name("ggml_linears.py")),
                              "--threads", str(args.threads), "--rows",
                              *map(str, args.rows)], capture_output=True, text=True, check=True)
        llama = json.loads(out.stdout.strip().splitlines()[-1])
        kinds = kinds + ["llama.cpp Q4_1"]
    print(f"CPU: {cpu_name()}; {args.dtype}, {args.threads} thread(s); a layer's 4 linears, "
          f"us per layer (GFLOP/s), cold = {LAYERS} layers' weights in turn, hot = one's")
    print(f"{'rows':>5} {'weights':>8}" + "".join(f"{n:>22}" for n in kinds + ["oneDNN"]))
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
        xi = torch.randn(rows, INTER, generator=g).to(dtype)
        flops = sum(2 * rows * o * i for o, i in SHAPES)

        def native(layer: int) -> None:
            p = packed[layer]
            k.linear(x, p[0], None, QKV)
            k.linear(x, p[1], None, HIDDEN)
            k.linear(x, p[2], None, 2 * INTER, paired=True, glu=True)
            k.linear(xi, p[3], None, HIDDEN)

        def reference(layer: int) -> None:
            p = onednn[layer]
            for inp, w in ((x, p[0]), (x, p[1]), (x, p[2]), (xi, p[3])):
                pointwise(inp, w, None, "none", [], "")

        def gguf(layer: int, dense_rows: int = 1 << 30) -> None:
            b = blocks[layer]
            for inp, w, (o, _) in ((x, b[0], SHAPES[0]), (x, b[1], SHAPES[1]),
                                   (x, b[2], SHAPES[2]), (xi, b[3], SHAPES[3])):
                k.gguf_regrouped_linear(inp, w, "Q4_1", o, None, False, dense_rows)

        def gguf_decoded(layer: int) -> None:  # a prompt step's path: decoded, multiplied
            gguf(layer, dense_rows=0)

        timed = {"oneDNN": reference, "gguf Q4_1": gguf, "gguf decoded": gguf_decoded}
        reps = max(1, 2048 // max(rows, 64))
        for layers, label in ((LAYERS, "cold"), (1, "hot")):
            cells = []
            for kind in kinds + ["oneDNN"]:
                if dtype == torch.bfloat16 and kind not in timed and kind != "llama.cpp Q4_1":
                    k.set_linear_bf16_kernel(kind)
                us = (llama[str(rows)][label] if kind == "llama.cpp Q4_1"
                      else per_layer_us(timed.get(kind, native), layers, reps))
                cells.append(f"{us:>12.1f} ({flops / us / 1e3:>5.0f})")
            print(f"{rows:>5} {label:>8}" + "".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
