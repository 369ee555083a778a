"""CI's image check (`make image-check`; .ci/run runs it after `make test`): the serving
image is built and tried on a machine without Docker.

1. podman and debootstrap, installed with apt-get when missing (needs root).
2. The base: a debootstrapped Debian bookworm (minbase, python3, python3-venv) laid out
   as Ray's images are: a user `ray` (uid 1000, group users) whose venv comes first on
   PATH. Imported with `podman import`; the root tarball and the image are cached,
   keyed by their inputs, so a rerun skips this.
3. `make image` with podman: `podman build --isolation chroot`, BASE_IMAGE that base and
   TORCH_REQUIREMENT the host venv's torch version; the host's pip sources (its pip
   config: local find-links / indexes, constraints, CA bundle) are mounted read-only into
   the RUN steps, and Ray is pinned to the host venv's (the chart's rayVersion).
4. `helm template` of the chart with its default values names only images that exist.
5. The image's root (`podman create` + `podman mount`: the image's layers under a
   throwaway writable layer, as `podman run` would give; `podman image mount` gives them
   read-only) with /proc, /sys, /dev (and /dev/shm), a tmpfs /tmp, the host's /etc/hosts
   and /etc/resolv.conf mounted in; `flotilla serve --model mock` runs there under
   chroot as the image's user, with its environment and workdir. `podman run` cannot be
   used on the CI machine: "crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted"
   (RLIMIT_NPROC with --ulimit nofile given, even at the current limits). The chroot
   shares the host's network, so the openai client (this venv's) asks it for a chat
   completion on 127.0.0.1.
6. SIGTERM; the server must exit 0 within its grace period, leave no process whose root
   is the image's, and every mount is undone (always, also on failure).

Prints each phase's seconds. Any failure prints the command and its output and exits 1.
`--cold` first removes what earlier runs left (the cache, the base images, the built
image), to measure a first run.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("FLOTILLA_IMAGE_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "flotilla-image-check")
SUITE = "bookworm"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ["python3", "python3-venv", "ca-certificates"]
BASE_REPO = "localhost/flotilla-ci-base"
RAY_UID, RAY_GID = 1000, 100  # Ray's images: ray (1000), group users (100)
VENV = "/home/ray/venv"
BASE_CHANGES = ["USER ray", "WORKDIR /home/ray", "ENV HOME=/home/ray", "ENV LANG=C.UTF-8",
                f"ENV PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                "/sbin:/bin"]
HEALTH_DEADLINE_S = 180.0
# disk the build needs where podman keeps its storage: the image's venv (~2.7 GiB) is
# written as the build container's changes, then committed as a blob and a layer (a
# build with ~9 GiB free failed there: "no space left on device")
BUILD_NEEDS_GIB = 12.0
STORAGE = Path("/var/lib/containers")
GRACE_S = 25.0  # flotilla serve's --shutdown-grace-s default
TOOLS = {"podman": "podman", "debootstrap": "debootstrap"}

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module below
from image_chroot import (  # noqa: E402
    CheckFailed, ImageRoot, cmdline, log, procs_under, run)

from engine.wire.ports import free_port  # noqa: E402 - below the ephemeral range


class Phases:
    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        log(f"{name} ...")
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.times.append((name, took))
            log(f"{name}: {took:.1f} s")

    def report(self, total: float) -> None:
        log("phases (s): " + ", ".join(f"{n} {t:.1f}" for n, t in self.times)
            + f"; total {total:.1f}")


# -- 1. tools ---------------------------------------------------------------------------

def ensure_tools() -> None:
    missing = [pkg for cmd, pkg in TOOLS.items() if not shutil.which(cmd)]
    for cmd in ("chroot", "mount", "umount", "tar", "make"):
        if not shutil.which(cmd):
            raise CheckFailed(f"{cmd} is not on PATH")
    if not missing:
        log("podman and debootstrap are installed")
        return
    if not shutil.which("apt-get"):
        raise CheckFailed(f"{' '.join(missing)} missing and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], env=env)
    log("installed " + " ".join(missing) + ": "
        + run(["podman", "--version"]).stdout.strip())


# -- 2. the base image ------------------------------------------------------------------

def base_key() -> str:
    inputs = json.dumps([SUITE, MIRROR, PACKAGES, RAY_UID, RAY_GID, VENV, BASE_CHANGES,
                         "rootfs-v1"])
    return hashlib.sha256(inputs.encode()).hexdigest()[:16]


def image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name]).returncode == 0


def make_rootfs(tarball: Path) -> None:
    """debootstrap, then Ray's layout (user ray, a venv of its own first on PATH)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
    root = work / "root"
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
             str(root), MIRROR])
        run(["chroot", str(root), "useradd", "--create-home", "--uid", str(RAY_UID),
             "--gid", str(RAY_GID), "--shell", "/bin/bash", "ray"])
        run(["chroot", f"--userspec={RAY_UID}:{RAY_GID}", str(root), "/usr/bin/env", "-i",
             "HOME=/home/ray", "PATH=/usr/bin:/bin", "python3", "-m", "venv", VENV])
        run(["chroot", str(root), "apt-get", "clean"])
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        (root / "var/lib/apt/lists/partial").mkdir(parents=True)
        partial = tarball.with_suffix(".partial")
        run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."])
        partial.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def base_image() -> str:
    key = base_key()
    tag = f"{BASE_REPO}:{key}"
    if image_exists(tag):
        log(f"base {tag}: cached image")
        return tag
    tarball = CACHE / f"base-{SUITE}-{key}.tar"
    if tarball.exists():
        log(f"base root filesystem: cached {tarball}")
    else:
        make_rootfs(tarball)
    changes = [arg for c in BASE_CHANGES for arg in ("--change", c)]
    run(["podman", "import", "--quiet", *changes, str(tarball), tag])
    log(f"base {tag}: imported ({tarball.stat().st_size / 2**20:.0f} MiB root)")
    return tag


# -- 3. the build -----------------------------------------------------------------------

def host_pip_config() -> dict[str, str]:
    """The host pip's settings (config files and PIP_* variables) that pick sources."""
    out = run([sys.executable, "-m", "pip", "config", "list"]).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():  # e.g. global.find-links='/opt/wheels', :env:.cert='...'
        m = re.match(r"^(?:global|install|:env:)\.([\w-]+)='(.*)'$", line)
        if m and m.group(1) in ("find-links", "index-url", "extra-index-url", "constraint",
                                "cert"):
            found[m.group(1)] = m.group(2)
    return found


def local_path(source: str) -> Path | None:
    if source.startswith("file://"):
        source = source[len("file://"):]
    return Path(source) if source.startswith("/") else None


def build_flags(base: str, pip_dir: Path) -> list[str]:
    """podman build's flags: the base, torch, and the host's pip sources for RUN steps
    (an /etc/xdg/pip/pip.conf of their own; local directories mounted read-only)."""
    import ray
    import torch
    torch_version = torch.__version__.split("+")[0]
    config = host_pip_config()
    volumes: set[Path] = set()
    lines = ["[global]"]
    for name in ("find-links", "index-url", "extra-index-url"):
        if name in config:
            lines.append(f"{name} = {config[name]}")
            for source in config[name].split():
                path = local_path(source)
                if path is not None and path.exists():
                    # a local index's pages link to files beside it (../../files/...)
                    volumes.add(path.parent if name.endswith("index-url") or path.is_file()
                                else path)
    # Ray as in the host venv (the chart's rayVersion), plus the host's own constraints
    constraints = [f"ray=={ray.__version__}"]
    for source in config.get("constraint", "").split():
        path = local_path(source)
        if path is not None and path.is_file():
            constraints.append(path.read_text())
    (pip_dir / "constraints.txt").write_text("\n".join(constraints) + "\n")
    lines.append("constraint = /etc/xdg/pip/constraints.txt")
    if "cert" in config and Path(config["cert"]).is_file():
        shutil.copy(config["cert"], pip_dir / "ca.crt")
        lines.append("cert = /etc/xdg/pip/ca.crt")
    (pip_dir / "pip.conf").write_text("\n".join(lines) + "\n")
    pip_dir.chmod(0o755)
    for f in pip_dir.iterdir():
        f.chmod(0o644)
    log("pip in the build: " + "; ".join(lines[1:]) + f"; constraints: ray=={ray.__version__}")
    flags = ["--isolation", "chroot", "--build-arg", f"BASE_IMAGE={base}",
             "--build-arg", f"TORCH_REQUIREMENT=torch=={torch_version}",
             "--volume", f"{pip_dir}:/etc/xdg/pip:ro"]
    for path in sorted(volumes):
        flags += ["--volume", f"{path}:{path}:ro"]
    return flags


def built_tag() -> str:
    """The tag `make image` builds (the Makefile's IMAGE:VERSION)."""
    out = run(["make", "-s", "--no-print-directory", "-C", str(REPO),
               "--eval=_image_tag: ; @echo $(IMAGE):$(VERSION)", "_image_tag"]).stdout
    return out.strip()


def build(base: str) -> str:
    pip_dir = CACHE / "pip"  # a fixed path: podman's layer cache keys on the flags
    shutil.rmtree(pip_dir, ignore_errors=True)
    pip_dir.mkdir()
    try:
        flags = build_flags(base, pip_dir)
        cmd = ["make", "--no-print-directory", "-C", str(REPO), "image", "CONTAINER=podman",
               f"IMAGE_FLAGS={shlex.join(flags)}"]
        log(shlex.join(cmd))
        build_log = CACHE / "build.log"
        with open(build_log, "w") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise CheckFailed(f"make image exited {code}; its last lines "
                              f"({build_log}):\n{build_log.read_text()[-6000:]}")
    finally:
        shutil.rmtree(pip_dir, ignore_errors=True)
    tag = built_tag()
    if not image_exists(tag):
        raise CheckFailed(f"make image succeeded but podman has no {tag}")
    size = run(["podman", "image", "inspect", "--format", "{{.Size}}", tag]).stdout.strip()
    log(f"built {tag} ({int(size) / 2**30:.2f} GiB)")
    return tag


# -- 4. the chart's default image -------------------------------------------------------

def chart_images_exist() -> None:
    sys.path.insert(0, str(REPO))
    import yaml
    from tests.helm_tool import CHART, fetch_helm
    helm = fetch_helm(REPO / ".pytest_cache" / "d" / "flotilla-tools")  # the suite's copy
    with tempfile.TemporaryDirectory() as home:
        out = run([str(helm), "template", "rel", str(CHART)],
                  env={"HOME": home, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}).stdout
    images = sorted(set(re.findall(r"^\s*image:\s*(\S+)\s*$", out, re.M)))
    docs = [d for d in yaml.safe_load_all(out) if d]
    if not images or not docs:
        raise CheckFailed(f"helm template names no image:\n{out[:2000]}")
    absent = [i for i in images if not image_exists(i)]
    if absent:
        raise CheckFailed(f"helm template (default values) names {absent}, not built")
    log(f"helm template (default values) names {images}: built")


# -- 5./6. the image's root under chroot ------------------------------------------------

def serve_and_ask(image_root: ImageRoot, phases: Phases, log_path: Path) -> None:
    from openai import OpenAI
    userspec, env, workdir = image_root.user_env()
    port = free_port("127.0.0.1")
    cmd = ["chroot", f"--userspec={userspec}", image_root.root, "/usr/bin/env", "-i",
           f"--chdir={workdir}", *env, "flotilla", "serve", "--model", "mock",
           "--port", str(port)]
    log(shlex.join(cmd) + f"  > {log_path}")
    out = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    out.close()

    def evidence() -> str:
        return f"\n--- {log_path} (tail) ---\n{log_path.read_text(errors='replace')[-5000:]}"

    try:
        with phases("serve: start to /health 200"):
            deadline = time.monotonic() + HEALTH_DEADLINE_S
            while True:
                if proc.poll() is not None:
                    raise CheckFailed(f"flotilla serve exited {proc.returncode} before "
                                      f"/health answered" + evidence())
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                                timeout=5) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise CheckFailed(f"/health not 200 within {HEALTH_DEADLINE_S:.0f} s"
                                      + evidence())
                time.sleep(0.5)
        with phases("openai client: chat completion"):
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="image-check",
                            timeout=60, max_retries=0)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(
                model=model, max_tokens=16,
                messages=[{"role": "user", "content": "Name the three primary colors."}])
            text = reply.choices[0].message.content or ""
            if not text.strip():
                raise CheckFailed(f"empty answer: {reply!r}")
            log(f"model {model!r} answered {text!r} ({reply.usage.completion_tokens} tokens,"
                f" finish_reason {reply.choices[0].finish_reason})")
        with phases("stop: SIGTERM to exit"):
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=GRACE_S + 20)
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"flotilla serve still running {GRACE_S + 20:.0f} s after "
                                  "SIGTERM" + evidence()) from None
            if code != 0:
                raise CheckFailed(f"flotilla serve exited {code} on SIGTERM" + evidence())
            deadline = time.monotonic() + 10
            while (left := procs_under(image_root.root)) and time.monotonic() < deadline:
                time.sleep(0.5)
            if left:
                raise CheckFailed("processes left in the image's root after the server "
                                  "exited: " + "; ".join(f"{p} {cmdline(p)}" for p in left))
            log("exited 0, no process left in the image's root")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- main -------------------------------------------------------------------------------

def remove_earlier_runs() -> None:
    shutil.rmtree(CACHE, ignore_errors=True)
    if not shutil.which("podman"):
        return
    names = run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"]).stdout.split()
    ours = [n for n in names if n.startswith(BASE_REPO + ":")]
    with contextlib.suppress(CheckFailed):
        ours.append(built_tag())
    for name in ours:
        if image_exists(name):
            run(["podman", "rmi", "-f", name])
    # the build's cached intermediate layers, now untagged
    run(["podman", "image", "prune", "-f"])
    log(f"removed {CACHE} and images {ours}")


def cannot_run_here() -> str | None:
    """Why this machine cannot run the check (not root, too little free disk), or None."""
    if os.geteuid() != 0:
        return (f"not root (euid {os.geteuid()}): debootstrap, podman's storage, mount and "
                "chroot need it")
    probe = STORAGE if STORAGE.exists() else STORAGE.parent
    free = shutil.disk_usage(probe).free / 2**30
    if free >= BUILD_NEEDS_GIB:
        return None
    return (f"{free:.1f} GiB free on the disk of {probe}; the build needs about "
            f"{BUILD_NEEDS_GIB:.0f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true",
                        help="first remove the cache, base images and built image")
    args = parser.parse_args()

    def _stopped(signum, _frame):  # CI's timeout: unmount and stop the server first
        raise CheckFailed(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, _stopped)
    phases = Phases()
    start = time.monotonic()
    reason = cannot_run_here()
    if reason is not None:  # the machine's limit, not the image's: say so, with df
        df = subprocess.run(["df", "-h", str(STORAGE.parent), "/tmp"],
                            capture_output=True, text=True).stdout
        log(f"NOT RUN on this machine: {reason}\n{df}")
        return 0
    try:
        with phases("tools"):
            ensure_tools()
        if args.cold:
            with phases("remove earlier runs"):
                remove_earlier_runs()
        CACHE.mkdir(parents=True, exist_ok=True)
        with phases("base image (debootstrap, podman import)"):
            base = base_image()
        with phases("build (make image, podman build --isolation chroot)"):
            tag = build(base)
        with phases("helm template defaults"):
            chart_images_exist()
        with phases("mount image root"):
            root = ImageRoot(tag)
            root.__enter__()
        try:
            serve_and_ask(root, phases, CACHE / "serve.log")
        finally:
            with phases("unmount"):
                root.__exit__(None, None, None)
    except CheckFailed as exc:
        if isinstance(exc.__context__, CheckFailed):  # a failure, then its cleanup's
            log(f"FAILED: {exc.__context__}")
        log(f"FAILED: {exc}")
        phases.report(time.monotonic() - start)
        return 1
    phases.report(time.monotonic() - start)
    log("OK: the image built, and served from its root")
    return 0


if __name__ == "__main__":
    sys.exit(main())
