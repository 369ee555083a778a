"""End to end through Ray Serve with tensor parallelism on CPU: a real tiny Llama,
data_parallel_size=2 x tensor_parallel_size=2 (4 ranks: 2 engine replicas, each with a
TP worker actor in its placement group), logical CPUs, one Ray session."""
import tempfile

import openai
import pytest

from engine.wire.ports import free_port


@pytest.fixture(scope="module")
def served(tiny_llama):
    import ray
    from ray import serve

    from deployments.app import build_app
    port = free_port("127.0.0.1")
    # logical resources: each engine's placement group takes 2 bundles of 1 CPU
    ray.init(num_cpus=4, _temp_dir=tempfile.mkdtemp(prefix="ray-"), include_dashboard=False,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": str(tiny_llama), "dtype": "float32",
                             "data_parallel_size": 2, "tensor_parallel_size": 2,
                             "engine_num_cpus": 1, "num_threads": 1, "ingress_num_cpus": 0,
                             "served_model_name": "tiny", "dev_mode": True,
                             "enable_lora": True, "max_lora_rank": 16}),
                  name="flotilla", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openai_client_against_dp2_tp2(served, tiny_llama):
    from engine import LLM, SamplingParams
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    prompt = [101, 2000, 3000, 4000, 5000]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  n=2, logprobs=1, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 24
    assert len(r.choices[0].logprobs.token_logprobs) == 12
    # TP=2 across Ray actors gives the single-process greedy text
    expected = LLM(str(tiny_llama), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].text == expected
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5
    stop = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                     temperature=0, stop=[expected[3:6]],
                                     extra_body={"ignore_eos": True})
    assert stop.choices[0].finish_reason == "stop"
    assert len(_alive_tp_workers()) == 2  # 2 engines x 1 TP worker actor each


def test_structured_outputs_and_tools_cross_the_wire_to_both_engines(served):
    """The constraint travels in the engine-core request to DP ranks with TP=2: eight
    concurrent requests (both engines) all validate."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from tests.test_openai_structured import TOOLS, WEATHER
    from tests.test_structured_outputs import FLAGS
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]

    def constrained(i):
        if i % 2:
            r = client.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=100, seed=i,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "f", "schema": FLAGS}})
            return "json", r.choices[0].message.content
        r = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=100, seed=i, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return "tool", r.choices[0].message.tool_calls[0].function.arguments

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(constrained, range(8)))
    for kind, text in results:
        schema = FLAGS if kind == "json" else WEATHER["function"]["parameters"]
        jsonschema.validate(json.loads(text), schema)


def _alive_tp_workers() -> dict[str, int]:
    """actor id -> pid of the live TPWorker actors (from the GCS actor table: the state
    API would need the dashboard, which this session does not start)."""
    import warnings

    import ray
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = ray.state.actors()
    return {a["ActorID"]: a["Pid"] for a in table.values()
            if a["ActorClassName"] == "TPWorker" and a["State"] == "ALIVE"}


def test_killed_tp_worker_fails_fast_and_the_engine_is_restarted(served):
    import os
    import signal
    import time

    import httpx
    body = {"model": "tiny", "prompt": [101, 2000, 3000], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    victim, pid = next(iter(_alive_tp_workers().items()))
    os.kill(pid, signal.SIGKILL)
    statuses = []
    with httpx.Client(base_url=served, timeout=30) as http:  # a hang fails the test
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            r = http.post("/v1/completions", json=body)
            statuses.append(r.status_code)
            if r.status_code != 200:
                assert r.status_code == 503 and "error" in r.json()
            if statuses[-3:] == [200, 200, 200] and len(_alive_tp_workers()) == 2 and \
                    victim not in _alive_tp_workers():
                break
            time.sleep(0.5)
    # served again by a restarted engine with a fresh TP worker
    assert statuses[-3:] == [200, 200, 200]
    assert victim not in _alive_tp_workers() and len(_alive_tp_workers()) == 2


def test_embeddings_and_prompt_lists_through_dp2_tp2(served, tiny_llama):
    """/v1/embeddings and a completion with a list of prompts: each input is its own
    engine request, so they spread over both engines; vectors match the offline path."""
    import torch

    from engine import LLM, SamplingParams
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    texts = [f"sentence number {i}" for i in range(6)]
    served_vectors = [d.embedding for d in client.embeddings.create(model="tiny",
                                                                   input=texts).data]
    llm = LLM(str(tiny_llama), dtype="float32")
    try:
        offline = [o.outputs[0].embedding for o in llm.embed(texts, use_tqdm=False)]
        greedy = [o.outputs[0].text for o in llm.generate(
            texts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False)]
    finally:
        llm.shutdown()
    for a, b in zip(served_vectors, offline):
        assert float(torch.dot(torch.tensor(a), torch.tensor(b))) > 0.9999
    r = client.completions.create(model="tiny", prompt=texts, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == greedy


def test_lora_adapter_loaded_at_run_time_served_and_unloaded(served, tiny_llama, tmp_path):
    """DP=2 x TP=2: an adapter loaded over HTTP reaches both engines (each TP rank reads
    its slice), eight concurrent requests with it give HF + peft's greedy tokens, the
    listing shows it, unloading removes it."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.test_lora import PROMPTS, make_adapter, peft_greedy
    model = make_adapter(tiny_llama, tmp_path / "ad", 8, ["q_proj", "v_proj", "o_proj",
                                                          "down_proj"], seed=3)
    ref = peft_greedy(model, PROMPTS)
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    with httpx.Client(base_url=served, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad",
                                                      "lora_path": str(tmp_path / "ad")})
        assert r.status_code == 200, r.text
        listed = {m.id: m for m in client.models.list().data}
        assert listed["ad"].parent == "tiny"

        def run(i):
            out = client.completions.create(model="ad", prompt=PROMPTS[i % 2], max_tokens=8,
                                            temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})
            return out.choices[0].logprobs.tokens

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(run, range(8)))
        from engine.model.loader import load_tokenizer
        tok = load_tokenizer(tiny_llama)
        for i, tokens in enumerate(got):
            assert tokens == [tok.decode([t]) for t in ref[i % 2]]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad"}).status_code == 200
        assert "ad" not in {m.id for m in client.models.list().data}
        gone = http.post("/v1/completions", json={"model": "ad", "prompt": "x"})
        assert gone.status_code == 404
