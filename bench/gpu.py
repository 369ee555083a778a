"""The GPU path measured against the device's own ceilings (issue: the GPU path).

  python bench/gpu.py [--models 1b,8b] [--batches 1,16,64,256] [--context 512]
                      [--backends triton,flex] [--quantization none,fp8,awq]
                      [--kv-cache-dtype auto,fp8]

1. Ceilings, measured here: HBM bandwidth (a device-to-device copy, bytes read + written
   over its time) and the bf16 matmul rate (8192^3 on random data).
2. (The attention kernels side by side: bench/gpu_kernels.py.)
3. Decode step time of the engine (EngineCore.step, sampling and scheduling included;
   the forward alone beside it) at each batch, random-weight Llama 3.2 1B and Llama 3.1
   8B shapes in bf16 (load_format dummy), for each attention backend, against the HBM
   bound: weights + the KV bytes the step reads, over the measured bandwidth. With
   --quantization fp8 / awq the dummy weights are that format's bytes (issue 42: FP8
   and AWQ decode steps against the bound of their own bytes); with --kv-cache-dtype
   fp8 the cache is e4m3 and the bound counts its bytes.
4. Prefill tokens/s at 2,048-token prompts (8,192-token steps) against the matmul rate.
Prints one table per part; needs a CUDA device.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core_messages import EngineCoreRequest  # noqa: E402
from engine.quant import quantization_config  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
             rms_norm_eps=1e-5, hidden_act="silu", rope_theta=500000.0,
             max_position_embeddings=4096, torch_dtype="bfloat16")
MODELS = {
    "1b": dict(LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True),
    "8b": dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False),
}


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_time(fn, inner: int = 10, reps: int = 10) -> float:
    """Median seconds of one fn() on the device alone: inner calls captured in a CUDA
    graph and replayed, so the host's launch cost (tens of microseconds for a Triton
    kernel, more than a small kernel runs) is not timed. Falls back to cuda_time where
    fn cannot be captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception as exc:  # noqa: BLE001 - some ops cannot be captured: time them eagerly
        print(f"  (not capturable, timed eagerly: {type(exc).__name__})", flush=True)
        torch.cuda.synchronize()
        return cuda_time(fn)
    return cuda_time(graph.replay, reps=reps, warmup=2) / inner


def ceilings() -> tuple[float, float]:
    """(bytes/s moved by a device copy, read + write; bf16 matmul FLOP/s)."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * src.element_size() / t
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, reps=10)
    return bandwidth, 2 * 8192 ** 3 / t


def _model_dir(name: str, quantization: str = "none") -> str:
    """config.json of the model's shapes; quantization (fp8, awq) declared in it makes the
    dummy load hold that format's bytes (engine/quant/dummy.py)."""
    config = dict(MODELS[name])
    if quantization != "none":
        config["quantization_config"] = quantization_config(quantization)
    path = Path(tempfile.mkdtemp(prefix=f"llama-{name}-"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _linear_params(shape) -> int:
    """Weights of the decoder layers' linears (what prefill multiplies, lm_head aside)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    return shape.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)


def _request(rid: str, n: int, max_tokens: int) -> EngineCoreRequest:
    ids = torch.randint(1000, 100000, (n,)).tolist()
    return EngineCoreRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))


class ForwardTimer:
    """Wraps runner.run: CUDA-event time of each call (host work inside it included)."""

    def __init__(self, runner) -> None:
        self.inner, self.times, self.pending = runner.run, [], []
        runner.run = self

    def __call__(self, step):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(step)
        end.record()
        self.pending.append((start, end))
        return out

    def take(self) -> list[float]:
        torch.cuda.synchronize()
        got = [s.elapsed_time(e) / 1e3 for s, e in self.pending]
        self.pending = []
        return got


def model_tables(name: str, batches: list[int], context: int, bandwidth: float,
                 peak: float, decode_steps: int, backend: str,
                 quantization: str = "none", prefill: bool = True,
                 kv_cache_dtype: str = "auto") -> tuple[list, tuple | None]:
    config = EngineConfig(model=_model_dir(name, quantization), load_format="dummy",
                          dtype="bfloat16",
                          device="cuda", max_num_seqs=max(batches), log_stats_interval_s=0,
                          enable_prefix_caching=False, attention_backend=backend,
                          kv_cache_dtype=kv_cache_dtype)
    start = time.perf_counter()
    core = EngineCore(config)
    name = (f"{name}{'' if quantization == 'none' else '-' + quantization}"
            f"{'' if kv_cache_dtype == 'auto' else '-kv' + kv_cache_dtype}/{backend}")
    print(f"{name}: engine up in {time.perf_counter() - start:.1f}s, "
          f"{core.num_blocks} KV blocks", flush=True)
    runner = core.runner
    shape = core.shape
    params = runner.model
    # the bytes a decode step reads: every weight as held (quantized ones at their own
    # size), less an untied embedding's, of which a step reads a row a sequence
    embedding = params.embed_tokens.weight
    weight_bytes = runner.memory_usage()["weights_bytes"] - (
        0 if shape.tie_word_embeddings else embedding.numel() * embedding.element_size())
    kv_per_token = runner.bytes_per_block() // core.block_size
    timer = ForwardTimer(runner)
    decode_rows = []
    for batch in batches:
        for i in range(batch):
            core.add_request(_request(f"d{batch}-{i}", context, decode_steps + 8))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
            core.step()
        timer.take()
        walls = []
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t0)
        forward = statistics.median(timer.take()[3:])
        wall = statistics.median(walls[3:])
        ctx = context + decode_steps // 2
        bound = (weight_bytes + batch * ctx * kv_per_token) / bandwidth
        decode_rows.append((name, batch, wall * 1e3, forward * 1e3, bound * 1e3))
        core.abort_requests(list(core.requests))
        core.step()
    prefill_row = _prefill_row(core, config, timer, name, peak) if prefill else None
    core.shutdown()
    runner.run = timer.inner
    del core, runner, params, timer
    gc.collect()
    torch.cuda.empty_cache()
    return decode_rows, prefill_row


def _prefill_row(core, config, timer, name: str, peak: float) -> tuple:
    """2,048-token prompts in 8,192-token steps, the second round measured: (name,
    tokens/s, % of the matmul peak)."""
    prompt, per_step = 2048, config.step_token_budget(core.device)
    shape = core.shape
    for round_ in range(2):
        for i in range(8):
            core.add_request(_request(f"p{round_}-{i}", prompt, 1))
        timer.take()
        walls = []
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t0)
    step_s = statistics.median([w for w in walls if w > 0][:2])
    attn_flops = 2 * shape.num_layers * shape.num_heads * shape.head_dim * prompt ** 2
    flops = 2 * _linear_params(shape) * per_step + attn_flops * per_step // prompt
    return name, per_step / step_s, flops / step_s / peak * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--backends", default="triton,flex", help="attention backends to run")
    ap.add_argument("--skip-prefill", action="store_true", help="decode steps only")
    ap.add_argument("--quantization", default="none",
                    help="weight formats to run: none (bf16), fp8, awq (comma-separated)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV cache types to run: auto (bf16), fp8 (comma-separated); the "
                         "bound counts the cache's own bytes")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bandwidth, peak = ceilings()
    print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    decode, prefill = [], []
    for name in args.models.split(","):
        for backend in args.backends.split(","):
            for quantization in args.quantization.split(","):
                for kv_dtype in args.kv_cache_dtype.split(","):
                    if backend == "flex" and kv_dtype != "auto":
                        print(f"  {name}/flex: no {kv_dtype} KV cache (FlexAttention reads "
                              "the activation dtype only); skipped", flush=True)
                        continue
                    rows, pre = model_tables(name, batches, args.context, bandwidth, peak,
                                             args.decode_steps, backend, quantization,
                                             not args.skip_prefill, kv_dtype)
                    decode += rows
                    if pre is not None:
                        prefill.append(pre)
                    for r in rows:  # as each finishes: a timeout keeps what was measured
                        print(f"  {r[0]} batch {r[1]}: step {r[2]:.2f} ms, forward "
                              f"{r[3]:.2f} ms, bound {r[4]:.2f} ms, {r[2] / r[4]:.2f}x",
                              flush=True)
    print(f"\ndecode step, bf16 activations, {args.context}-token prompts (HBM bound: "
          f"weights as held + KV read / {bandwidth / 1e12:.2f} TB/s)")
    print(f"{'model':<16}{'batch':>6}{'step ms':>10}{'forward ms':>12}{'bound ms':>10}"
          f"{'step/bound':>12}")
    for name, batch, wall, fwd, bound in decode:
        print(f"{name:<16}{batch:>6}{wall:>10.2f}{fwd:>12.2f}{bound:>10.2f}"
              f"{wall / bound:>11.2f}x")
    print(f"\nprefill, 2,048-token prompts, 8,192-token steps (matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s)")
    for name, tokens_s, share in prefill:
        print(f"{name:<16}{tokens_s:>12,.0f} tok/s {share:>6.1f} % of the peak")


if __name__ == "__main__":
    main()
