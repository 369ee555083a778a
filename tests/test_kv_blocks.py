"""KV blocks always return to the pool; request ids and aborts behave."""
import pytest

from engine import LLM, DuplicateRequestError, SamplingParams
from engine.outputs import OutputKind


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=64)


def _all_free(llm) -> bool:
    kv = llm.llm_engine.engine_core.kv
    return kv.num_free_blocks == kv.num_blocks and all(b.ref_cnt == 0 for b in kv.blocks)


def test_blocks_free_after_requests_finish(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 20, 33)]
    llm.generate([list(range(100, 100 + k)) for k in (7, 30, 50)], params, use_tqdm=False)
    assert _all_free(llm)


def test_blocks_free_after_abort_and_abort_is_idempotent(llm):
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"a{i}", list(range(500, 540)),
                           SamplingParams(max_tokens=100, ignore_eos=True), OutputKind.DELTA)
    engine.step()
    engine.step()
    engine.abort_request(["a0", "a1"])
    engine.abort_request(["a0", "a1", "never-existed"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort_request(["a2"])  # already finished: ignored
    assert _all_free(llm)


def test_duplicate_request_id_is_rejected_and_engine_keeps_running(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("dup", [1, 2, 3, 4], params)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", [5, 6, 7], params)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["dup"]
    assert len(finished[0].outputs[0].token_ids) == 4
    assert _all_free(llm)


def test_engine_core_rejects_duplicate_ids(llm):
    from engine.core_messages import EngineCoreRequest
    core = llm.llm_engine.engine_core
    req = EngineCoreRequest("x", [1, 2, 3], SamplingParams(max_tokens=2))
    core.add_request(req)
    with pytest.raises(DuplicateRequestError):
        core.add_request(req)
    core.abort_requests(["x"])
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", "abort")]
    assert _all_free(llm)
