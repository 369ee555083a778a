"""Embeddings: the engine's pooling path against a direct HF forward, offline and
through /v1/embeddings (official client), mixed with generation in one engine."""
import base64
import json
import shutil
import struct

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.pooling import PoolingParams
from tests.test_openai_app import MODEL, _Real, engines, serve, tiny_server, tokenizer  # noqa: F401

TEXTS = ["Hello world", "A much longer sentence, so that a small token budget has to "
         "prefill it in several chunks before it can be pooled.", "x"]


def _hf_embeddings(model_dir, texts, mean: bool) -> list[torch.Tensor]:
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = model(ids).last_hidden_state[0]
        out.append(torch.nn.functional.normalize(hidden.mean(0) if mean else hidden[-1], dim=0))
    return out


def _cosines(outs, refs) -> list[float]:
    return [float(torch.dot(torch.tensor(o.outputs[0].embedding), r))
            for o, r in zip(outs, refs)]


@pytest.fixture(scope="module")
def mean_model(tiny_llama, tmp_path_factory):
    """The tiny Llama with a sentence-transformers config that asks for mean pooling."""
    out = tmp_path_factory.mktemp("mean") / "model"
    shutil.copytree(tiny_llama, out)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    return out


def test_embeddings_equal_a_direct_hf_forward_with_chunked_prefill(tiny_llama, mean_model):
    for model_dir, mean in ((tiny_llama, False), (mean_model, True)):
        llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=8)
        try:
            outs = llm.embed(TEXTS, use_tqdm=False)
            assert all(c > 0.9999 for c in _cosines(outs, _hf_embeddings(model_dir, TEXTS,
                                                                         mean)))
            assert all(len(o.outputs[0].embedding) == 64 for o in outs)
            raw = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
            assert abs(torch.tensor(raw.outputs[0].embedding).norm().item() - 1.0) > 1e-3
            with pytest.raises(InvalidRequestError, match="dimensions"):
                llm.embed("x", PoolingParams(dimensions=16), use_tqdm=False)
            assert llm.llm_engine.engine_core.kv.num_free_blocks == \
                llm.llm_engine.engine_core.num_blocks
        finally:
            llm.shutdown()


def test_embedding_and_generation_share_a_batch(tiny_llama):
    """Generation requests give the same tokens whether embedding requests share their
    steps or not, and the embeddings are unchanged by the company."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=16)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        alone = llm.generate(TEXTS, greedy, use_tqdm=False)
        engine = llm.llm_engine
        for i, text in enumerate(TEXTS):
            engine.add_request(f"g{i}", text, greedy)
            engine.add_request(f"e{i}", text, SamplingParams(), pooling_params=PoolingParams())
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert [done[f"g{i}"].outputs[0].token_ids for i in range(3)] == \
            [o.outputs[0].token_ids for o in alone]
        refs = _hf_embeddings(tiny_llama, TEXTS, mean=False)
        assert all(c > 0.9999 for c in _cosines([done[f"e{i}"] for i in range(3)], refs))
    finally:
        llm.shutdown()


def test_embeddings_endpoint_with_the_openai_client(tiny_server, tiny_llama):
    from engine.model.loader import load_tokenizer
    real = _Real(tiny_server, load_tokenizer(tiny_llama))
    refs = _hf_embeddings(tiny_llama, TEXTS, mean=False)

    async def test(http, oai):
        single = await oai.embeddings.create(model=MODEL, input=TEXTS[0])
        batch = await oai.embeddings.create(model=MODEL, input=TEXTS)
        b64 = await http.post("/v1/embeddings", json={"input": TEXTS[:2],
                                                      "encoding_format": "base64"})
        ids = await oai.embeddings.create(model=MODEL, input=[[101, 2000, 3000], [7, 8]])
        dims = await http.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
        empty = await http.post("/v1/embeddings", json={"input": []})
        return single, batch, b64.json(), ids, dims, empty

    single, batch, b64, ids, dims, empty = serve(real, test)
    assert float(torch.dot(torch.tensor(single.data[0].embedding), refs[0])) > 0.9999
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert all(float(torch.dot(torch.tensor(d.embedding), r)) > 0.9999
               for d, r in zip(batch.data, refs))
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 0
    for d, r in zip(b64["data"], refs):
        raw = base64.b64decode(d["embedding"])
        vector = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert float(torch.dot(vector, r)) > 0.9999
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 5
    assert dims.status_code == 400 and "dimensions" in dims.json()["error"]["message"]
    assert empty.status_code == 400


def test_mock_engines_refuse_embeddings(engines):
    engines.add()

    async def test(http, oai):
        return await http.post("/v1/embeddings", json={"input": "x"})

    r = serve(engines, test)
    assert r.status_code == 400 and "embeddings" in r.json()["error"]["message"]
