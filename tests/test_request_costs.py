"""What a request costs the engine after it is admitted (issue 40, finding 3): its logit
controls are built once, its bad words matched through a trie, and aborting it scans no
queue."""
from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.core.request_queue import FCFSQueue, PriorityQueue
from engine.sampling_params import SamplingParams


def _brute_force_banned(words: list[list[int]], output: list[int]) -> list[int]:
    """The rule itself: a word's last token is banned when the output ends with the rest."""
    return [w[-1] for w in words
            if len(w) == 1 or (len(output) >= len(w) - 1 and output[-(len(w) - 1):] == w[:-1])]


def test_bad_word_trie_bans_exactly_what_the_rule_bans():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from engine.executor.logit_controls import BadWordTrie
    token = st.integers(0, 5)

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.lists(token, min_size=1, max_size=4), max_size=12),
           st.lists(token, max_size=8))
    def check(words, output):
        assert sorted(BadWordTrie(words).banned(output)) == sorted(
            _brute_force_banned(words, output))
    check()


def test_logit_controls_are_built_once_per_request(tiny_llama):
    """allowed_token_ids, logit_bias and bad words become tensors and a trie at the
    request's first sampled step and are reused after; the output obeys them."""
    from engine import LLM
    from engine.executor import logit_controls
    built = []
    original = logit_controls.RowControls.__init__

    def counting(self, request, *args):
        built.append(request.request_id)
        original(self, request, *args)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    allowed = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=allowed, logit_bias={101: 50.0})
    try:
        logit_controls.RowControls.__init__ = counting
        out = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    finally:
        logit_controls.RowControls.__init__ = original
    assert len(built) == 2  # one per request, not one per step
    assert all(t == 101 for o in out for t in o.outputs[0].token_ids)


class _CountingRequest(Request):
    """Counts equality checks: a queue that scans for a request compares it with every
    request before it (deque.remove did, once per abort)."""

    compared = 0

    def __eq__(self, other):
        _CountingRequest.compared += 1
        return self is other

    __hash__ = Request.__hash__


@pytest.mark.parametrize("queue_type", [FCFSQueue, PriorityQueue])
def test_removing_a_waiting_request_scans_no_queue(queue_type):
    queue = queue_type()
    requests = [_CountingRequest(f"r{i}", [1], SamplingParams(), (), arrival_time=float(i))
                for i in range(2000)]
    for r in requests:
        queue.add(r)
    _CountingRequest.compared = 0
    for r in reversed(requests[1000:]):  # the latest first: the far end of the queue
        assert queue.remove(r)
    assert _CountingRequest.compared == 0
    assert not queue.remove(requests[-1])  # already gone
    assert len(queue) == 1000 and list(queue) == requests[:1000]
    assert queue.pop() is requests[0]


def test_fcfs_queue_keeps_its_order_through_preemption_and_put_back():
    queue = FCFSQueue()
    a, b, c, d = (Request(x, [1], SamplingParams(), ()) for x in "abcd")
    for r in (a, b, c):
        queue.add(r)
    queue.add_preempted(d)
    assert [r.request_id for r in queue] == ["d", "a", "b", "c"]
    popped = [queue.pop(), queue.pop()]
    queue.put_back(popped)
    assert [r.request_id for r in queue] == ["d", "a", "b", "c"]
    assert queue.remove(a) and queue.peek() is d
