"""HAProxy started through the leash (deployments/serve/haproxy_leash.py) dies with the process
that started it, as Serve's HAProxyManager actor does; without it, it outlived a SIGKILL
of the server and kept its port."""
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.serve.haproxy_leash import leashed_haproxy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _orphan_after_parent_killed(binary: str) -> int:
    """Start `binary 60` from a parent process, kill -9 the parent; the child's pid."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"p = subprocess.Popen([{binary!r}, '60'])\nprint(p.pid, flush=True)\n"
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10  # the leash execs the real binary in its place
    while b"sleep" not in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    parent.kill()
    parent.wait()
    return child


def test_the_leashed_binary_dies_with_its_parent_and_a_bare_one_does_not(
        tmp_path, monkeypatch):
    sleep = shutil.which("sleep")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", sleep)  # stands in for HAProxy
    script = leashed_haproxy(str(tmp_path))["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert Path(script).parent == tmp_path
    leashed = _orphan_after_parent_killed(script)
    bare = _orphan_after_parent_killed(sleep)
    try:
        deadline = time.monotonic() + 10
        while _alive(leashed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(leashed)
        assert _alive(bare)  # what HAProxy did before: it outlives its parent
    finally:
        subprocess.run(["kill", "-9", str(leashed), str(bare)], capture_output=True)
