"""scheduling_policy "priority": lower priority values run first, ties by arrival, and a
request that does not fit preempts running requests of a lower priority (recompute)."""
import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.outputs import OutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompt(k: int, length: int = 20) -> list[int]:
    return [100 + k * 37 + i for i in range(length)]


def _run(llm, requests: list[tuple[str, list[int], int]]) -> tuple[list[str], dict]:
    """Add (id, prompt, priority) requests, step to the end; finish order and tokens."""
    engine = llm.llm_engine
    for request_id, prompt, priority in requests:
        engine.add_request(request_id, prompt, GREEDY, OutputKind.FINAL_ONLY,
                           priority=priority)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    return order, tokens


def _all_free(llm) -> bool:
    kv = llm.llm_engine.engine_core.kv
    return kv.num_free_blocks == kv.num_blocks and all(b.ref_cnt == 0 for b in kv.blocks)


def test_waiting_requests_run_lowest_priority_value_first_ties_by_arrival(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, max_num_seqs=1,
              scheduling_policy="priority")
    order, _ = _run(llm, [("p5", _prompt(0), 5), ("p1a", _prompt(1), 1),
                          ("p3", _prompt(2), 3), ("p0", _prompt(3), 0),
                          ("p1b", _prompt(4), 1), ("neg", _prompt(5), -2)])
    assert order == ["neg", "p0", "p1a", "p1b", "p3", "p5"]
    assert llm.llm_engine.engine_core.scheduler.num_preemptions == 0
    assert _all_free(llm)


@pytest.mark.parametrize("limit", ["sequence slots", "kv blocks"])
def test_a_higher_priority_request_preempts_lower_priority_running_ones(tiny_llama, limit):
    """Two low-priority requests fill the engine (its sequence slots, or its KV pool);
    a high-priority one arriving later preempts one of them, finishes first, and the
    preempted one recomputes to the same greedy tokens it makes alone."""
    if limit == "sequence slots":
        options = dict(max_num_seqs=2, num_gpu_blocks_override=64)
    else:  # 12 blocks of 8: two 40-token prompts hold 10, a third does not fit
        options = dict(max_num_seqs=8, num_gpu_blocks_override=12)
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, scheduling_policy="priority",
              **options)
    engine = llm.llm_engine
    alone = {k: llm.generate([_prompt(k, 40)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
             for k in range(3)}
    for k in range(2):
        engine.add_request(f"low{k}", _prompt(k, 40), GREEDY, OutputKind.FINAL_ONLY,
                           priority=7)
    finished = {}
    for _ in range(3):  # both low requests are prefilled and decoding
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert not finished
    scheduler = engine.engine_core.scheduler
    assert [r.request_id for r in scheduler.running] == ["low0", "low1"]
    engine.add_request("high", _prompt(2, 40), GREEDY, OutputKind.FINAL_ONLY, priority=0)
    engine.step()
    assert scheduler.num_preemptions >= 1
    assert "high" in [r.request_id for r in scheduler.running]
    assert "low1" in [r.request_id for r in scheduler.waiting]  # the later low one gave way
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                finished[out.request_id] = out
    assert order.index("high") < order.index("low1")
    for k, request_id in ((0, "low0"), (1, "low1"), (2, "high")):
        assert finished[request_id].outputs[0].token_ids == alone[k], request_id
    assert _all_free(llm)


def test_equal_priorities_never_preempt_each_other_on_admission(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, max_num_seqs=1,
              scheduling_policy="priority")
    engine = llm.llm_engine
    engine.add_request("first", _prompt(0), GREEDY, OutputKind.FINAL_ONLY, priority=3)
    engine.step()
    order, _ = _run(llm, [("second", _prompt(1), 3), ("third", _prompt(2), 3)])
    assert order == ["first", "second", "third"]
    assert engine.engine_core.scheduler.num_preemptions == 0


def test_a_priority_under_fcfs_is_refused_and_the_engine_goes_on(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8)
    with pytest.raises(InvalidRequestError, match="scheduling_policy 'priority'"):
        llm.generate([_prompt(0)], GREEDY, use_tqdm=False, priority=[1])
    out = llm.generate([_prompt(0), _prompt(1)], GREEDY, use_tqdm=False, priority=[0, 0])
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]
    with pytest.raises(InvalidRequestError, match="priorities"):
        llm.generate([_prompt(0)], GREEDY, use_tqdm=False, priority=[0, 0])
    assert _all_free(llm)


def test_scheduling_policy_is_checked():
    from engine.config import EngineConfig
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
