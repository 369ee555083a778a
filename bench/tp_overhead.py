"""Per-step cost of tensor parallelism on CPU: TP=1 vs TP=2 on the same two cores.

The default model has 9 heads, which 2 does not divide, so this builds a random-weight
Llama of the same size (30 layers, hidden 576, MLP 1536, vocab 49152) with 8 heads /
2 KV heads. It runs one decode-heavy batch (16 prompts x 32 tokens, 64 new tokens,
greedy) with TP=1 (one process, 2 torch threads) and TP=2 (2 ranks x 1 thread), and
times, in the rank-0 process, what TP adds to each step: encoding + broadcasting the
step's StepInput to the worker, and the collectives inside the forward pass (the
all-reduces after attention and MLP, the embedding all-reduce, the logits gather).
Collective times include waiting for the slower rank.

    .venv/bin/python bench/tp_overhead.py
"""
from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path

PROMPTS, PROMPT_LEN, NEW = 16, 32, 64


def _timed(obj, name: str, bucket: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket[key] += time.perf_counter() - start
            bucket[key + " calls"] += 1
    setattr(obj, name, wrapper)


def build_model(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.model.loader import load_tokenizer, resolve_model
    if (out / "config.json").exists():
        return out
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    load_tokenizer(resolve_model("default")).save_pretrained(out)
    return out


def run(model: Path, tp: int) -> None:
    from engine import LLM, SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    llm = LLM(str(model), dtype="bfloat16", tensor_parallel_size=tp,
              num_threads=2 if tp == 1 else 1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm.generate(prompts[:2], params.clone(max_tokens=4), use_tqdm=False)
    core = llm.llm_engine.engine_core
    spent: dict = defaultdict(float)
    steps = [0]
    step = core.step

    def counting_step():
        steps[0] += 1
        return step()
    core.step = counting_step
    if tp > 1:
        group = core.runner.tp
        _timed(core.runner, "_send", spent, "step broadcast")
        _timed(group, "all_reduce", spent, "all-reduce")
        _timed(group, "gather_last_dim", spent, "logits gather")
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    n = steps[0]
    print(f"TP={tp}: {n} steps, {wall / n * 1e3:.2f} ms/step, "
          f"{PROMPTS * NEW / wall:.1f} output tok/s")
    for key in ("step broadcast", "all-reduce", "logits gather"):
        if spent[key + " calls"]:
            print(f"  {key}: {spent[key] / n * 1e3:.3f} ms/step "
                  f"({spent[key + ' calls'] / n:.0f} calls/step, "
                  f"{spent[key] / spent[key + ' calls'] * 1e6:.0f} us/call)")
    llm.shutdown()


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "llama-135m-8h")
        run(path, 1)
        run(path, 2)
