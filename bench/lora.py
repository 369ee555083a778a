"""LoRA throughput: workload W1 with four rank-16 adapters round robin vs the base model.

W1 (bench/throughput.py): 64 prompts x 64 prompt token ids, 128 output tokens each,
greedy, ignore_eos, default model. The adapters are made here with peft on the
default model's weights: rank 16, alpha 32, every projection (q, k, v, o, gate, up,
down), random non-zero A and B. Prompt i runs with adapter i % 4, so every step
mixes the four adapters. The base run uses an engine without LoRA; the LoRA run an
engine with enable_lora, max_loras 4, max_lora_rank 16. Both engines live in this
process and run one after the other, alternating, --rounds times; the figures are
output tokens/s and the ratio of best-of runs (target: >= 0.75x).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.throughput import NUM_PROMPTS, OUTPUT_LEN, workload

ADAPTERS, RANK = 4, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    paths = []
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                target_modules=TARGETS,
                                                init_lora_weights=False))
        model.save_pretrained(out / f"adapter{i}")
        paths.append(out / f"adapter{i}")
    return paths


def timed(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == NUM_PROMPTS * OUTPUT_LEN
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    from engine import LLM, LoRARequest, SamplingParams
    prompts = workload()
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        from checkpoints import float_checkpoint  # peft loads float weights
        paths = make_adapters(Path(float_checkpoint(args.model)), Path(tmp))
        loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        per_prompt = [loras[i % ADAPTERS] for i in range(len(prompts))]
        base = LLM(args.model, dtype="float32", num_threads=args.num_threads,
                   enable_prefix_caching=False)
        lora = LLM(args.model, dtype="float32", num_threads=args.num_threads,
                   enable_prefix_caching=False, enable_lora=True, max_loras=ADAPTERS,
                   max_lora_rank=RANK)
        warm = params.clone(max_tokens=8)
        base.generate(prompts[:8], warm, use_tqdm=False)
        lora.generate(prompts[:8], warm, use_tqdm=False, lora_request=per_prompt[:8])
        results: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(args.rounds):
            order = ("base", "lora") if r % 2 == 0 else ("lora", "base")
            for name in order:
                if name == "base":
                    rate = timed(base, prompts, params, None)
                else:
                    rate = timed(lora, prompts, params, per_prompt)
                results[name].append(rate)
                print(f"round {r} {name}: {rate:.1f} output tok/s", flush=True)
        best_base, best_lora = max(results["base"]), max(results["lora"])
        pairs = [lr / b for lr, b in zip(results["lora"], results["base"])]
        print(f"threads {torch.get_num_threads()}: base {best_base:.1f} tok/s, "
              f"{ADAPTERS} adapters of rank {RANK} round robin {best_lora:.1f} tok/s: "
              f"{best_lora / best_base:.3f}x best-of (per round "
              f"{', '.join(f'{p:.3f}' for p in pairs)}; target >= 0.75x)")
        base.shutdown()
        lora.shutdown()


if __name__ == "__main__":
    main()
