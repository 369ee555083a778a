"""TCP ports for a server to bind a moment later, picked where no other socket takes
them in between.

A port that the kernel hands out for a bind to port 0 is ephemeral: once the probe
socket closes, the kernel may hand the same port to any socket that binds to 0 or
connects out (Ray starts dozens) before our server binds it. CI saw HAProxy's metrics
frontend and Serve's HTTP proxy fail with "Address already in use" that way. Below the
ephemeral range only an explicit bind takes a port, so we pick there, above Ray's
default worker ports, outside the ports Serve gives its ingress replicas."""
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # Ray's workers take 10002-19999 by default (min/max_worker_port)
# Serve hands its ingress replicas HTTP ports from this range (its direct ingress,
# RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT; gRPC's 40000.. lies above the floor)
SERVE_REPLICA_PORTS = range(30000, 31001)
TRIES = 200


def _ephemeral_floor() -> int | None:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux: no range to stay out of that we can read


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str, avoid: frozenset[int] = frozenset()) -> int:
    """A TCP port on `host` that binds now, below the ephemeral range where one can
    (a kernel-chosen port otherwise), and not one of `avoid`."""
    floor = _ephemeral_floor()
    if floor is not None and floor - LOWEST_PORT >= 1000:
        rng = random.SystemRandom()
        for _ in range(TRIES):
            port = rng.randrange(LOWEST_PORT, floor)
            if port not in avoid and port not in SERVE_REPLICA_PORTS and _binds(host, port):
                return port
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports as free_port picks them."""
    ports: list[int] = []
    while len(ports) < count:
        ports.append(free_port(host, frozenset(ports)))
    return ports
