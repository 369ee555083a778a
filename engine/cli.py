"""`flotilla` command line: generate text offline with the engine."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="local checkpoint dir, .gguf file, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch CPU threads (default: the engine's choice)")


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, FlotillaError, SamplingParams
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  num_threads=args.num_threads)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, stop=args.stop or [])
        prompts = args.prompts or [sys.stdin.read()]
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    except FlotillaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[finish_reason={completion.finish_reason}, "
              f"tokens={len(completion.token_ids)}]")
    return 0


def _serve_engine(args: argparse.Namespace) -> int:
    import logging

    from engine import EngineConfig, FlotillaError
    from engine.core_server import EngineCoreServer
    from engine.engine_core import EngineCore
    logging.basicConfig(level=logging.INFO)
    try:
        core = EngineCore(EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            num_threads=args.num_threads))
    except FlotillaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = EngineCoreServer(core, args.address, args.engine_index)
    import signal
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The engine's subcommands; deployments.cli adds `serve` (Ray) to them."""
    parser = argparse.ArgumentParser(prog="flotilla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts, offline")
    _engine_args(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: read one from stdin)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    serve_engine = sub.add_parser("serve-engine", help="run one engine-core server (ZMQ)")
    _engine_args(serve_engine)
    serve_engine.add_argument("--address", required=True, help="tcp://host:port or ipc://path")
    serve_engine.add_argument("--engine-index", type=int, default=0)
    from engine.mock import add_mock_arguments
    mock = sub.add_parser("mock-engine", help="model-free engine-core server(s) for benchmarks")
    add_mock_arguments(mock)
    return parser, sub


def run_command(args: argparse.Namespace) -> int:
    from engine.mock import run_mock_engines
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve-engine":
        return _serve_engine(args)
    if args.command == "mock-engine":
        return run_mock_engines(args)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
