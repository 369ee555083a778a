"""`flotilla` command line: the engine's subcommands plus `serve` (Ray Serve)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from engine.cli import build_parser, run_command


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import AppArgs
    app_args = {"model": args.model, "data_parallel_size": args.data_parallel_size,
                "tensor_parallel_size": args.tensor_parallel_size, "dtype": args.dtype,
                "dev_mode": args.dev_mode, "api_key": args.api_key or os.environ.get(
                    "FLOTILLA_API_KEY"), "admin_key": args.admin_key}
    if args.max_model_len:
        app_args["max_model_len"] = args.max_model_len
    if args.served_model_name:
        app_args["served_model_name"] = args.served_model_name
    if args.engine_num_cpus is not None:
        app_args["engine_num_cpus"] = args.engine_num_cpus
    try:
        app = build_app(app_args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address)  # joins RAY_ADDRESS or starts locally
    if not address:  # a local Ray has no autoscaler: what does not fit would wait forever
        try:
            AppArgs.model_validate(app_args).check_fits(ray.cluster_resources())
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            ray.shutdown()
            return 2
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="flotilla", route_prefix="/")
    print(f"Flotilla is serving {args.model} at http://{args.host}:{args.port}/v1 "
          f"(Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser, sub = build_parser()
    srv = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve")
    srv.add_argument("--model", default="default", help="checkpoint, .gguf, default, or mock")
    srv.add_argument("--data-parallel-size", type=int, default=1)
    srv.add_argument("--tensor-parallel-size", type=int, default=1)
    srv.add_argument("--dtype", default="auto")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--engine-num-cpus", type=float, default=None)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="(or FLOTILLA_API_KEY)")
    srv.add_argument("--admin-key", default=None)
    srv.add_argument("--dev-mode", action="store_true", help="open control endpoints")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
