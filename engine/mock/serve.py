"""The mock engine as a process: `python -m engine.mock` and `flotilla mock-engine`.

One engine-core server (engine/wire/core_server.py) per mock engine, each in a process of
its own, so that frontends and benchmarks reach them over ZMQ exactly as real engines.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.mock.config import MockConfig
from engine.mock.core import MockEngineCore
from engine.mock.script import default_tokenizer
from engine.options import add_flags, dataclass_options, given

MOCK_OPTIONS = dataclass_options(MockConfig)  # every documented field: timing and shape


def add_curve_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--curve-keys", metavar="JSON_FILE",
                        help="serve over ZMQ CURVE with these keys (a JSON object of "
                             "EngineKeys' four fields, engine/wire/curve_auth.py); only "
                             "clients holding its client pair are admitted")


def add_mock_arguments(parser: argparse.ArgumentParser) -> None:
    """The mock engine's command-line options (shared by both entry points)."""
    parser.add_argument("--address", required=True,
                        help="tcp://host:port or ipc://path; engine i gets port+i / path-i")
    parser.add_argument("--engines", type=int, default=1, help="engines to start (processes)")
    add_curve_argument(parser)
    add_flags(parser, MOCK_OPTIONS)


def config_from_args(args: argparse.Namespace, engine_index: int) -> MockConfig:
    return MockConfig(engine_index=engine_index, **given(args, MOCK_OPTIONS))


def serve_one(config: MockConfig, address: str, keys_file: str | None = None) -> None:
    """Run one mock engine-core server until SIGTERM / SIGINT."""
    import signal

    from engine.wire.core_server import EngineCoreServer
    from engine.wire.curve_auth import EngineKeys
    keys = EngineKeys.load(keys_file) if keys_file else None
    core = MockEngineCore(config, tokenizer=default_tokenizer() if config.scripted else None)
    server = EngineCoreServer(core, address, config.engine_index, keys=keys)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        server.run()
    except KeyboardInterrupt:
        pass


def run_mock_engines(args: argparse.Namespace) -> int:
    """Start args.engines mock servers, one process each; wait for them."""
    import multiprocessing

    from engine.wire.core_server import engine_addresses
    addresses = engine_addresses(args.address, args.engines)
    if args.engines == 1:
        serve_one(config_from_args(args, 0), addresses[0], args.curve_keys)
        return 0
    import signal

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=serve_one, args=(config_from_args(args, i), a, args.curve_keys),
                         daemon=True)
             for i, a in enumerate(addresses)]
    for p in procs:
        p.start()

    def _stop(*_):  # SIGTERM to the parent takes the engines down with it
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _stop)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
            p.join(5)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import logging
    parser = argparse.ArgumentParser(prog="python -m engine.mock",
                                     description="model-free engine-core server(s)")
    add_mock_arguments(parser)
    logging.basicConfig(level=logging.INFO)
    return run_mock_engines(parser.parse_args(argv))


