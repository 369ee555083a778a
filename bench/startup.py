"""Start-up time of `flotilla serve` (or `make run`): from the command to "Flotilla is
serving", and to the first chat answer, over several starts in a row.

Each start runs in a process group of its own and is stopped with SIGTERM to the group
(as a terminal's Ctrl-C or systemd would) once it answered; the next start waits for
the previous one to exit. Every output line is stamped with its time since the
command, so `--phases` shows where a start spends its time (the CLI's lines, Ray's,
the replicas' logs that reach the terminal).

    python bench/startup.py --starts 3                  # flotilla serve --model default
    python bench/startup.py --command "make run" --starts 3

Issue 41's target on the 2-core machine: a second start of any checkout in under 25 s.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.wire.ports import free_port  # noqa: E402

READY_LINE = "Flotilla is serving"
START_TIMEOUT_S = 300.0


@dataclass
class Start:
    serving_s: float  # the command to the CLI's "Flotilla is serving" line
    answered_s: float  # the command to the first chat completion's answer
    stopped_s: float  # SIGTERM to the group's exit
    lines: list[tuple[float, str]] = field(default_factory=list)


def _chat(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        json.load(r)


def one_start(command: list[str], port: int) -> Start:
    """Run `command` (its port already in it) until it serves and answers, then stop it."""
    began = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - began, line.rstrip()))
            if READY_LINE in line:
                serving.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not serving.wait(START_TIMEOUT_S):
            raise RuntimeError(f"no {READY_LINE!r} within {START_TIMEOUT_S:g} s: "
                               f"{[text for _, text in lines[-20:]]}")
        serving_s = next(t for t, text in lines if READY_LINE in text)
        _chat(port)
        answered_s = time.monotonic() - began
    finally:
        stop_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
        stopped_s = time.monotonic() - stop_at
        reader.join(5)
    return Start(serving_s, answered_s, stopped_s, lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--command", default=None,
                    help="what to start; PORT is replaced by a free port (default: "
                         "flotilla serve --model default --port PORT; 'make run' gets "
                         "PORT=... appended)")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="print every start's lines")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    venv_bin = Path(sys.executable).parent
    starts = []
    for i in range(args.starts):
        port = free_port("127.0.0.1")
        if args.command is None:
            command = [str(venv_bin / "flotilla"), "serve", "--model", "default",
                       "--port", str(port)]
        elif args.command.split()[:2] == ["make", "run"]:
            command = [*args.command.split(), f"PORT={port}"]
        else:
            command = args.command.replace("PORT", str(port)).split()
        start = one_start(command, port)
        starts.append(start)
        print(f"start {i + 1}: serving after {start.serving_s:.1f} s, answered after "
              f"{start.answered_s:.1f} s; stopped {start.stopped_s:.1f} s after SIGTERM",
              flush=True)
        if args.phases:
            for t, text in start.lines:
                print(f"  {t:6.1f}  {text[:160]}")
    serving = sorted(s.serving_s for s in starts)
    print(f"serving after: {', '.join(f'{s:.1f}' for s in serving)} s "
          f"(median {serving[len(serving) // 2]:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in starts], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
