"""Where `flotilla serve` takes its API and admin keys from, and when it warns.

A key given as `--api-key` sits in the command's argv (`ps` shows it to every user of
the host) and in the Serve config Ray stores and its dashboard shows. A key in
$FLOTILLA_API_KEY / $FLOTILLA_ADMIN_KEY, or read from `--api-key-file` /
`--admin-key-file` into those variables, reaches the ingress replicas through the
environment of the Ray this command starts (AppArgs.keys reads it there) and is
nowhere else. On a cluster Ray (RAY_ADDRESS) this command's environment does not reach
the replicas: set the variables there (the Helm chart's Secret does).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

KEY_ENV = {"api_key": "FLOTILLA_API_KEY", "admin_key": "FLOTILLA_ADMIN_KEY"}


def add_key_file_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--api-key-file", metavar="PATH",
                       help="read the API's bearer key from this file (its first line) "
                            "into $FLOTILLA_API_KEY, out of argv and the Serve config")
    group.add_argument("--admin-key-file", metavar="PATH",
                       help="the same for the control endpoints' key ($FLOTILLA_ADMIN_KEY)")


def load_key_files(args: argparse.Namespace, own_ray: bool) -> None:
    """Each given key file's first line into its variable; ValueError when a file cannot
    be read or is empty, when its flag is also given, or on a cluster Ray, whose
    replicas would never see it."""
    for name, env in KEY_ENV.items():
        path = getattr(args, f"{name}_file", None)
        if path is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if getattr(args, name, None):
            raise ValueError(f"{flag} and {flag}-file are both given; give one")
        if not own_ray:
            raise ValueError(f"{flag}-file reaches only the Ray this command starts; with "
                             f"RAY_ADDRESS set ${env} in the replicas' environment")
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"{flag}-file {path}: {exc.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"{flag}-file {path} is empty")
        os.environ[env] = key


def open_to_the_network(host: str, api_key: str | None) -> bool:
    """Whether serving on `host` with this key (or $FLOTILLA_API_KEY) leaves the API open
    beyond this machine: a non-loopback address and no key."""
    if api_key or os.environ.get(KEY_ENV["api_key"]):
        return False
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable
        return True


__all__ = ["KEY_ENV", "add_key_file_flags", "load_key_files", "open_to_the_network"]
