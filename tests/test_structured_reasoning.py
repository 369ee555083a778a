"""Structured outputs after a reasoning model's thinking (StructuredOutputsParams.
reasoning_end, issue 45): the output is free until the first occurrence of the
end-of-thinking token sequence, and the constraint holds from the token after it.

A tiny random model stands in for a reasoning model: its own greedy output decides the
triggers (a token it emits at position k, or two it emits in a row), so every case is
deterministic. The same requests under speculative decoding (an oracle proposer that
proposes across the trigger, sometimes wrongly, in a pool small enough to preempt) give
the same tokens.
"""
from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.spec_decode import proposers
from engine.spec_decode.proposers.base import Proposer
from engine.structured.manager import GrammarState
from engine.structured.params import StructuredOutputsParams as S
from tests.test_parity import _prompts

NEW = 40  # tokens of the free runs (and max_tokens of every request)
REGEX = r"[0-9]{2,4}"
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "level": {"enum": [1, 2, 3]}},
         "required": ["ok", "level"]}
ENGINE = dict(dtype="float32", block_size=8, max_num_batched_tokens=24)


class RecordedProposer(Proposer):
    """Proposes each prompt's recorded output from where the request is, every third
    proposal wrong at its second token (which a grammar may refuse mid-proposal)."""

    answers: dict[tuple[int, ...], list[int]] = {}
    calls = 0

    def propose(self, request, k):
        done = request.num_output_tokens
        out = list(self.answers.get(tuple(request.prompt_token_ids), [])[done:done + k])
        RecordedProposer.calls += 1
        if RecordedProposer.calls % 3 == 0 and len(out) > 1:
            out[1] = (out[1] + 1) % 100 + 100
        return out


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=8, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def cases(llm):
    """Case name -> (prompt, params, where the constraint starts or None), one prompt a
    case, the triggers read off the free greedy outputs; and prompt -> free output."""
    prompts = [tuple(p) for p in _prompts([9, 14, 11, 7, 12, 10], seed=21)]
    outs = llm.generate([list(p) for p in prompts], SamplingParams(
        temperature=0.0, max_tokens=NEW), use_tqdm=False)
    finish = {p: o.outputs[0].finish_reason for p, o in zip(prompts, outs)}
    free = dict(zip(prompts, _tokens(outs)))
    a, b, c, d, e, f = prompts

    def first_new(out, at_least):  # a position k >= at_least whose token is new there
        return next(k for k in range(at_least, len(out) - 2) if out[k] not in out[:k])

    def first_pair(out, at_least):  # a position k whose (out[k], out[k + 1]) is new there
        pairs = list(zip(out, out[1:]))
        return next(k for k in range(at_least, len(out) - 3) if pairs[k] not in pairs[:k])

    kb, ke = first_new(free[b], 5), first_new(free[e], 12)
    kd = first_pair(free[d], 6)
    absent = next(t for t in range(1000, 2000) if all(t not in o for o in free.values()))
    return {
        "from-start": (a, _params(S(regex=REGEX)), 0),
        "one-token": (b, _params(S(regex=REGEX, reasoning_end=[free[b][kb]])), kb + 1),
        "never": (c, _params(S(regex=REGEX, reasoning_end=[absent])), None),
        "two-tokens": (d, _params(S(choice=["yes", "no"],
                                    reasoning_end=free[d][kd:kd + 2])), kd + 2),
        "json-late": (e, _params(S(json=FLAGS, reasoning_end=[free[e][ke]])), ke + 1),
        "never-pair": (f, _params(S(regex=REGEX, reasoning_end=[free[f][3], absent])), None),
    }, free, finish


def _params(spec):
    return SamplingParams(temperature=0.0, max_tokens=NEW, structured_outputs=spec)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _run(llm, cases):
    names = list(cases)
    outs = llm.generate([list(cases[n][0]) for n in names], [cases[n][1] for n in names],
                        use_tqdm=False)
    return {n: o.outputs[0] for n, o in zip(names, outs)}


@pytest.fixture(scope="module")
def plain_outputs(llm, cases):
    return _run(llm, cases[0])


def test_free_until_the_trigger_then_constrained(llm, cases, plain_outputs):
    """(a) without reasoning_end the regex holds from token 0; (b, d) with it the output
    is the free one up to and with the trigger, then valid and finished; (c) a trigger
    that never comes leaves the output free (a partial match of two tokens included)."""
    specs, free, finish = cases
    tok = llm.get_tokenizer()
    for name, (prompt, params, start) in specs.items():
        out = plain_outputs[name]
        if start is None:
            assert list(out.token_ids) == free[prompt], name
            assert out.finish_reason == finish[prompt], name
            continue
        assert list(out.token_ids[:start]) == free[prompt][:start], name
        assert out.finish_reason == "stop", name
        text = tok.decode(out.token_ids[start:], skip_special_tokens=True)
        spec = params.structured_outputs
        if spec.regex is not None:
            assert re.fullmatch(REGEX, text), (name, text)
        elif spec.choice is not None:
            assert text in spec.choice, (name, text)
        else:
            assert set(json.loads(text)) == {"ok", "level"}, (name, text)
    # the constraint changed something: a free run would not have stopped there
    assert plain_outputs["one-token"].token_ids != free[specs["one-token"][0]]


def test_speculation_and_preemption_change_nothing(tiny_llama, cases, plain_outputs):
    """(e) The recorded proposer proposes each request's own output (across its trigger,
    every third proposal wrong), in 16 blocks of 8 that preempt requests: the tokens are
    those without speculation."""
    specs = cases[0]
    RecordedProposer.answers = {prompt: list(plain_outputs[name].token_ids)
                                for name, (prompt, _, _) in specs.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(proposers.PROPOSERS, "recorded", RecordedProposer)
        spec = LLM(str(tiny_llama), num_gpu_blocks_override=16, speculative_config={
            "method": "recorded", "num_speculative_tokens": 4}, **ENGINE)
        try:
            # twice over: more requests than the pool holds at once
            twice = {f"{n}{i}": v for n, v in specs.items() for i in range(2)}
            outs = _run(spec, twice)
            core = spec.llm_engine.engine_core
            assert core.get_stats().spec_num_accepted_tokens > 0
            assert core.scheduler.num_preemptions > 0
        finally:
            spec.shutdown()
    for name, out in outs.items():
        want = plain_outputs[name[:-1]]
        assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason), name


def test_the_trigger_watch_finds_overlapping_sequences():
    """(d) A trigger that restarts inside a partial match ([5, 5, 7] in 5 5 5 7) is found
    at its first complete occurrence, and only output tokens after it are constrained."""
    for trigger, output, wakes_after in (([5, 5, 7], [5, 5, 5, 7, 1], 4),
                                         ([1, 2, 1, 3], [1, 2, 1, 2, 1, 3, 9], 6),
                                         ([4], [3, 4, 4], 2), ([4, 4], [4, 3, 4, 9], None)):
        state = GrammarState(None, b"", False, trigger)
        woke = None
        for n, token in enumerate(output, 1):
            if state.dormant:
                state.watch(token)
                woke = None if state.dormant else n
        assert woke == wakes_after, (trigger, output)


def test_bad_reasoning_end_is_refused_and_the_compile_key_ignores_it():
    """(f) reasoning_end must be a non-empty list of token ids; the grammar compiles
    once whatever ends the thinking before it."""
    for bad in ([], [-1], ["a"], [1.5], [True], "12", 7, [[1]]):
        with pytest.raises(InvalidRequestError, match="reasoning_end"):
            S(regex=REGEX, reasoning_end=bad)
    plain = S(regex=REGEX)
    assert S(regex=REGEX, reasoning_end=[1, 2]).cache_key() == plain.cache_key()
    assert S(regex=REGEX, reasoning_end=(3,)).reasoning_end == [3]
