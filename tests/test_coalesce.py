"""The encoder's merging of queued step outputs per client (engine/wire/coalesce.py)."""
from engine.core_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVEvents,
    SchedulerStats,
    UtilityOutput,
)
from engine.wire.coalesce import coalesce
from engine.wire.protocol import OUTPUTS

A, B = b"client-a", b"client-b"


def step(rid: str, token: int, at: float, running: int = 1, **kw) -> EngineCoreOutputs:
    return EngineCoreOutputs(0, [EngineCoreOutput(rid, [token])], timestamp=at,
                             scheduler_stats=SchedulerStats(num_running_reqs=running), **kw)


def tokens(msg: EngineCoreOutputs) -> list[tuple[str, list[int]]]:
    return [(o.request_id, o.new_token_ids) for o in msg.outputs]


def test_a_clients_queued_steps_go_out_as_one_message_in_order():
    items = [(A, OUTPUTS, step("r1", 1, 1.0, running=3)), (B, OUTPUTS, step("r2", 7, 1.1)),
             (A, OUTPUTS, step("r1", 2, 2.0, running=2)), (A, OUTPUTS, step("r3", 5, 3.0, 1))]
    out = coalesce(items)
    assert [(i, k) for i, k, _ in out] == [(A, OUTPUTS), (B, OUTPUTS)]
    merged = out[0][2]
    assert tokens(merged) == [("r1", [1]), ("r1", [2]), ("r3", [5])]
    assert merged.timestamp == 1.0  # the earliest output's time
    assert merged.scheduler_stats.num_running_reqs == 1  # the latest load
    assert tokens(out[1][2]) == [("r2", [7])]


def test_one_message_is_passed_through_unchanged():
    msg = step("r1", 1, 1.0)
    assert coalesce([(A, OUTPUTS, msg)]) == [(A, OUTPUTS, msg)]
    assert coalesce([]) == []


def test_a_utility_answer_keeps_its_place_between_step_outputs():
    answer = EngineCoreOutputs(0, utility_output=UtilityOutput(4, True))
    items = [(A, OUTPUTS, step("r1", 1, 1.0)), (A, OUTPUTS, answer),
             (A, OUTPUTS, step("r1", 2, 2.0)), (A, OUTPUTS, step("r1", 3, 3.0))]
    out = [m for _, _, m in coalesce(items)]
    assert len(out) == 3
    assert tokens(out[0]) == [("r1", [1])]
    assert out[1] is answer
    assert tokens(out[2]) == [("r1", [2]), ("r1", [3])]


def test_two_kv_event_batches_are_not_merged():
    first = step("r1", 1, 1.0, kv_events=KVEvents(stored=[11]))
    plain = step("r1", 2, 2.0)
    second = step("r1", 3, 3.0, kv_events=KVEvents(removed=[11]))
    out = [m for _, _, m in coalesce([(A, OUTPUTS, first), (A, OUTPUTS, plain),
                                      (A, OUTPUTS, second)])]
    assert [tokens(m) for m in out] == [[("r1", [1]), ("r1", [2])], [("r1", [3])]]
    assert out[0].kv_events.stored == [11] and out[1].kv_events.removed == [11]
    # one batch merges with plain steps on either side
    out = [m for _, _, m in coalesce([(A, OUTPUTS, plain), (A, OUTPUTS, second)])]
    assert len(out) == 1 and out[0].kv_events.removed == [11]


def test_other_message_kinds_are_never_merged():
    ready = (A, b"READY", b"payload")
    items = [(A, OUTPUTS, step("r1", 1, 1.0)), ready, (A, OUTPUTS, step("r1", 2, 2.0))]
    assert len(coalesce(items)) == 3
