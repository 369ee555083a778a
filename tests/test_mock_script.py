"""The scripted mock engine (MockConfig.scripted): a prompt's last [[emit]]...[[/emit]]
directive is its output, then EOS, under every stop rule; structured outputs are checked
against the script. Mostly on a fake clock, with the default model's tokenizer."""
from __future__ import annotations

import httpx
import pytest

from engine.core_messages import FINISH_LENGTH, FINISH_STOP, EngineCoreRequest
from engine.errors import InvalidRequestError
from engine.mock.config import FIRST_TOKEN_ID, MockConfig
from engine.mock.core import MockEngineCore
from engine.mock.script import EMIT_CLOSE, EMIT_OPEN, find_script
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from tests.test_mock_engine import FakeClock, finish, run, tokens

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def emit(text: str) -> str:
    return f"{EMIT_OPEN}{text}{EMIT_CLOSE}"


@pytest.fixture(scope="module")
def core_factory(tokenizer):
    def make(**options) -> MockEngineCore:
        return MockEngineCore(MockConfig(scripted=True, **options), clock=FakeClock(),
                              tokenizer=tokenizer)
    return make


def ask(tokenizer, request_id: str, prompt: str, **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 200)  # SamplingParams' default is 16
    return EngineCoreRequest(request_id, tokenizer.encode(prompt), SamplingParams(**params))


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_the_script_comes_back_exactly_then_eos(tokenizer, core_factory):
    script = 'Hi , there.\n\n  <think>x</think> {"a": 1} \u00e9\u4e16 '
    core = core_factory(output_chunk_size=3)
    assert core.config.vocab_size == len(tokenizer)
    assert core.config.eos_token_id == tokenizer.eos_token_id
    out = run(core, ask(tokenizer, "a", f"Please say: {emit(script)} thanks"))["a"]
    ids = tokens(out)
    assert ids == tokenizer.encode(script, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert text_of(tokenizer, ids[:-1]) == script
    assert finish(out) == (FINISH_STOP, None)


def test_the_last_directive_wins(tokenizer, core_factory):
    prompt = f"{emit('first')} then {emit('second')} and more"
    ids = tokens(run(core_factory(), ask(tokenizer, "a", prompt))["a"])
    assert text_of(tokenizer, ids[:-1]) == "second"
    assert find_script("no directive") is None
    assert find_script(f"{EMIT_OPEN}{EMIT_CLOSE}") == ""
    with pytest.raises(InvalidRequestError, match="no"):
        find_script(f"{emit('ok')} {EMIT_OPEN}unclosed")


def test_stop_rules_cut_a_script(tokenizer, core_factory):
    script = "one two three four five six"
    want = tokenizer.encode(script, add_special_tokens=False)
    out = run(core_factory(), ask(tokenizer, "a", emit(script), max_tokens=3))["a"]
    assert tokens(out) == want[:3] and finish(out) == (FINISH_LENGTH, None)
    out = run(core_factory(), ask(tokenizer, "s", emit(script), stop_token_ids=[want[2]]))["s"]
    assert tokens(out) == want[:3] and finish(out) == (FINISH_STOP, want[2])
    # min_tokens past the script: drawn tokens, then EOS at min_tokens
    out = run(core_factory(), ask(tokenizer, "m", emit(script), min_tokens=len(want) + 4))["m"]
    ids = tokens(out)
    assert ids[:len(want)] == want and len(ids) == len(want) + 5
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in ids[:-1]
    # ignore_eos: drawn tokens after the script, up to max_tokens
    out = run(core_factory(), ask(tokenizer, "i", emit(script), ignore_eos=True,
                                  max_tokens=len(want) + 10))["i"]
    ids = tokens(out)
    assert ids[:len(want)] == want and len(ids) == len(want) + 10
    assert finish(out) == (FINISH_LENGTH, None)
    # fake logprobs, one row per token
    out = run(core_factory(), ask(tokenizer, "l", emit(script), logprobs=2))["l"]
    rows = [row for o in out for row in o.new_logprobs]
    assert [row[0][0] for row in rows] == tokens(out)


def test_no_directive_draws_tokens(tokenizer, core_factory):
    scripted = tokens(run(core_factory(), ask(tokenizer, "a", "plain prompt",
                                              max_tokens=20))["a"])
    plain = tokens(run(MockEngineCore(MockConfig(vocab_size=len(tokenizer)), clock=FakeClock()),
                       ask(tokenizer, "a", "plain prompt", max_tokens=20))["a"])
    assert scripted == plain and len(plain) == 20
    assert all(FIRST_TOKEN_ID <= t < len(tokenizer) for t in plain)
    with pytest.raises(InvalidRequestError, match="structured outputs"):
        core_factory().add_request(ask(tokenizer, "s", "plain prompt",
                                       structured_outputs=StructuredOutputsParams(json=SCHEMA)))


def test_scripted_needs_a_tokenizer():
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        MockEngineCore(MockConfig(scripted=True))


def _outcome(tokenizer, core_factory, script: str, **spec) -> str:
    request = ask(tokenizer, "a", emit(script),
                  structured_outputs=StructuredOutputsParams(**spec))
    try:
        ids = tokens(run(core_factory(), request)["a"])
    except InvalidRequestError as exc:
        assert "does not satisfy the request's structured output constraint" in str(exc)
        return "refused"
    assert text_of(tokenizer, ids[:-1]) == script
    return "accepted"


def test_structured_outputs_are_checked_against_the_script(tokenizer, core_factory):
    def outcome(script, **spec):
        return _outcome(tokenizer, core_factory, script, **spec)
    assert outcome('{"a": 1}', json=SCHEMA) == "accepted"
    assert outcome('{"a": "x"}', json=SCHEMA) == "refused"
    assert outcome('{"a": 1', json=SCHEMA) == "refused"  # incomplete
    assert outcome('{"a": 1} more', json=SCHEMA) == "refused"  # goes on past the end
    assert outcome('{"b": [1, 2]}', json_object=True) == "accepted"
    assert outcome("not json", json_object=True) == "refused"
    assert outcome("yes", choice=["yes", "no"]) == "accepted"
    assert outcome("maybe", choice=["yes", "no"]) == "refused"
    assert outcome("ab12", regex="[a-z]+[0-9]+") == "accepted"
    with pytest.raises(InvalidRequestError, match="compile|valid"):
        core_factory().add_request(ask(tokenizer, "bad", emit("x"), structured_outputs=
                                       StructuredOutputsParams(regex="(unclosed")))


def test_the_constraint_starts_after_reasoning_end(tokenizer, core_factory):
    end = tokenizer.encode("</think>", add_special_tokens=False)
    script = '<think>x</think>{"a": 1}'
    assert _outcome(tokenizer, core_factory, script, json=SCHEMA, reasoning_end=end) \
        == "accepted"
    assert _outcome(tokenizer, core_factory, script, json=SCHEMA) == "refused"
    # the reasoning never ends: the constraint never starts
    assert _outcome(tokenizer, core_factory, "<think>still thinking", json=SCHEMA,
                    reasoning_end=end) == "accepted"
    assert _outcome(tokenizer, core_factory, '<think>x</think>{"a": "no"}', json=SCHEMA,
                    reasoning_end=end) == "refused"
    # the end marker is emitted as reasoning_end's ids, whatever the text around it
    ids = tokens(run(core_factory(), ask(
        tokenizer, "b", emit('<think>y.</think>{"a": 2}'),
        structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning_end=end)))["b"])
    at = next(i for i in range(len(ids)) if ids[i:i + len(end)] == end)
    assert text_of(tokenizer, ids[at + len(end):-1]) == '{"a": 2}'


def test_app_args_carry_mock_scripted():
    from deployments.config import flat_options, parse_app_args
    args = parse_app_args({"model": "mock", "mock_scripted": True})
    assert args.mock.scripted and args.mock_config(0, vocab_size=100).scripted
    assert parse_app_args({"model": "mock", "mock_scripted": "true"}).mock.scripted
    assert not parse_app_args({"model": "mock"}).mock_config(0, vocab_size=100).scripted
    assert "mock_scripted" in {o.name for o in flat_options()}


def test_a_chat_completion_speaks_the_script(tokenizer):
    from tests.app_server import MODEL, serve_app_over_mocks
    script = '{"a": 7}'
    with serve_app_over_mocks(tokenizer, engines=1, scripted=True) as server:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": emit(script)}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "a", "schema": SCHEMA}}}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == script and choice["finish_reason"] == "stop"
        chat["messages"][0]["content"] = emit('{"a": "seven"}')
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and "structured output" in r.text, r.text
