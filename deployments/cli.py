"""`flotilla` command line: the engine's subcommands plus `serve` (Ray Serve).

`flotilla serve`'s flags are generated from the app's options (deployments.config:
flat_options(): EngineConfig's fields, AppArgs' own, MockTiming's as --mock-*), so a
new option is a new flag without touching this file. It starts a local Ray (or joins
$RAY_ADDRESS), runs the app and blocks; SIGINT and SIGTERM both shut Serve and the
Ray it started down and exit 0.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Sequence

from engine.cli import build_parser, run_command
from engine.options import Option, add_flags, given

SERVE_SHUTDOWN_TIMEOUT_S = 30.0
_ENGINE_GROUP = "engine options (EngineConfig)"
_APP_GROUP = "app options (Ray Serve deployments)"
_MOCK_GROUP = "mock engine options (--model mock)"


def _group_of(opt: Option, engine_names: set[str]) -> str:
    if opt.name in engine_names:
        return _ENGINE_GROUP
    return _MOCK_GROUP if opt.name.startswith("mock_") else _APP_GROUP


def add_serve_parser(sub: argparse._SubParsersAction) -> list[Option]:
    """The `serve` subcommand; returns the app options its flags carry."""
    from deployments.config import flat_options
    from engine.cli import ENGINE_OPTIONS
    srv = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve",
                         description="Serve a model behind the OpenAI API on Ray Serve: "
                         "ingress replicas -> data-parallel engine replicas.")
    server = srv.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    options = flat_options()
    engine_names = {o.name for o in ENGINE_OPTIONS}
    groups = {name: srv.add_argument_group(name)
              for name in (_ENGINE_GROUP, _APP_GROUP, _MOCK_GROUP)}
    for opt in options:
        add_flags(groups[_group_of(opt, engine_names)], [opt])
    return options


class _Stop(Exception):
    """Raised in the main thread by SIGINT / SIGTERM."""


def _serve(args: argparse.Namespace, options: list[Option],
           parser: argparse.ArgumentParser) -> int:
    import os

    from deployments.app import build_app
    from deployments.config import parse_app_args
    try:
        parsed = parse_app_args(given(args, options))
        app = build_app(parsed)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line

    def _raise_stop(signum, _frame):
        raise _Stop(signal.Signals(signum).name)

    import ray
    from ray import serve
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address)  # joins RAY_ADDRESS or starts a local Ray
    # Ray's driver handlers would dump a stack on SIGTERM: both signals stop cleanly.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_stop)
    try:
        if not address:  # a local Ray has no autoscaler: what does not fit would wait forever
            parsed.check_fits(ray.cluster_resources())
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="flotilla", route_prefix="/")
        print(f"Flotilla is serving {parsed.model_name} at http://{args.host}:{args.port}/v1 "
              f"(Ctrl-C to stop)", flush=True)
        threading.Event().wait()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (_Stop, KeyboardInterrupt):
        print("Flotilla: shutting down", flush=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut it
            signal.signal(signum, signal.SIG_IGN)
        _shut_down(serve, ray)
    return 0


def _shut_down(serve, ray) -> None:
    """Delete the app (engines drain), then leave Ray; a Ray that started here stops
    with it. serve.shutdown() waits on the Serve controller, which never answers when the
    signal also reached Ray's own processes (a terminal's Ctrl-C or systemd's stop
    signal the whole group), so it gets a bounded wait before Ray goes down anyway."""
    stopper = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
    stopper.start()
    stopper.join(SERVE_SHUTDOWN_TIMEOUT_S)
    if stopper.is_alive():
        print(f"Flotilla: Serve did not stop within {SERVE_SHUTDOWN_TIMEOUT_S:g} s; "
              "stopping Ray", file=sys.stderr, flush=True)
    ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser, sub = build_parser()
    options = add_serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, options, sub.choices["serve"])
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
