"""The suite's soak and chaos run, on one `flotilla serve --model mock` (DP=2, two
ingress replicas), in this order:

- bench/soak.py for 60 seconds at concurrency 256: no errors, every process's RSS
  within 5 % of its idle value, sockets and threads back at their idle values, no
  request running or waiting and no KV block held once the load ends;
- then bench/chaos.py's short version at concurrency 32: each fault the issue names
  once (kill -9 of an ingress replica, the coordinator and an engine replica, SIGSTOP
  of an ingress, an engine and the coordinator, hostile requests): no request hung
  past its deadline, every probe answered while the coordinator was stopped,
  no answer but an OpenAI error body (or the proxy's 5xx for a request whose replica
  died), the membership whole within 30 s of each fault, the engines idle after.
"""
import pytest

from bench.chaos import chaos_running
from bench.serve import start_server, stop_server
from bench.soak import mock_server, soak_running
from tests.e2e.ray_head import free_ports

# the ingress killed first: its orphaned streams are aborted (client_timeout_s) while
# the rest runs; the engine last, as its replacement takes longest to rejoin. The
# coordinator's SIGSTOP follows the ingress's kill: its replacement may start while the
# coordinator is silent (it used to serve 503s then, knowing no engine)
CHAOS_FAULTS = ["kill_ingress", "hostile", "stop_engine", "stop_ingress", "stop_coordinator",
                "kill_coordinator", "kill_engine"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    (port,) = free_ports(1)
    proc = start_server(mock_server(port), port,
                        tmp_path_factory.mktemp("soak") / "server.log")
    yield proc, f"http://127.0.0.1:{port}"
    stop_server(proc)


def test_a_minute_at_concurrency_256_loses_and_leaks_nothing(server):
    # the warm-up at full concurrency brings each pool and buffer to its size before the
    # idle sample (5 s left the ingress's RSS 3-5 % short of it); a short quiet spell
    # keeps the module near two and a half minutes
    report = soak_running(*server, duration=60, concurrency=256, warmup=15, quiet_s=4)
    report.print()
    assert report.requests > 500 and set(report.by_kind) == {
        "stream", "plain", "chat_stream", "chat", "n", "stop", "disconnect", "timeout"}
    assert report.check() == []


def test_chaos_no_request_hangs_nothing_leaks_the_membership_heals(server):
    report = chaos_running(*server, duration=240, concurrency=32, baseline_s=5,
                           gap_s=(2, 2), stop_s=(3, 4), faults=list(CHAOS_FAULTS))
    report.print()
    assert [f.kind for f in report.faults] == CHAOS_FAULTS
    assert all(not f.detail.startswith("no such") for f in report.faults)
    assert report.tally.outcomes["ok"] > 200
    assert report.hostile.statuses[400] >= 3  # fan-out, stop strings, a regex on the mock
    assert report.check() == []


def test_the_leak_check_names_new_threads_and_spares_self_sizing_pools():
    from bench.soak import Proc, Report
    idle = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    start = {7: Proc("ray::ServeController", 100, 2, 1, ("event_engine", "main"))}
    pool = {7: Proc("ray::ServeController", 100, 3, 1, ("event_engine", "event_engine", "main"))}
    leak = {7: Proc("ray::ServeController", 100, 3, 1, ("event_engine", "main", "worker"))}
    assert Report(1, 1, {}, [], 0, 0, 60, start, pool, idle, idle, 0, {}).check() == []
    assert Report(1, 1, {}, [], 0, 0, 60, start, leak, idle, idle, 0, {}).check() == [
        "threads of 7 ray::ServeController: new {'worker': 1}"]


def test_the_chaos_check_wants_every_probe_answered_while_the_coordinator_is_stopped():
    from collections import Counter

    from bench.chaos import Fault, Report, Tally
    idle = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}

    def report(meanwhile: Counter) -> Report:
        fault = Fault("stop_coordinator", 10.0, "SIGSTOP 7 for 20.0s", 1.0, 25.0, Counter(),
                      meanwhile)
        return Report("mock", 60, 5, Tally(), Tally(), [fault], idle, 0.0)
    assert report(Counter(answered=60)).check() == []
    assert "not answered while the coordinator was stopped" in report(
        Counter({"answered": 57, "GET /v1/models: TimeoutError": 3})).check()[0]
    assert report(Counter()).check()  # nothing answered at all
