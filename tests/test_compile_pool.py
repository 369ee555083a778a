"""Grammar compiles that no request can hold hostage (issue 40, finding 6).

Before: compiles ran on a pool of two threads and xgrammar cannot interrupt one, so two
slow grammars (a 1 KB schema of bounded strings already takes seconds) held both
threads and every other constrained request waited behind them, then timed out too.
Compiles stand in for xgrammar here with work that blocks until released."""
import threading
import time

import pytest

from engine import SamplingParams
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.structured.compile_pool import CompilePool
from engine.structured.params import StructuredOutputsParams as S


def _wait(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_compile_past_the_timeout_frees_its_slot_and_fails_its_requests():
    pool = CompilePool(slots=2, timeout_s=0.2, max_abandoned=2)
    release = threading.Event()
    slow = [pool.submit(k, lambda: release.wait(30)) for k in (b"a", b"b")]
    quick = pool.submit(b"c", lambda: "compiled")
    time.sleep(0.1)
    pool.reap()
    assert not quick.done()  # both slots taken
    assert _wait(lambda: (pool.reap(), quick.done())[1])  # abandoned, so "c" ran
    assert quick.result() == "compiled"
    for future in slow:
        with pytest.raises(InvalidRequestError, match="structured_outputs_compile_timeout_s"):
            future.result()
    assert pool.abandoned == 2
    refused = pool.submit(b"d", lambda: "never run")
    with pytest.raises(EngineOverloadedError, match="still compiling"):
        refused.result()
    release.set()  # the abandoned threads end: they no longer count
    assert _wait(lambda: pool.abandoned == 0)
    assert pool.submit(b"d", lambda: "now").result(timeout=5) == "now"


def test_one_compile_per_constraint_and_unwanted_queued_ones_are_dropped():
    pool = CompilePool(slots=1, timeout_s=30, max_abandoned=4)
    release, runs = threading.Event(), []

    def work(tag):
        runs.append(tag)
        release.wait(30)
        return tag
    first = pool.submit(b"x", lambda: work("x"))
    again = pool.submit(b"x", lambda: work("x again"))
    queued = pool.submit(b"y", lambda: work("y"))
    assert again is first
    pool.release(b"y")  # its only request went away while it waited for a slot
    assert queued.cancelled()
    release.set()
    assert first.result(timeout=5) == "x"
    pool.reap()
    assert runs == ["x"] and not pool.running()


def test_the_engine_serves_constrained_requests_past_two_stuck_compiles(tiny_llama,
                                                                      monkeypatch):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.structured.grammar import GrammarCompiler
    from engine.core_messages import EngineCoreRequest
    release = threading.Event()
    real_compile = GrammarCompiler.compile

    def compile_(self, spec):
        if spec.regex is not None and spec.regex.startswith("stuck"):
            release.wait(60)
        return real_compile(self, spec)
    monkeypatch.setattr(GrammarCompiler, "compile", compile_)
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32",
                                   structured_outputs_compile_timeout_s=1.0))
    try:
        for i in range(2):
            core.add_request(EngineCoreRequest(f"stuck{i}", [1, 2, 3], SamplingParams(
                max_tokens=4, structured_outputs=S(regex=f"stuck{i}"))))
        core.add_request(EngineCoreRequest("fine", [1, 2, 3], SamplingParams(
            max_tokens=4, structured_outputs=S(choice=["fine"]))))
        outputs = {}
        for _ in range(2000):
            for out in core.step():
                outputs.setdefault(out.request_id, []).append(out)
            if not core.has_unfinished_requests():
                break
        assert outputs["fine"][-1].finish_reason == "stop"
        for i in range(2):
            last = outputs[f"stuck{i}"][-1]
            assert last.finish_reason == "error" and "did not compile within 1 s" in last.error
        assert core.kv.num_free_blocks == core.num_blocks and not core.requests
    finally:
        release.set()
        core.shutdown()
