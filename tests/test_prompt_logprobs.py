"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs) against a
direct HF forward's log-softmax on a tiny model: offline, over chunked prefill and
the prefix cache, and through both endpoints with the official client."""
import json

import pytest
import torch

from deployments.apis.openai.schema import ChatCompletionResponse, CompletionResponse
from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.test_openai_app import MODEL, _Real, engines, serve, tiny_server, tokenizer  # noqa: F401

TEXT = "The quick brown fox jumps over the lazy dog, again and again."
TOL = 1e-4


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """Row p: log-softmax of the logits after tokens 0..p."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_against_hf(prompt_logprobs, ids: list[int], ref: torch.Tensor, top: int) -> None:
    """prompt_logprobs: per token, None first, else {token id: (logprob, rank)}."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        row, entry, token = ref[p - 1], prompt_logprobs[p], ids[p]
        assert entry[token][0] == pytest.approx(row[token].item(), abs=TOL)
        value = row[token].item()  # its rank, up to near-ties within the tolerance
        assert int((row > value + TOL).sum()) + 1 <= entry[token][1] <= \
            int((row > value - TOL).sum()) + 1
        best = row.topk(top)
        for rank, (value, t) in enumerate(zip(best.values.tolist(), best.indices.tolist()), 1):
            assert entry[t][0] == pytest.approx(value, abs=TOL)
        assert len(entry) <= top + 1


def _offline(out) -> list:
    return [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()}
            for e in out.prompt_logprobs]


def test_prompt_logprobs_equal_hf_over_chunks_and_the_prefix_cache(tiny_llama):
    """A budget of 8 tokens splits the prompt in chunks; the same prompt twice would hit
    the prefix cache, which a prompt-logprobs request must not use; n=2 reports them
    once; nothing is left in the KV pool."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=8,
              enable_prefix_caching=True)
    try:
        ids = llm.get_tokenizer().encode(TEXT)
        ref = _hf_logprobs(tiny_llama, ids)
        plain = llm.generate(TEXT, SamplingParams(max_tokens=3, temperature=0),
                             use_tqdm=False)[0]  # fills the prefix cache
        assert plain.prompt_logprobs is None
        outs = llm.generate([TEXT, TEXT], SamplingParams(max_tokens=3, temperature=0,
                                                         prompt_logprobs=3), use_tqdm=False)
        for out in outs:
            _check_against_hf(_offline(out), ids, ref, 3)
            assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        sampled = llm.generate(TEXT, SamplingParams(max_tokens=2, n=2, seed=1,
                                                    prompt_logprobs=0), use_tqdm=False)[0]
        _check_against_hf(_offline(sampled), ids, ref, 0)
        one = llm.generate([[ids[0]]], SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0]
        assert one.prompt_logprobs == [None]
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=21)
        core = llm.llm_engine.engine_core
        assert core.kv.num_free_blocks == core.num_blocks
    finally:
        llm.shutdown()


def _http_logprobs(entries) -> list:
    return [None if e is None else {int(t): (v["logprob"], v["rank"]) for t, v in e.items()}
            for e in entries]


def test_prompt_logprobs_and_echo_over_http(tiny_server, tiny_llama):
    from engine.model.loader import load_tokenizer
    tok = load_tokenizer(tiny_llama)
    real = _Real(tiny_server, tok)
    ids = tok.encode(TEXT)
    ref = _hf_logprobs(tiny_llama, ids)
    other = "Hello there"
    other_ids = tok.encode(other)
    other_ref = _hf_logprobs(tiny_llama, other_ids)

    async def test(http, oai):
        r = {}
        r["batch"] = await oai.completions.create(
            model=MODEL, prompt=[TEXT, other], max_tokens=2, temperature=0,
            extra_body={"prompt_logprobs": 2})
        r["echo"] = await oai.completions.create(
            model=MODEL, prompt=TEXT, max_tokens=3, temperature=0, echo=True, logprobs=2)
        r["echo_stream"] = (await http.post("/v1/completions", json={
            "prompt": other, "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1, "stream": True})).text
        r["chat"] = (await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2,
            "prompt_logprobs": 1})).json()
        r["chat_ids"] = (await http.post("/tokenize", json={
            "messages": [{"role": "user", "content": TEXT}]})).json()["tokens"]
        r["stream_refused"] = await http.post("/v1/completions", json={
            "prompt": TEXT, "stream": True, "prompt_logprobs": 1})
        r["too_many"] = await http.post("/v1/completions", json={
            "prompt": TEXT, "prompt_logprobs": 21})
        r["after"] = await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=2)
        return r

    r = serve(real, test)
    batch = r["batch"]
    CompletionResponse.model_validate(batch.model_dump(), strict=True)
    assert [c.index for c in batch.choices] == [0, 1]
    _check_against_hf(_http_logprobs(batch.choices[0].prompt_logprobs), ids, ref, 2)
    _check_against_hf(_http_logprobs(batch.choices[1].prompt_logprobs), other_ids,
                      other_ref, 2)
    assert batch.usage.prompt_tokens == len(ids) + len(other_ids)

    echo = r["echo"].choices[0]
    lp = echo.logprobs
    assert echo.text.startswith(TEXT)
    assert len(lp.tokens) == len(ids) + 3 and "".join(lp.tokens) == echo.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=TOL)
        assert len(lp.top_logprobs[p]) == 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    events = [json.loads(line[6:]) for line in r["echo_stream"].splitlines()
              if line.startswith("data: {")]
    for event in events:
        CompletionResponse.model_validate(event, strict=True)
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    values = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text.startswith(other) and "".join(tokens) == text
    assert len(tokens) == len(other_ids) + 3 and values[0] is None
    assert values[1] == pytest.approx(other_ref[0, other_ids[1]].item(), abs=TOL)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]

    chat = r["chat"]
    ChatCompletionResponse.model_validate(chat, strict=True)
    chat_ids = r["chat_ids"]
    _check_against_hf(_http_logprobs(chat["prompt_logprobs"]), chat_ids,
                      _hf_logprobs(tiny_llama, chat_ids), 1)

    refused = r["stream_refused"]
    assert refused.status_code == 400 and "prompt_logprobs" in refused.json()["error"]["message"]
    assert r["too_many"].status_code == 400
    assert r["after"].choices[0].text


def test_mock_engines_refuse_prompt_logprobs(engines):
    engines.add()

    async def test(http, oai):
        return await http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1})

    response = serve(engines, test)
    assert response.status_code == 400
    assert "prompt_logprobs" in response.json()["error"]["message"]


def test_a_prompt_longer_than_one_logit_slice(tiny_llama):
    """300 positions in one chunk are scored 256 rows at a time."""
    ids = [(i * 7919) % 40000 + 100 for i in range(300)]
    llm = LLM(str(tiny_llama), dtype="float32")
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        _check_against_hf(_offline(out), ids, _hf_logprobs(tiny_llama, ids), 1)
    finally:
        llm.shutdown()
