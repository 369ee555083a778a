"""Recovery: where the seconds go between an engine's kill -9 under load and its
replacement serving (issue 62: whole again within 30 s with the default model).

    python bench/recovery.py                          # the default model, c=128, 2 kills
    python bench/recovery.py --kills 1 --concurrency 64 --model mock

Starts `flotilla serve` as the chaos run does (DP=2, two ingress replicas), loads it
with the chaos run's clients, and SIGKILLs one EngineServer replica `--kills` times,
each after the membership was whole again and a quiet spell. Each kill's phases, in
seconds from the kill, are read from the logs of the server's own Ray (its temp dir
under a RAY_TMPDIR of this script's) and from /proc:

    noticed      Serve's controller marks the replica unhealthy (its health check's
                 reference fails once Ray reports the actor dead)
    scheduled    the controller starts the replacement replica (creates its actor)
    process      the replacement's worker process exists (its /proc start time)
    initialized  Serve's replica wrapper in it starts the deployment's constructor
                 (the worker started, Ray and the deployment's modules imported)
    assigned     the coordinator has handed it a rank
    registered   its engine is built (config, weights, KV pool, warm-up: the parts are
                 printed) and registered at the coordinator: the ingress replicas
                 connect at their next membership poll
    ready        the controller has the replica running (constructor + health check)
    whole        the chaos run's own figure: every rank answers three probes in a row
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import re
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench.chaos import Tally, drive, replica_pids, wait_whole  # noqa: E402
from bench.serve import start_server, stop_server  # noqa: E402
from bench.soak import mock_server  # noqa: E402

STAMP = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
PHASES = ("noticed", "scheduled", "process", "initialized", "assigned", "registered",
          "ready", "whole")


def log_time(line: str) -> float | None:
    """The wall time (epoch seconds) of a Serve log line, or None."""
    m = STAMP.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_after(path: Path, pattern: str, since: float) -> tuple[float | None, str]:
    """(time, line) of the first line of path at or after `since` matching pattern."""
    rx = re.compile(pattern)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None, ""
    for line in lines:
        t = log_time(line)
        if t is not None and t >= since - 0.001 and rx.search(line):
            return t, line
    return None, ""


def process_start(pid: int) -> float | None:
    """A live process's start as epoch seconds (/proc/<pid>/stat field 22)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text()
                     .splitlines() if line.startswith("btime"))
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def phases(logs: Path, killed_at: float, whole_s: float | None) -> dict[str, float | None]:
    """Each phase's seconds after the kill (None: not seen)."""
    serve = logs / "serve"
    controller = next(iter(sorted(serve.glob("controller_*.log"))), serve / "controller.log")
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    t, _ = first_after(controller, r"EngineServer.*(crashed|unhealthy)", killed_at)
    out["noticed"] = t
    t, line = first_after(controller, r"Starting Replica\(id='(\w+)', deployment='EngineServer'",
                          killed_at)
    out["scheduled"] = t
    new_id = re.search(r"id='(\w+)'", line).group(1) if line else None
    if new_id:
        t, line = first_after(controller, rf"Replica\(id='{new_id}'.*started successfully",
                              killed_at)
        out["ready"] = t
        pid = re.search(r"PID: (\d+)", line)
        out["process"] = process_start(int(pid.group(1))) if pid else None
        replica = next(iter(serve.glob(f"replica_*EngineServer_{new_id}.log")), None)
        built = ""
        if replica is not None:
            out["initialized"], _ = first_after(replica, r"Started initializing replica",
                                                killed_at)
            out["assigned"], _ = first_after(replica, r"rank assigned in", killed_at)
            out["registered"], line = first_after(replica, r"serving .* after its start",
                                                  killed_at)
            built = line.split("(", 1)[-1].rstrip(")") if line else ""
    result: dict = {k: (None if v is None else v - killed_at) for k, v in out.items()}
    result["whole"] = whole_s
    result["build"] = built
    return result


async def run(base_url: str, root: int, logs_root: Path, model: str, kills: int,
              concurrency: int, baseline_s: float, quiet_s: float) -> list[dict]:
    tally = Tally()
    until = [time.monotonic() + 10 ** 6]
    load = asyncio.ensure_future(drive(base_url, model, concurrency, until,
                                       30.0 if model == "mock" else 120.0, tally))
    rng, results = random.Random(0), []
    try:
        await asyncio.sleep(baseline_s)
        for _ in range(kills):
            pid = rng.choice(replica_pids(root, "engine"))
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            whole_s, why = await wait_whole(base_url, model, 10.0 if model == "mock" else 60.0)
            logs = next(logs_root.glob("fr-*/session_latest/logs"))
            results.append({"pid": pid, **phases(logs, killed_at, whole_s),
                            "probes failing": dict(why.most_common(2))})
            print(format_row(results[-1]), flush=True)
            await asyncio.sleep(quiet_s)
    finally:
        until[0] = 0.0
        await load
    print("load: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    return results


def format_row(row: dict) -> str:
    cells = [f"{k} {'-' if row[k] is None else f'{row[k]:.1f}'}" for k in PHASES]
    return (f"kill {row['pid']}: " + ", ".join(cells) + f"\n  {row['build']}"
            f"\n  probes failing: {row['probes failing']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--baseline", type=float, default=20.0, help="load before the first kill")
    parser.add_argument("--quiet", type=float, default=10.0, help="load between kills")
    parser.add_argument("--port", type=int, default=8013)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    server = mock_server(args.port, args.model)
    server = dataclasses.replace(server, env={**server.env, "RAY_TMPDIR": str(tmp)})
    proc = start_server(server, args.port, tmp / "server.log")
    try:
        asyncio.run(run(f"http://127.0.0.1:{args.port}", proc.pid, tmp, args.model,
                        args.kills, args.concurrency, args.baseline, args.quiet))
    finally:
        keep = tmp / "logs"
        for logs in tmp.glob("fr-*/session_latest/logs"):
            os.system(f"cp -r {logs} {keep}")  # the server removes its Ray's dir at stop
        stop_server(proc)
    print(f"logs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
