"""Where a decode step's GPU time goes: torch.profiler over eager decode steps.

  python bench/gpu_profile.py [--model 1b] [--batch 64] [--context 512] [--backend triton]

Builds the random-weight engine of bench/gpu.py, prefills `batch` prompts, then prints
the median step time with CUDA graphs and eagerly, the kernels of three eager steps
ranked by device time (graph replays hide the kernels' names), and how many kernels a
step launches, per decoder layer.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import _model_dir, _request  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402


def _steps(core: EngineCore, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton", help="attention_backend")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    for eager in (False, True):
        config = EngineConfig(model=_model_dir(args.model), load_format="dummy", dtype=dtype,
                              device=args.device, max_num_seqs=args.batch,
                              enforce_eager=eager, log_stats_interval_s=0,
                              enable_prefix_caching=False, max_model_len=args.context + 64,
                              kv_cache_memory_bytes=8 << 30,
                              attention_backend=args.backend)
        core = EngineCore(config)
        for i in range(args.batch):
            core.add_request(_request(f"r{i}", args.context, 40))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
            core.step()
        step = statistics.median(_steps(core, 10)[2:])
        print(f"{args.model}/{args.backend} batch {args.batch}: decode step {step * 1e3:.2f} ms "
              f"({'eager' if eager else 'CUDA graphs'}), {core.num_blocks} KV blocks",
              flush=True)
        if eager:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                _steps(core, 3)
            key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60))
            if args.device == "cuda":
                kernels = sum(1 for e in prof.events()
                              if e.device_type == torch.autograd.DeviceType.CUDA)
                layers = core.shape.num_layers
                print(f"kernels a decode step: {kernels / 3:.0f}, "
                      f"{kernels / 3 / layers:.1f} per layer ({layers} layers)")
        core.shutdown()
        del core


if __name__ == "__main__":
    main()
