"""Ports picked for a server to bind next stay out of the kernel's ephemeral range,
where any of Ray's sockets could take them first."""
from engine.wire import ports


def test_picked_ports_bind_and_lie_between_ray_workers_and_the_ephemeral_range():
    floor = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    picked = ports.free_ports("127.0.0.1", 20)
    assert len(set(picked)) == 20
    assert all(ports.LOWEST_PORT <= p < floor for p in picked)
    assert all(ports._binds("127.0.0.1", p) for p in picked)
    assert not set(picked) & set(ports.SERVE_REPLICA_PORTS)


def test_each_server_picks_its_own_serve_proxy_ports(tmp_path):
    """Serve's fallback proxy took 8500 (gRPC 9500) whatever the server: a second
    `flotilla serve` on the host (the image check's, beside the suite's) failed to
    start. Each server now picks them free, as HAProxy's stats and metrics ports."""
    from deployments.cli import haproxy_env
    env = haproxy_env(str(tmp_path))
    keys = ["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
            "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"]
    picked = [int(env[k]) for k in keys]
    assert len(set(picked)) == 4 and not {8500, 9500} & set(picked)
    assert all(ports._binds("127.0.0.1", p) for p in picked)


def test_without_a_readable_range_a_kernel_port_is_used(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    port = ports.free_port("127.0.0.1", avoid=frozenset({1}))
    assert ports._binds("127.0.0.1", port) and port != 1
