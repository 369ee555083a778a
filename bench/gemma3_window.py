"""Gemma 3's KV memory per sequence at 8k context (issue 43): KV blocks held, measured.

The checkpoint is random-weight, made once with transformers' own Gemma3TextConfig and
saved under the cache: Gemma 3 1B's attention layout, which alone fixes the KV bytes a
token costs (26 layers, every sixth global: 4 global and 22 local with a 512-token
window; 4 query heads over 1 KV head of 256), with a narrower hidden size and MLP (256,
1,024) and the default model's tokenizer, which change the compute but not the cache.

One sequence: an 8,000-token prompt (random ids, fixed seed) and 192 greedy tokens, so
its last step attends over 8,192 positions; block_size 16, chunked prefill at the
engine's default budget. Every step's blocks held by the sequence are counted per KV
group (engine/core/kv_groups.py: one global group of the 4 global layers, six local
groups of 4, a block holding 4 layers' keys and values). Printed: the blocks and bytes
held at 8k context and at the peak (a prefill chunk's tokens beside the window), and
what one block table for all layers would hold (every layer keeps every block).

    python bench/gemma3_window.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import checkpoints  # noqa: E402 - bench/ is not a package

LAYOUT = dict(num_hidden_layers=26, sliding_window=512, num_attention_heads=4,
              num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
              hidden_size=256, intermediate_size=1024, max_position_embeddings=32768)
PROMPT, NEW, BLOCK = 8000, 192, 16


def gemma3_checkpoint() -> Path:
    """The benchmark's Gemma 3 checkpoint, made once under the cache."""
    from transformers import Gemma3TextConfig
    return checkpoints.random_checkpoint("gemma3-1b-layout-h256", Gemma3TextConfig,
                                         "Gemma3ForCausalLM", **LAYOUT)


def measure(dtype: str) -> dict:
    from engine import LLM, SamplingParams
    model = gemma3_checkpoint()
    llm = LLM(str(model), dtype=dtype, block_size=BLOCK, max_model_len=PROMPT + NEW,
              enable_prefix_caching=False)
    core = llm.llm_engine.engine_core
    runner = core.runner
    groups = runner.kv_groups
    held: list[tuple[int, list[int]]] = []  # (context after the step, blocks per group)
    schedule = core.scheduler.schedule

    def watch():
        out = schedule()
        for r, n in zip(out.requests, out.num_new_tokens):
            held.append((r.num_computed_tokens + n,
                         [sum(b != core.kv.null_block for b in t) for t in r.group_blocks]))
        return out
    core.scheduler.schedule = watch
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT)]
    start = time.perf_counter()
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW,
                                                    ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - start
        assert len(out[0].outputs[0].token_ids) == NEW
        per_block = runner.bytes_per_block()
        per_layer_block = per_block // groups.slots
        context, last = held[-1]
        peak = max(held, key=lambda h: sum(h[1]))
        one_table = -(-context // BLOCK) * per_layer_block * core.shape.num_layers
        result = {
            "groups": [{"window": w, "layers": list(ls)} for w, ls in
                       zip(groups.windows, groups.layers)],
            "block_bytes": per_block, "context": context,
            "blocks_at_context": last, "bytes_at_context": sum(last) * per_block,
            "peak_context": peak[0], "peak_blocks": peak[1],
            "peak_bytes": sum(peak[1]) * per_block,
            "one_table_bytes_at_context": one_table, "seconds": round(seconds, 1),
        }
        assert core.kv.num_free_blocks == core.kv.usable_blocks
        return result
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures")
    args = parser.parse_args()
    r = measure(args.dtype)
    mib = 1 << 20
    print(f"KV groups: {[(g['window'], len(g['layers'])) for g in r['groups']]} "
          f"(window, layers); a block holds {r['block_bytes'] / 1024:.0f} KiB")
    print(f"at {r['context']} tokens: blocks held per group {r['blocks_at_context']} = "
          f"{r['bytes_at_context'] / mib:.1f} MiB; one table for all layers would hold "
          f"{r['one_table_bytes_at_context'] / mib:.1f} MiB "
          f"({r['one_table_bytes_at_context'] / r['bytes_at_context']:.2f}x)")
    print(f"peak (a prefill chunk at {r['peak_context']} tokens): {r['peak_blocks']} = "
          f"{r['peak_bytes'] / mib:.1f} MiB; run {r['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
