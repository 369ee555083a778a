"""`flotilla` command line: generate text offline with the engine."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from engine.config import EngineConfig
from engine.options import add_flags, dataclass_options, given

ENGINE_OPTIONS = dataclass_options(EngineConfig)


def _engine_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("engine options (EngineConfig)"), ENGINE_OPTIONS)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**given(args, ENGINE_OPTIONS))


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, FlotillaError, SamplingParams
    try:
        config = _engine_config(args)
        llm = LLM(**dataclasses.asdict(config))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, stop=args.stop or [])
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

    from engine import FlotillaError
    from engine.core.engine_core import EngineCore
    from engine.wire.core_server import EngineCoreServer
    from engine.wire.curve_auth import EngineKeys
    logging.basicConfig(level=logging.INFO)
    try:
        core = EngineCore(_engine_config(args))
    except FlotillaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keys = EngineKeys.load(args.curve_keys) if args.curve_keys else None
    server = EngineCoreServer(core, args.address, args.engine_index, keys=keys)
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
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per "
                     "prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 is greedy (default: 0); sampling draws from --seed")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    serve_engine = sub.add_parser("serve-engine", help="run one engine-core server (ZMQ)")
    _engine_args(serve_engine)
    serve_engine.add_argument("--address", required=True, help="tcp://host:port or ipc://path")
    serve_engine.add_argument("--engine-index", type=int, default=0)
    from engine.mock.serve import add_curve_argument, add_mock_arguments
    add_curve_argument(serve_engine)
    mock = sub.add_parser("mock-engine", help="model-free engine-core server(s) for benchmarks")
    add_mock_arguments(mock)
    return parser, sub


def run_command(args: argparse.Namespace) -> int:
    from engine.mock.serve import run_mock_engines
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
