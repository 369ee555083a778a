"""llama.cpp's own matmuls on the default model's layer shapes, for bench/linears.py.

Run by the Python of an environment with llama-cpp-python (it needs only numpy and the
ggml libraries that package ships): ggml's CPU backend, called through ctypes, multiplies
Q4_1 weights (random blocks with half-precision scales of a realistic size) by float32
activations as llama.cpp does in a forward pass: each product's activations quantized
to Q8_1 blocks, then the build's vec_dot kernels (on an AVX2 build: maddubs). A layer is
llama.cpp's seven products (q, k, v, o, gate, up, down: one layer's four fused linears
of bench/linears.py, the same FLOPs); 30 layers are one graph computed on `threads`
threads, as llama.cpp computes a step (its SwiGLU, norms and attention left out). Prints
one JSON line: microseconds per layer, cold (30 layers' weights in turn) and hot (one
layer's weights 30 times), best of three rounds, for each row count.

    /path/to/llama-venv/bin/python bench/ggml_linears.py --rows 1 16 64 512 --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np

HIDDEN, INTER, KV = 576, 1536, 192
# llama.cpp's products of one layer: (rows of W, columns of W = K)
PRODUCTS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN),
            (INTER, HIDDEN), (HIDDEN, INTER)]
LAYERS = 30
TYPE_F32, TYPE_Q4_1 = 0, 3
Q4_1_BYTES = 20  # a block of 32 weights: d, m (f16), 16 bytes of nibbles


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    base.ggml_init.restype, base.ggml_init.argtypes = p, [InitParams]
    base.ggml_new_tensor_2d.restype = p
    base.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = p, [p]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = p, [p, p, p]
    base.ggml_new_graph_custom.restype = p
    base.ggml_new_graph_custom.argtypes = [p, ctypes.c_size_t, ctypes.c_bool]
    base.ggml_build_forward_expand.restype, base.ggml_build_forward_expand.argtypes = None, [p, p]
    base.ggml_free.restype, base.ggml_free.argtypes = None, [p]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    if hasattr(cpu, "ggml_cpu_init"):
        cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
        cpu.ggml_cpu_init()
    return base, cpu


def _fill(base, tensor: int, data: np.ndarray) -> None:
    ctypes.memmove(base.ggml_get_data(tensor), data.ctypes.data, data.nbytes)


def _q4_1(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    runs = cols // 32
    raw = rng.integers(0, 256, size=(rows, runs, Q4_1_BYTES), dtype=np.uint8)
    raw[:, :, 0:2] = rng.uniform(0.001, 0.01, (rows, runs)).astype(np.float16)[..., None].view(np.uint8)
    raw[:, :, 2:4] = rng.uniform(-0.08, 0.0, (rows, runs)).astype(np.float16)[..., None].view(np.uint8)
    return raw


def per_layer_us(base, cpu, rows: int, threads: int, hot: bool) -> float:
    """Microseconds per layer: one graph of 30 layers' products, best of three runs."""
    weights_bytes = sum(o * i // 32 * Q4_1_BYTES for o, i in PRODUCTS) * (1 if hot else LAYERS)
    mem = weights_bytes + 4 * rows * (HIDDEN + INTER) * 2 + 4 * rows * sum(
        o for o, _ in PRODUCTS) * LAYERS + 4 * rows * INTER * 2 + (64 << 20)
    ctx = base.ggml_init(InitParams(mem, None, False))
    if not ctx:
        raise SystemExit("ggml_init failed")
    try:
        rng = np.random.default_rng(0)
        x = base.ggml_new_tensor_2d(ctx, TYPE_F32, HIDDEN, rows)
        xi = base.ggml_new_tensor_2d(ctx, TYPE_F32, INTER, rows)
        _fill(base, x, rng.standard_normal((rows, HIDDEN), dtype=np.float32))
        _fill(base, xi, rng.standard_normal((rows, INTER), dtype=np.float32))
        layers = []
        for _ in range(1 if hot else LAYERS):
            layer = []
            for o, i in PRODUCTS:
                w = base.ggml_new_tensor_2d(ctx, TYPE_Q4_1, i, o)
                _fill(base, w, _q4_1(o, i, rng))
                layer.append((w, x if i == HIDDEN else xi))
            layers.append(layer)
        graph = base.ggml_new_graph_custom(ctx, 4096, False)
        for n in range(LAYERS):
            for w, inp in layers[n % len(layers)]:
                base.ggml_build_forward_expand(graph, base.ggml_mul_mat(ctx, w, inp))
        cpu.ggml_graph_compute_with_ctx(ctx, graph, threads)  # warm
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            status = cpu.ggml_graph_compute_with_ctx(ctx, graph, threads)
            best = min(best, time.perf_counter() - start)
            if status != 0:
                raise SystemExit(f"ggml_graph_compute failed: status {status}")
        return best / LAYERS * 1e6
    finally:
        base.ggml_free(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    base, cpu = _libs()
    out = {str(r): {"cold": per_layer_us(base, cpu, r, args.threads, False),
                    "hot": per_layer_us(base, cpu, r, args.threads, True)} for r in args.rows}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
