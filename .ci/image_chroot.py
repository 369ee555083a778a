"""The pieces of .ci/image_check.py that run the built image's root: its errors, log and
command runner, and ImageRoot (a throwaway container's root, `podman create` + `podman
mount`, with /proc, /sys, /dev, a tmpfs /tmp and the host's name files mounted into it,
every mount undone and every process in it killed on leaving)."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
from pathlib import Path


class CheckFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"[image-check] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure raise with the command and its output's tail."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    result = subprocess.run(cmd, **kw)
    if result.returncode != 0:
        out = ((result.stdout or "") + (result.stderr or ""))[-4000:]
        raise CheckFailed(f"{shlex.join(cmd)} exited {result.returncode}:\n{out}")
    return result


def procs_under(root: str) -> list[int]:
    """Processes whose root directory is the image's root (or below it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{entry}/root")
            if target == root or target.startswith(root + "/"):
                found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    return "?"


def mounts_under(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == root or p.startswith(root + "/")]


class ImageRoot:
    """A throwaway container's root (podman create + mount) with the system mounts."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.container = f"flotilla-image-check-{os.getpid()}"
        self.root = ""
        self.mounted: list[tuple[str, bool]] = []  # (path, recursive), in mount order

    def __enter__(self) -> "ImageRoot":
        try:
            run(["podman", "create", "--name", self.container, self.tag, "/bin/true"])
            self.root = os.path.realpath(run(["podman", "mount", self.container]).stdout.strip())
            self._mount(["-t", "proc", "proc"], "proc")
            self._mount(["--rbind", "/sys"], "sys", recursive=True)
            # recursive: with /dev/shm (Ray's object store) and /dev/pts
            self._mount(["--rbind", "/dev"], "dev", recursive=True)
            self._mount(["-t", "tmpfs", "-o", "mode=1777", "tmpfs"], "tmp")
            for name in ("etc/hosts", "etc/resolv.conf"):
                target = Path(self.root, name)
                if target.is_symlink():
                    target.unlink()
                target.touch()
                self._mount(["--bind", "/" + name], name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        log(f"image root {self.root}: {len(mounts_under(self.root))} mounts")
        return self

    def _mount(self, args: list[str], where: str, recursive: bool = False) -> None:
        path = os.path.join(self.root, where)
        if not os.path.isfile(path):
            os.makedirs(path, exist_ok=True)
        run(["mount", *args, path])
        self.mounted.append((path, recursive))
        if recursive:  # unmounting the copies must not reach the host's mounts
            run(["mount", "--make-rslave", path])

    def __exit__(self, *exc) -> None:
        errors = []
        if self.root:
            for pid in procs_under(self.root):  # nothing may keep a mount busy
                log(f"killing leftover pid {pid}: {cmdline(pid)}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for path, recursive in reversed(self.mounted):
            result = subprocess.run(["umount", *(["-R"] if recursive else []), path],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                errors.append(f"umount {path}: {result.stderr.strip()}")
        self.mounted.clear()
        for cmd in (["podman", "umount", self.container], ["podman", "rm", "-f", self.container]):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0 and "no such container" not in result.stderr:
                errors.append(f"{shlex.join(cmd)}: {result.stderr.strip()}")
        left = mounts_under(self.root) if self.root else []
        if left:
            errors.append(f"mounts left under {self.root}: {left}")
        if errors:
            raise CheckFailed("cleanup failed:\n" + "\n".join(errors))
        log("unmounted; container removed")

    def user_env(self) -> tuple[str, list[str], str]:
        """The image's user (uid:gid), environment and workdir, as podman run uses them."""
        (info,) = json.loads(run(["podman", "image", "inspect", self.tag]).stdout)
        config = info.get("Config") or {}
        user = config.get("User") or "root"
        name, _, group = user.partition(":")
        uid = gid = None
        for line in Path(self.root, "etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if fields[0] == name or fields[2] == name:
                uid, gid = fields[2], fields[3]
        if uid is None:
            raise CheckFailed(f"the image's user {user!r} is not in its /etc/passwd")
        gid = group or gid
        env = config.get("Env") or []
        if not any(e.startswith("HOME=") for e in env):
            env.append("HOME=/root" if uid == "0" else f"HOME=/home/{name}")
        return f"{uid}:{gid}", env, config.get("WorkingDir") or "/"
