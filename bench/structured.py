"""Structured-outputs overhead: W1 with a JSON schema against W1 without, same engine.

W1 (bench/throughput.py): 64 prompts x 64 token ids, 128 output tokens each, greedy,
ignore_eos, default model. The constrained run gives every request a JSON schema (an
array of at least 32 person records) that cannot be completed in 128 tokens, so both
runs generate exactly 8,192 tokens and differ only by the constraint: compiling,
filling the bitmask of 64 rows per step, applying it, advancing the matchers.
Runs alternate (plain, json, plain, json, ...) so machine noise hits both alike; the
best of each is compared. Target: constrained >= 0.9x unconstrained.

--libraries also times the two grammar libraries on this tokenizer: fill the next
token bitmask + accept one token, walking a short JSON record (llguidance only
if it is installed; it is not a dependency).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from throughput import NUM_PROMPTS, OUTPUT_LEN, workload  # bench/ is the script's path

SCHEMA = {"type": "array", "minItems": 32, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"]}}


def run_w1(llm, prompts, structured) -> tuple[float, int]:
    from engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                            structured_outputs=structured)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, tokens


PLAIN_RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]}


def compare_libraries() -> None:
    """Per-token cost of each library on two record schemas: unbounded fields, and the
    W1 schema's bounded ones (maxLength, an integer range), which both libraries expand
    into much larger automata."""
    from engine.model.loader import load_tokenizer, resolve_model
    tok = load_tokenizer(resolve_model("default"))
    vocab = 49152
    doc = {"name": "Ada Lovelace", "age": 36, "role": "admin"}
    spaced = tok.encode(json.dumps(doc), add_special_tokens=False)
    compact = tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
    logits = torch.randn(64, vocab)

    def per_token(make_matcher, fill, accept, ids) -> float:
        best = float("inf")
        for _ in range(5):
            matcher = make_matcher()
            start = time.perf_counter()
            for t in ids:
                fill(matcher)
                assert accept(matcher, t)
            best = min(best, (time.perf_counter() - start) / len(ids))
        return best

    import xgrammar as xgr
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    print(f"xgrammar: tokenizer setup {(time.perf_counter() - start) * 1e3:.0f} ms")
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for name, schema in (("unbounded", PLAIN_RECORD), ("bounded", SCHEMA["items"])):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compile_s = time.perf_counter() - start
        cost = per_token(lambda: xgr.GrammarMatcher(compiled),
                         lambda m: m.fill_next_token_bitmask(bitmask),
                         lambda m, t: m.accept_token(t), spaced)
        print(f"  {name} record: compile {compile_s * 1e3:.1f} ms, fill+accept "
              f"{cost * 1e6:.1f} us/token")
    rows = xgr.allocate_token_bitmask(64, vocab)
    start = time.perf_counter()
    for _ in range(20):
        xgr.apply_token_bitmask_inplace(logits, rows)
    print(f"  apply to 64 rows: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms")
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lgt
    except ImportError:
        print("llguidance: not installed (pip install llguidance to compare)")
        return
    start = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    print(f"llguidance: tokenizer setup {(time.perf_counter() - start) * 1e3:.0f} ms")
    bitmask = lgt.allocate_token_bitmask(1, vocab)
    for name, schema in (("unbounded", PLAIN_RECORD), ("bounded", SCHEMA["items"])):
        # no free whitespace, as xgrammar's any_whitespace=False; llguidance then spells
        # JSON without spaces, so it walks the compact form of the same record
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        cost = per_token(lambda: llguidance.LLMatcher(ltok, grammar),
                         lambda m: lgt.fill_next_token_bitmask(m, bitmask, 0),
                         lambda m, t: m.consume_token(t), compact)
        print(f"  {name} record: fill+accept {cost * 1e6:.1f} us/token")
    rows = lgt.allocate_token_bitmask(64, vocab)
    start = time.perf_counter()
    lgt.apply_token_bitmask_inplace(logits, rows)
    print(f"  apply to 64 rows: {(time.perf_counter() - start) * 1e3:.2f} ms (its torch "
          "helper on CPU)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=2, help="plain/json pairs to run")
    parser.add_argument("--libraries", action="store_true",
                        help="also time xgrammar (and llguidance if installed) per token")
    args = parser.parse_args()
    if args.libraries:
        compare_libraries()

    from engine import LLM, SamplingParams
    from engine.structured.params import StructuredOutputsParams
    llm = LLM(args.model, max_num_seqs=NUM_PROMPTS)
    prompts = workload()
    spec = StructuredOutputsParams(json=SCHEMA)
    # warm-up: kernels, and the schema compiled once (later requests hit the cache)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, structured_outputs=spec),
                 use_tqdm=False)
    best = {"plain": float("inf"), "json": float("inf")}
    for r in range(args.rounds):
        for name, structured in (("plain", None), ("json", spec)):
            elapsed, tokens = run_w1(llm, prompts, structured)
            assert tokens == NUM_PROMPTS * OUTPUT_LEN, tokens
            best[name] = min(best[name], elapsed)
            print(f"round {r + 1} {name:5s}: {tokens} tokens in {elapsed:.2f}s = "
                  f"{tokens / elapsed:.1f} tok/s", flush=True)
    tokens = NUM_PROMPTS * OUTPUT_LEN
    plain, constrained = tokens / best["plain"], tokens / best["json"]
    print(f"best: unconstrained {plain:.1f} tok/s, json schema {constrained:.1f} tok/s = "
          f"{constrained / plain:.3f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
