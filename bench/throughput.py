"""Offline throughput benchmark (workload W1) for the engine, optionally beside HF generate.

W1: 64 prompts x 64 prompt token ids (fixed seed), 128 output tokens each, greedy,
ignore_eos, default model. Prints output tokens/s = 8192 / wall time of the whole
run (prefill included; model load and warm-up excluded). With --baseline hf the
same workload runs through transformers `generate` (fp32) in the same process,
and the ratio is printed.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 64, 128


def workload(seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)]
            for _ in range(NUM_PROMPTS)]


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
    print(f"flotilla: dtype={core.dtype} threads={torch.get_num_threads()} "
          f"block_size={core.block_size}: {tokens} tokens in {elapsed:.2f}s = "
          f"{tokens / elapsed:.1f} output tok/s")
    return tokens / elapsed


def run_hf(args, prompts) -> float:
    from transformers import AutoModelForCausalLM

    from engine.model.loader import resolve_model
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)),
                                                 dtype=torch.float32).eval()
    bs = args.hf_batch_size

    def generate(batch, n):
        x = torch.tensor(batch)
        return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    generate(prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), bs):
            out = generate(prompts[i:i + bs], OUTPUT_LEN)
            tokens += out[:, PROMPT_LEN:].numel()
    elapsed = time.perf_counter() - start
    print(f"hf generate: fp32 batch={bs} threads={torch.get_num_threads()}: {tokens} tokens "
          f"in {elapsed:.2f}s = {tokens / elapsed:.1f} output tok/s")
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--baseline", choices=["hf"], default=None)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    args = parser.parse_args()
    prompts = workload()
    ours = run_flotilla(args, prompts)
    if args.baseline == "hf":
        theirs = run_hf(args, prompts)
        print(f"ratio flotilla / hf generate (batch {args.hf_batch_size}): {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
