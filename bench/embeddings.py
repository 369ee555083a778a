"""Embeddings throughput: Flotilla's pooling path against a plain HF forward, same weights.

1,024 inputs of 64 token ids (fixed seed), default model, float32. Flotilla embeds
them with LLM.embed (batches of up to --batch requests per step: max_num_seqs and a
token budget of batch x 64); the baseline runs transformers' AutoModel forward on
batches of --batch (equal lengths, so no padding) and takes the same pooling (last
token, L2-normalized), as sentence-transformers would for this model. Both run in
this process one after the other, after a warm-up each; the check that both give the
same vectors (cosine) is printed with the figures. Target: >= 2x.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

NUM_INPUTS, INPUT_LEN = 1024, 64


def workload(seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(INPUT_LEN)]
            for _ in range(NUM_INPUTS)]


def run_flotilla(args, inputs) -> tuple[float, torch.Tensor]:
    from engine import LLM
    llm = LLM(args.model, dtype="float32", max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch * INPUT_LEN, enable_prefix_caching=False)
    llm.embed(inputs[:args.batch], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    elapsed = time.perf_counter() - start
    vectors = torch.tensor([o.outputs[0].embedding for o in outs])
    print(f"flotilla: {len(inputs)} inputs x {INPUT_LEN} tokens, batch {args.batch}, "
          f"threads {torch.get_num_threads()}: {elapsed:.2f}s = "
          f"{len(inputs) / elapsed:.1f} embeddings/s", flush=True)
    llm.shutdown()
    return len(inputs) / elapsed, vectors


def run_hf(args, inputs) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel

    from checkpoints import float_checkpoint  # HF loads float weights
    model = AutoModel.from_pretrained(float_checkpoint(args.model),
                                      dtype=torch.float32).eval()

    def embed(batch):
        ids = torch.tensor(batch)
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        return torch.nn.functional.normalize(hidden[:, -1], dim=-1)

    with torch.inference_mode():
        embed(inputs[:args.batch])  # warm-up
        start = time.perf_counter()
        vectors = torch.cat([embed(inputs[i:i + args.batch])
                             for i in range(0, len(inputs), args.batch)])
        elapsed = time.perf_counter() - start
    print(f"hf forward: batch {args.batch}, threads {torch.get_num_threads()}: "
          f"{elapsed:.2f}s = {len(inputs) / elapsed:.1f} embeddings/s", flush=True)
    return len(inputs) / elapsed, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    inputs = workload()
    ours, mine = run_flotilla(args, inputs)
    theirs, ref = run_hf(args, inputs)
    cosine = (mine * ref).sum(dim=-1)
    print(f"same vectors: min cosine {cosine.min().item():.6f}")
    print(f"ratio flotilla / hf forward: {ours / theirs:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
