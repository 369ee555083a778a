"""Engine gauges from every ingress replica while the ingress autoscales under load
(issue 41, item 1): bench/scrape.py's run as a test. `flotilla serve --model mock`, DP=2,
the ingress autoscaled from one replica; 256 live streams scale it out; 20 scrapes
through the load balancer then each show both engines' gauges, counting the live
streams. Before: the replicas made by the scale-out reported no engine gauge (no client
until their first request; then the engines, heartbeating only clients that got no
outputs from anyone, went silent to them and were declared dead), and a scrape that
reached the replica holding the streams queued behind its 256-request cap for 15 s+."""
import asyncio

from bench.scrape import scale_out_and_scrape, scaled_server
from bench.serve import start_server, stop_server
from tests.e2e.ray_head import free_ports

SCRAPES = 20


def test_every_scrape_after_a_scale_out_shows_every_engines_gauges(tmp_path):
    (port,) = free_ports(1)
    proc = start_server(scaled_server(port), port, tmp_path / "server.log")
    try:
        report = asyncio.run(scale_out_and_scrape(
            f"http://127.0.0.1:{port}", proc.pid, streams=256, scrapes=SCRAPES,
            stacks=tmp_path / "server.stacks"))
    finally:
        stop_server(proc)
    report.print()
    assert len(report.scrapes) == SCRAPES
    assert report.check() == []
