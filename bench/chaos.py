"""Chaos: `flotilla serve` (DP=2, two ingress replicas) under a mixed load while its
processes are killed and stopped and hostile requests arrive; then checked that no
request hung, nothing leaked, and the membership healed after every fault.

    python bench/chaos.py                        # mock engines, 10 minutes at c=128
    python bench/chaos.py --model default        # the default model (SmolLM2-135M)
    python bench/chaos.py --duration 60 ...      # shorter (the suite: tests/e2e/test_soak.py)
    python bench/chaos.py --faults stop_coordinator --baseline 10 --duration 90   # one fault

Load: `concurrency` clients, one request after another: streamed and plain
completions and chat, n = 2 or 3, clients that disconnect mid-stream and, on a
real model, JSON-schema structured outputs. Every request carries `timeout` (its deadline).
After a fault-free spell (the goodput baseline), a fault every 20-40 s, at random:
kill -9 of an ingress replica, an engine replica or the coordinator; SIGSTOP of an
engine or an ingress replica for 3-15 s, then SIGCONT; SIGSTOP of the coordinator for
COORDINATOR_STOP_S, probing meanwhile that completions, /v1/models and an unknown model
are still answered (it is off the request path: the ingress serves from what it last
heard); or hostile requests (a fan-out past max_sequences_per_request, 5,000 stop
strings, a grammar that compiles for long).
After each fault it probes every engine through the front door (vLLM's
x-data-parallel-rank header) until each answers three times in a row: the membership is
whole again. Outcomes: ok; a clear error (an HTTP error with an OpenAI error body, or an
SSE error event); proxy (a 5xx without one, from the HTTP proxy in front when the
replica under the request died); cut (the connection dropped: its ingress replica was
killed); unclear (any other answer: a defect); hung (no answer `HANG_SLACK_S` past its
deadline). Checks: 0 hung, every fault healed within
HEAL_LIMIT_S, every engine back to 0 running, 0 waiting and 0 KV in use after the run,
every probe answered while the coordinator was stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench.serve import start_server, stop_server  # noqa: E402
from bench.soak import descendants, mock_server, request_body  # noqa: E402

APP = "flotilla"
ROLES = {"ingress": "OpenAIIngress", "engine": "EngineServer", "coordinator": "Coordinator"}
FAULTS = ("kill_ingress", "kill_engine", "kill_coordinator", "stop_engine", "stop_ingress",
          "stop_coordinator", "hostile")
DATA_PARALLEL = 2
HANG_SLACK_S = 20.0  # past its deadline plus the longest SIGSTOP, a request is hung
HEAL_LIMIT_S = 30.0
PROBES_IN_A_ROW = 3
# the coordinator's SIGSTOP: past every routine call's bound (coordinator_calls.py, 10 s),
# so the engines' heartbeats and the ingress's polls time out while requests go on
COORDINATOR_STOP_S = 20.0
MEANWHILE_ANSWER_S = 5.0  # each probe while it is stopped: answered within this, or failed
MUST_REFUSE = 2  # of hostile_bodies(): the first ones, which no server may serve


# ---- the server's replicas ------------------------------------------------------------
def replica_pids(root: int, role: str) -> list[int]:
    """PIDs of the Serve replicas of one deployment (Ray titles them
    ray::ServeReplica:<app>:<deployment>); a process it forked carries the same title,
    so only those whose parent does not are replicas."""
    tag = f"ServeReplica:{APP}:{ROLES[role]}".encode()

    def tagged(pid: int) -> bool:
        try:
            return tag in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0
    return [pid for pid in descendants(root) if tagged(pid) and not tagged(parent(pid))]


# ---- load -------------------------------------------------------------------------------
@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # ok, error, cut, hung
    statuses: Counter = field(default_factory=Counter)  # HTTP status (error events: code)
    examples: dict[str, list[str]] = field(default_factory=dict)
    good_tokens: list[tuple[float, int]] = field(default_factory=list)  # (ended at, tokens)

    def note(self, outcome: str, detail: str = "", status: int | None = None) -> None:
        self.outcomes[outcome] += 1
        if status is not None:
            self.statuses[status] += 1
        if detail and len(self.examples.setdefault(outcome, [])) < 5:
            self.examples[outcome].append(detail[:240])


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _body(kind: str, model: str, deadline: float, rng: random.Random) -> tuple[str, dict]:
    """The soak's request of this kind with a deadline, or JSON-schema chat."""
    if kind != "structured":
        return request_body(kind, rng, model, {"timeout": deadline})
    path, chat = request_body("chat", rng, model, {"timeout": deadline})
    return path, {**chat, "ignore_eos": False, "structured_outputs": {"json": SCHEMA}}


async def request(http: aiohttp.ClientSession, url: str, body: dict, tally: Tally,
                  headers: dict | None = None, disconnect_after: int | None = None) -> str:
    """Send one request and classify how it ended (tallied); returns the outcome."""
    limit = body.get("timeout", 30.0) + HANG_SLACK_S
    try:
        return await asyncio.wait_for(_request(http, url, body, tally, headers,
                                               disconnect_after), limit)
    except asyncio.TimeoutError:
        tally.note("hung", f"{url} {json.dumps(body)[:160]}")
        return "hung"


async def _request(http, url, body, tally, headers, disconnect_after) -> str:
    try:
        async with http.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                text = await r.text()
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    # a 5xx from the proxy in front (its replica died under the request)
                    # is a failure a client sees as one; anything else is a defect
                    outcome = "proxy" if r.status >= 500 else "unclear"
                    tally.note(outcome, f"HTTP {r.status}: {text}", r.status)
                    return outcome
                tally.note("error", f"HTTP {r.status}: {message}", r.status)
                return "error"
            if not body.get("stream"):
                usage = json.loads(await r.text()).get("usage") or {}
                tally.good_tokens.append((time.monotonic(), usage.get("completion_tokens", 0)))
                tally.note("ok", status=200)
                return "ok"
            events = []
            async for raw in r.content:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data: "):
                    events.append(line[6:])
                    if disconnect_after is not None and len(events) >= disconnect_after:
                        r.close()
                        tally.note("ok", status=200)
                        return "ok"
        if not events or events[-1] != "[DONE]":
            tally.note("cut", f"stream ended without [DONE] after {len(events)} events")
            return "cut"
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        if errors:
            tally.note("error", f"SSE error event {errors[0]}", errors[0].get("code"))
            return "error"
        usage = chunks[-1].get("usage") or {} if chunks else {}
        tally.good_tokens.append((time.monotonic(), usage.get("completion_tokens", 0)))
        tally.note("ok", status=200)
        return "ok"
    except (aiohttp.ClientError, ConnectionError) as exc:
        tally.note("cut", f"{type(exc).__name__}: {exc}")
        return "cut"


async def drive(base_url: str, model: str, concurrency: int, until: list[float],
                deadline: float, tally: Tally, seed: int = 0) -> None:
    """Clients sending back to back until time.monotonic() passes until[0] (which the
    caller may move)."""
    kinds = ["stream", "plain", "chat_stream", "n", "disconnect"] + \
        (["structured"] if model != "mock" else [])
    connector = aiohttp.TCPConnector(limit=concurrency + 16)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def worker(w: int) -> None:
            rng = random.Random(seed * 100_003 + w)
            while time.monotonic() < until[0]:
                kind = rng.choice(kinds)
                path, body = _body(kind, model, deadline, rng)
                await request(http, base_url + path, body, tally,
                              disconnect_after=3 if kind == "disconnect" else None)
        await asyncio.gather(*(worker(w) for w in range(concurrency)))


# ---- faults -------------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    at: float  # seconds into the run
    detail: str = ""
    healed_s: float | None = None  # from its end (the kill, the SIGCONT) to a whole membership
    duration_s: float = 0.0  # from its start to healed
    probe_failures: Counter = field(default_factory=Counter)  # why, until healed
    meanwhile: Counter = field(default_factory=Counter)  # coordinator stopped: answered, why not


def hostile_bodies(model: str) -> list[tuple[str, dict]]:
    """Requests that ask too much. The first two (a fan-out past
    max_sequences_per_request, 5,000 stop strings) must get a 400; the grammars are
    costly, not invalid: a real model may serve them (or refuse them clearly: 400 past
    the compile time limit, 408 past the deadline, 429 while abandoned compiles run),
    and the mock refuses every constraint."""
    big_schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 400} for i in range(40)},
        "required": [f"p{i}" for i in range(40)]}
    base = {"model": model, "max_tokens": 8, "timeout": 30}
    return [
        ("/v1/completions", {**base, "prompt": ["fan out"] * 64, "n": 16}),
        ("/v1/completions", {**base, "prompt": "stop", "stop": [f"s{i}" for i in range(5000)]}),
        ("/v1/completions", {**base, "prompt": "regex", "structured_outputs": {
            "regex": "[a-z]{1,5000}@[a-z]{1,5000}\\.(com|org){1,300}"}}),
        ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "json"}],
                                  "structured_outputs": {"json": big_schema}}),
    ]


async def whole(http: aiohttp.ClientSession, base_url: str, model: str, timeout: float
                ) -> str | None:
    """None when every engine answers a probe pinned to it, PROBES_IN_A_ROW times
    each; else why not (the first failure)."""
    body = {"model": model, "prompt": "probe", "max_tokens": 1, "timeout": timeout}
    for rank in range(DATA_PARALLEL):
        for _ in range(PROBES_IN_A_ROW):
            try:
                async with http.post(base_url + "/v1/completions", json=body,
                                     headers={"x-data-parallel-rank": str(rank)},
                                     timeout=aiohttp.ClientTimeout(total=timeout + 5)) as r:
                    text = await r.text()
                    if r.status != 200:
                        return f"rank {rank}: HTTP {r.status} {text[:100]}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                return f"rank {rank}: {type(exc).__name__}"
    return None


async def wait_whole(base_url: str, model: str, probe_timeout: float,
                     limit: float = 90.0) -> tuple[float | None, Counter]:
    """(seconds until the membership is whole, None if not within `limit`; why the
    probes failed until then, counted)."""
    started, why = time.monotonic(), Counter()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - started < limit:
            failure = await whole(http, base_url, model, probe_timeout)
            if failure is None:
                return time.monotonic() - started, why
            why[failure.split(" (", 1)[0][:90]] += 1
            await asyncio.sleep(0.5)
    return None, why


async def answered_meanwhile(base_url: str, model: str, seconds: float,
                             meanwhile: Counter) -> None:
    """For `seconds`, a round a second of what must not wait on the coordinator: a
    completion (200), GET /v1/models (200), a model nobody serves (404), each within
    MEANWHILE_ANSWER_S; counts "answered" and each failure."""
    probes = [("POST", "/v1/completions", {"model": model, "prompt": "meanwhile",
                                           "max_tokens": 1, "timeout": MEANWHILE_ANSWER_S}, 200),
              ("GET", "/v1/models", None, 200),
              ("POST", "/v1/completions", {"model": "nobody-serves-this", "prompt": "x",
                                           "max_tokens": 1}, 404)]
    end = time.monotonic() + seconds
    bound = aiohttp.ClientTimeout(total=MEANWHILE_ANSWER_S)
    async with aiohttp.ClientSession(timeout=bound) as http:
        while time.monotonic() < end:
            started = time.monotonic()
            for method, path, body, want in probes:
                try:
                    async with http.request(method, base_url + path, json=body) as r:
                        text = (await r.read()).decode(errors="replace")
                        # a failure names its error (the first of its kind is what the
                        # report shows: why a probe was not answered)
                        meanwhile["answered" if r.status == want else
                                  f"{method} {path}: HTTP {r.status} {text[:160]}"] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                    meanwhile[f"{method} {path}: {type(exc).__name__}"] += 1
            await asyncio.sleep(max(0.0, min(1.0 - (time.monotonic() - started),
                                             end - time.monotonic())))


async def inject(kind: str, root: int, base_url: str, model: str, rng: random.Random,
                 hostile: Tally, stop_s: tuple[float, float] = (3.0, 15.0),
                 meanwhile: Counter | None = None) -> str:
    """Apply one fault; returns what was done (the fault is over when this returns).
    meanwhile: where a coordinator's SIGSTOP counts the probes answered during it."""
    if kind == "stop_coordinator":
        pids = replica_pids(root, "coordinator")
        if not pids:
            return "no such replica running"
        os.kill(pids[0], signal.SIGSTOP)
        try:
            await answered_meanwhile(base_url, model, COORDINATOR_STOP_S,
                                     Counter() if meanwhile is None else meanwhile)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        return f"SIGSTOP {pids[0]} for {COORDINATOR_STOP_S:.1f}s"
    if kind.startswith("kill_") or kind.startswith("stop_"):
        pids = replica_pids(root, kind.split("_", 1)[1])
        if not pids:
            return "no such replica running"
        pid = rng.choice(pids)
        if kind.startswith("kill_"):
            os.kill(pid, signal.SIGKILL)
            return f"SIGKILL {pid}"
        pause = rng.uniform(*stop_s)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(pause)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {pid} for {pause:.1f}s"
    async with aiohttp.ClientSession() as http:
        outcomes = await asyncio.gather(*(request(http, base_url + path, body, hostile)
                                          for path, body in hostile_bodies(model)))
    refused = outcomes[:MUST_REFUSE]
    if any(o != "error" for o in refused):
        hostile.note("served", f"fan-out / stop strings answered {refused}")
    return "hostile: " + ", ".join(outcomes)


# ---- the run --------------------------------------------------------------------------------
@dataclass
class Report:
    model: str
    seconds: float
    baseline_s: float
    tally: Tally
    hostile: Tally
    faults: list[Fault]
    end_load: dict[str, float]
    t0: float  # time.monotonic() at the start of the load

    def goodput(self, windows: list[tuple[float, float]]) -> float:
        """Completion tokens per second of the requests that ended well in the windows."""
        span = sum(b - a for a, b in windows)
        tokens = sum(n for t, n in self.tally.good_tokens
                     if any(a <= t - self.t0 <= b for a, b in windows))
        return tokens / span if span else float("nan")

    def check(self) -> list[str]:
        bad = []
        for tally, name in ((self.tally, "load"), (self.hostile, "hostile")):
            if tally.outcomes["hung"]:
                bad.append(f"{tally.outcomes['hung']} {name} requests hung: "
                           f"{tally.examples.get('hung')}")
            if tally.outcomes["unclear"]:
                bad.append(f"{name}: {tally.outcomes['unclear']} errors without an OpenAI "
                           f"error body: {tally.examples.get('unclear')}")
        unhealed = [f"{f.kind} at {f.at:.0f}s ({f.detail}): "
                    f"{'never' if f.healed_s is None else f'{f.healed_s:.1f}s'}"
                    for f in self.faults if f.healed_s is None or f.healed_s > HEAL_LIMIT_S]
        if unhealed:
            bad.append(f"membership not whole within {HEAL_LIMIT_S:g}s: {unhealed}")
        if self.end_load != {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}:
            bad.append(f"engines not idle after the run: {self.end_load}")
        unanswered = [f"at {f.at:.0f}s: {dict(f.meanwhile)}" for f in self.faults
                      if f.kind == "stop_coordinator" and not f.detail.startswith("no such")
                      and (not f.meanwhile["answered"] or len(f.meanwhile) > 1)]
        if unanswered:
            bad.append(f"not answered while the coordinator was stopped: {unanswered}")
        if self.hostile.outcomes["served"]:
            bad.append(f"hostile requests served: {self.hostile.examples.get('served')}")
        return bad

    def print(self) -> None:
        t = self.tally
        total = sum(t.outcomes.values())
        print(f"chaos ({self.model}): {total} requests in {self.seconds:.0f}s, "
              f"{len(self.faults)} faults")
        print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(t.outcomes.items())))
        print("  statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(t.statuses.items(),
                                                                       key=str)))
        for outcome, examples in sorted(t.examples.items()):
            if outcome != "ok":
                print(f"  e.g. {outcome}: {examples[:2]}")
        print("  hostile: " + ", ".join(f"{k} {v}" for k, v in sorted(
            self.hostile.statuses.items(), key=str)) + f" ({dict(self.hostile.outcomes)})")
        for f in self.faults:
            healed = "NOT healed" if f.healed_s is None else f"whole {f.healed_s:.1f}s after"
            print(f"  {f.at:6.0f}s {f.kind:<17} {healed}  ({f.detail})")
            for why, n in f.probe_failures.most_common(3):
                print(f"          probes failing: {n} x {why}")
            if f.meanwhile:
                print("          meanwhile: " + ", ".join(
                    f"{why} {n}" for why, n in f.meanwhile.most_common()))
        windows = [(f.at, f.at + f.duration_s) for f in self.faults
                   if f.kind != "hostile"]
        print(f"  goodput: fault-free {self.goodput([(0, self.baseline_s)]):.0f} tok/s; "
              f"during faults (fault to whole) {self.goodput(windows):.0f} tok/s; "
              f"whole chaos phase {self.goodput([(self.baseline_s, self.seconds)]):.0f} tok/s")
        print(f"  engines after the run: {self.end_load}")
        bad = self.check()
        print("  checks: " + ("all passed" if not bad else "FAILED: " + "; ".join(bad)))


def all_engines_load(base_url: str) -> dict[str, float] | None:
    """Running, waiting (summed) and the largest KV usage over the engines, from one
    /metrics scrape, or None when the scrape does not report every engine."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    load, engines = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}, set()
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                        "vllm:kv_cache_usage_perc"):
            continue
        engines.add(rest.split('engine="', 1)[1].split('"', 1)[0] if 'engine="' in rest else "")
        value = float(line.rsplit(" ", 1)[1])
        key = {"vllm:num_requests_running": "running",
               "vllm:num_requests_waiting": "waiting"}.get(name, "kv_usage")
        load[key] = max(load[key], value) if key == "kv_usage" else load[key] + value
    return load if len(engines) >= DATA_PARALLEL else None


def wait_idle(base_url: str, timeout: float) -> dict[str, float]:
    """The engines' load once three scrapes in a row report every engine idle (the
    requests of a killed ingress are aborted after the engines' client_timeout_s)."""
    deadline, calm, load = time.monotonic() + timeout, 0, None
    while time.monotonic() < deadline and calm < 3:
        load = all_engines_load(base_url)
        idle = load == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
        calm = calm + 1 if idle else 0
        time.sleep(1)
    return load or {"running": float("nan"), "waiting": float("nan"), "kv_usage": float("nan")}


async def _chaos(root: int, base_url: str, model: str, duration: float, concurrency: int,
                 baseline_s: float, gap_s: tuple[float, float], deadline: float,
                 faults: list[str] | None, stop_s: tuple[float, float], seed: int) -> Report:
    rng = random.Random(seed)
    tally, hostile = Tally(), Tally()
    t0 = time.monotonic()
    until = [t0 + duration]
    load = asyncio.ensure_future(drive(base_url, model, concurrency, until, deadline,
                                       tally, seed))
    done: list[Fault] = []
    probe_timeout = 10.0 if model == "mock" else 60.0
    await asyncio.sleep(baseline_s)
    plan = list(faults) if faults is not None else None
    while time.monotonic() - t0 < duration - 5 and (plan is None or plan):
        kind = plan.pop(0) if plan is not None else rng.choice(FAULTS)
        fault = Fault(kind, time.monotonic() - t0)
        fault.detail = await inject(kind, root, base_url, model, rng, hostile, stop_s,
                                    fault.meanwhile)
        ended = time.monotonic()
        fault.healed_s, fault.probe_failures = await wait_whole(base_url, model,
                                                                probe_timeout)
        fault.duration_s = time.monotonic() - t0 - fault.at
        done.append(fault)
        rest = rng.uniform(*gap_s) - (time.monotonic() - ended)
        await asyncio.sleep(max(0.0, min(rest, duration - (time.monotonic() - t0))))
    until[0] = min(until[0], time.monotonic())  # a fixed plan ends the load when done
    await load
    return Report(model, time.monotonic() - t0, baseline_s, tally, hostile, done, {}, t0)


def chaos_running(proc, base_url: str, model: str = "mock", duration: float = 600.0,
                  concurrency: int = 128, baseline_s: float = 60.0,
                  gap_s: tuple[float, float] = (20.0, 40.0), deadline: float | None = None,
                  faults: list[str] | None = None, stop_s: tuple[float, float] = (3.0, 15.0),
                  seed: int = 0) -> Report:
    """The chaos run against a running server (proc: the CLI's process). faults: a
    fixed sequence (the suite's; the load ends after the last), else drawn at random
    every gap_s until `duration`; stop_s: how long a SIGSTOP lasts."""
    deadline = deadline or (30.0 if model == "mock" else 120.0)
    report = asyncio.run(_chaos(proc.pid, base_url, model, duration, concurrency,
                                baseline_s, gap_s, deadline, faults, stop_s, seed))
    report.end_load = wait_idle(base_url, 120)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mock", help="mock, or default (SmolLM2-135M)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--baseline", type=float, default=60.0,
                        help="fault-free seconds first (the goodput baseline)")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=lambda v: v.split(","), default=None,
                        help="a fixed sequence, comma-separated, of " + ", ".join(FAULTS) +
                        " (the load ends after the last); default: at random")
    args = parser.parse_args()
    if args.faults and not set(args.faults) <= set(FAULTS):
        parser.error(f"unknown faults {sorted(set(args.faults) - set(FAULTS))}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
    proc = start_server(mock_server(args.port, args.model), args.port, log_dir / "server.log")
    try:
        report = chaos_running(proc, f"http://127.0.0.1:{args.port}", args.model,
                               args.duration, args.concurrency, args.baseline,
                               faults=args.faults, seed=args.seed)
    finally:
        stop_server(proc)
    report.print()
    print(f"  server log: {log_dir / 'server.log'}")
    return 1 if report.check() else 0


if __name__ == "__main__":
    sys.exit(main())
