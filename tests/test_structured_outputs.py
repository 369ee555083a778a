"""Structured outputs and logit controls in the engine (offline LLM, tiny random model).

Random weights are the point: a constrained output must be valid whatever the model
prefers. Schemas bound every string and array, so a random model still finishes
within max_tokens.
"""
import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputsParams as S

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string",
                                                             "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "tags", "address"]}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "level": {"enum": [1, 2, 3]},
                                          "note": {"type": ["string", "null"], "maxLength": 5}},
         "required": ["ok", "level", "note"]}
LIST = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["id"]},
    "minItems": 1, "maxItems": 4}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=16)
    yield llm
    llm.shutdown()


def _texts(outs):
    return [c.text for o in outs for c in o.outputs]


@pytest.mark.parametrize("schema", [PERSON, FLAGS, LIST], ids=["nested", "enums", "array"])
def test_json_schema_outputs_parse_and_validate(llm, schema):
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=s, n=2,
                             structured_outputs=S(json=schema)) for s in range(3)]
    outs = llm.generate(["Tell me about", "x", "{"], params, use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    outs = llm.generate(["a", "b", "c", "d"], [
        SamplingParams(max_tokens=20, seed=1, structured_outputs=S(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(max_tokens=20, seed=2, structured_outputs=S(
            choice=["yes", "no", 'say "maybe"'])),
        SamplingParams(max_tokens=20, seed=3, structured_outputs=S(
            grammar='root ::= "(" xy xy? xy? ")"\nxy ::= "x" | "y"')),
        SamplingParams(max_tokens=64, temperature=0,
                       structured_outputs=S(json_object=True))], use_tqdm=False)
    regex, choice, grammar, obj = _texts(outs)
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex)
    assert choice in ("yes", "no", 'say "maybe"')
    assert re.fullmatch(r"\([xy]{1,3}\)", grammar)
    # any JSON: a random model need not close it in 64 tokens, but it is a valid prefix
    assert obj.startswith("{")
    if outs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(obj), dict)


def test_constrained_rows_do_not_change_their_neighbours(llm):
    """16 requests in one batch, half constrained: the unconstrained ones give the same
    tokens as when they run alone."""
    prompts = [f"Story number {i}:" for i in range(16)]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts[::2], plain, use_tqdm=False)
    mixed = llm.generate(prompts, [
        plain if i % 2 == 0 else SamplingParams(max_tokens=100, seed=i,
                                                structured_outputs=S(json=FLAGS))
        for i in range(16)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids
                                                           for o in alone]
    for o in mixed[1::2]:
        jsonschema.validate(json.loads(o.outputs[0].text), FLAGS)


def test_constraint_holds_through_preemption_chunked_prefill_and_stop_strings(tiny_llama):
    """A KV pool too small for the batch preempts and recomputes; a small token budget
    chunks the prompts; a stop string cuts one output. Every finished output is valid."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=8, block_size=16,
              num_gpu_blocks_override=24, max_num_batched_tokens=32, enable_prefix_caching=True)
    try:
        prompt = "Once upon a time " * 12
        outs = llm.generate([prompt] * 8, [SamplingParams(
            max_tokens=150, seed=i, structured_outputs=S(json=PERSON)) for i in range(8)],
            use_tqdm=False)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        cut = llm.generate(prompt, SamplingParams(max_tokens=150, seed=0, stop=['"age"'],
                                                  structured_outputs=S(json=PERSON)),
                           use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.text.startswith('{"name": "')
        assert '"age"' not in cut.text
        assert llm.llm_engine.engine_core.kv.num_free_blocks == 24
    finally:
        llm.shutdown()


def test_logit_bias_forces_and_bans_allowed_and_bad_words(llm):
    tok = llm.get_tokenizer()
    base = llm.generate("The", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate("The", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logit_bias={1234: 100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [1234] * 6
    banned = llm.generate("The", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logit_bias={base[0]: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != base[0]
    allowed = llm.generate("The", SamplingParams(max_tokens=20, temperature=1.0, seed=0,
                                                 ignore_eos=True,
                                                 allowed_token_ids=[100, 200, 300]),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert set(allowed) <= {100, 200, 300} and len(set(allowed)) > 1
    word = tok.decode(base[:2]).strip()
    no_word = llm.generate("The", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                 bad_words=[word]),
                           use_tqdm=False)[0].outputs[0]
    assert word not in no_word.text
    for bad in ({1 << 20: 1.0}, {5: 101.0}):
        with pytest.raises(InvalidRequestError):
            llm.generate("The", SamplingParams(logit_bias=bad), use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.generate("The", SamplingParams(allowed_token_ids=[]), use_tqdm=False)


def test_bad_constraints_are_refused_and_the_engine_keeps_serving(llm):
    for spec in ({"json": {"type": "strin"}}, {"json": "{no"}, {"regex": "a(b"},
                 {"grammar": "root ::= nothing"}):
        with pytest.raises(InvalidRequestError, match="does not compile|not valid JSON"):
            llm.generate("x", SamplingParams(structured_outputs=S(**spec)), use_tqdm=False)
    for fields in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}):
        with pytest.raises(InvalidRequestError):
            S(**fields)
    ok = llm.generate("x", SamplingParams(max_tokens=3, structured_outputs=S(choice=["ok"])),
                      use_tqdm=False)[0].outputs[0]
    assert ok.text == "ok"


def test_engine_fails_one_request_whose_grammar_does_not_compile(tiny_llama):
    """Anything can reach an engine's socket: a spec that slipped past the frontend
    fails that request with an error output; the others finish."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.core_messages import EngineCoreRequest
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32"))
    try:
        core.add_request(EngineCoreRequest("bad", [1, 2, 3], SamplingParams(
            structured_outputs=S(regex="a(b"))))
        core.add_request(EngineCoreRequest("good", [1, 2, 3], SamplingParams(
            max_tokens=4, structured_outputs=S(choice=["fine"]))))
        outputs = {}
        for _ in range(200):
            for out in core.step():
                outputs.setdefault(out.request_id, []).append(out)
            if not core.has_unfinished_requests():
                break
        bad, good = outputs["bad"][-1], outputs["good"][-1]
        assert bad.finish_reason == "error" and "does not compile" in bad.error
        assert good.finish_reason == "stop"
        assert core.kv.num_free_blocks == core.num_blocks and not core.requests
    finally:
        core.shutdown()


def test_bitmask_rows_filled_in_parallel_equal_one_by_one(tiny_llama):
    """The step's bitmask from xgrammar's batch filler (engine threads > 1) is the same as
    filling row by row, constrained rows only, and JSON rows ban control characters
    (xgrammar alone allows token 190, a NUL byte, inside a maxLength string)."""
    from engine.core.request import Request
    from engine.structured.manager import StructuredOutputManager
    specs = [S(json=PERSON), None, S(regex="[a-z]+"), S(json={"type": "string",
                                                              "maxLength": 5})]
    masks = []
    for threads in (1, 2):
        manager = StructuredOutputManager(tiny_llama, 49152, (2,), fill_threads=threads)
        requests = [Request(str(i), [1, 2], SamplingParams(structured_outputs=spec), (2,))
                    for i, spec in enumerate(specs)]
        for r in requests:
            manager.add(r)
        while manager.has_pending():
            manager.wait(1.0)
            assert manager.poll() == []
        assert manager.accept(requests[3], 18)  # the string's opening quote
        bitmask, rows = manager.bitmask(requests)
        assert rows == [0, 2, 3]
        masks.append(bitmask[rows].clone())
        manager.shutdown()
    assert masks[0].equal(masks[1])
    allowed = lambda row, t: bool((int(masks[0][row, t // 32]) >> (t % 32)) & 1)  # noqa: E731
    assert allowed(2, 81) and not allowed(2, 190)  # 'a' yes, NUL no
    assert not allowed(1, 18)  # the regex row: no quote


def test_restrictions_that_leave_no_token_fail_that_request(tiny_llama):
    """allowed_token_ids whose only id is a bad word: no token is possible, so the request
    fails with a typed error instead of sampling an id it forbade; min_tokens with a
    constraint is refused up front."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.core_messages import EngineCoreRequest
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32"))
    try:
        core.add_request(EngineCoreRequest("none-left", [1, 2, 3], SamplingParams(
            allowed_token_ids=[100], bad_words=["x"], bad_words_token_ids=[[100]])))
        core.add_request(EngineCoreRequest("fine", [1, 2, 3], SamplingParams(
            max_tokens=3, allowed_token_ids=[100, 200], bad_words=["x"],
            bad_words_token_ids=[[100]], ignore_eos=True)))
        outputs = {}
        while core.has_unfinished_requests():
            for out in core.step():
                outputs.setdefault(out.request_id, []).append(out)
        dead = outputs["none-left"][-1]
        assert dead.finish_reason == "error" and dead.error.startswith("InvalidRequestError")
        assert [t for o in outputs["fine"] for t in o.new_token_ids] == [200, 200, 200]
        assert core.kv.num_free_blocks == core.num_blocks
    finally:
        core.shutdown()
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=S(choice=["a"]))
