"""The local Ray that `flotilla serve` starts when it joins no cluster, in a session of
its own.

`ray.init()` starts Ray's processes (GCS, raylet, workers, the Serve replicas) in the
CLI's own process group. A stop signal sent to the whole group (`kill -- -PGID`, a
terminal's Ctrl-C, `make run` stopped as a group) then reached Ray too: the replicas died
under the CLI's graceful shutdown, serve.shutdown() waited 30 s on a controller that was
gone and ray.shutdown() another 60 s on a GCS that was gone (61 s in all, past
Kubernetes' 30 s grace). Started with `ray start --head --block` in a new session, Ray
hears only the CLI, which drains Serve first and stops Ray last, within its grace period.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.wire.ports import free_ports

START_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def use_own_auth_token() -> None:
    """Token authentication for the Ray about to start, with a token of its own (not
    ~/.ray's), unless the user chose a mode. Ray reads these once, when it is imported:
    in a process that imported it already (a test calling the CLI in-process) they are
    left alone, or this process and the Ray it starts would disagree on the mode."""
    if "ray" in sys.modules:
        return
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token":
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


class LocalRayHead:
    """One single-node Ray started for this CLI: its own temp dir (every Ray process
    names it, so none is left behind), its own auth token, free ports."""

    def __init__(self, include_dashboard: bool) -> None:
        self.include_dashboard = include_dashboard
        # short: Ray's socket paths live under it (see deployments.cli.haproxy_env)
        self.temp_dir = tempfile.mkdtemp(prefix="fr-", dir=os.environ.get("RAY_TMPDIR")
                                         or "/tmp")
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> str:
        """Start Ray; returns the address for ray.init. The CLI's environment (Serve's
        settings, HAProxy's files) is set before this, so Ray's processes inherit it."""
        gcs, node_manager, object_manager, client, agent_http, agent_grpc, runtime_env, \
            metrics = free_ports("127.0.0.1", 8)
        ray_cli = str(Path(sys.executable).parent / "ray")
        log = open(Path(self.temp_dir) / "ray-start.log", "wb")
        self.proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", "--disable-usage-stats",
             f"--temp-dir={self.temp_dir}", "--node-ip-address=127.0.0.1",
             f"--port={gcs}", f"--node-manager-port={node_manager}",
             f"--object-manager-port={object_manager}",
             f"--ray-client-server-port={client}",
             f"--dashboard-agent-listen-port={agent_http}",
             f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
             f"--include-dashboard={'true' if self.include_dashboard else 'false'}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_stop_with_parent)
        log.close()
        self.address = f"127.0.0.1:{gcs}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts("127.0.0.1", gcs):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (Path(self.temp_dir) / "ray-start.log").read_text(errors="replace")
                self.stop(0)
                raise RuntimeError(f"the local Ray did not start:\n{tail[-2000:]}")
            time.sleep(0.2)
        return self.address

    def stop(self, timeout_s: float) -> None:
        """`ray start --block` stops its node on SIGTERM; past timeout_s, or for what it
        leaves, SIGKILL. Then the temp dir goes."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(max(0.0, timeout_s))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in pids_naming(self.temp_dir):  # workers in process groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _stop_with_parent() -> None:
    """In the `ray start` child: SIGTERM when the CLI dies, even by SIGKILL or the OOM
    killer, so that Ray, out of the CLI's process group, is never left running (Linux;
    elsewhere the CLI's own stop is the only one)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def pids_naming(marker: str) -> list[int]:
    """Processes whose command line names marker (a Ray temp dir), this one aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
