"""LoRA adapters made here with peft (random non-zero A and B): Flotilla's greedy
tokens equal HF + peft's per adapter, in mixed batches, through LRU slot swaps, under
TP=2, with prefix caching keyed per adapter; bad adapters are refused by name."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.errors import InvalidRequestError
from engine.lora.request import adapter_id
from tests.conftest import hf_greedy
from tests.test_openai_app import tokenizer  # noqa: F401

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 50, 300, 2000, 77], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                     20, 21, 22, 23]]
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def make_adapter(base_dir, out, rank: int, targets: list[str], seed: int,
                 rslora: bool = False):
    """A peft LoRA of base_dir with random A and B (peft's default B is zero), saved in
    out; returns the merged HF model for reference generation."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                            target_modules=targets, use_rslora=rslora,
                                            init_lora_weights=False))
    model.save_pretrained(out)
    return model


def peft_greedy(model, prompts) -> list[list[int]]:
    results = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                 eos_token_id=None, pad_token_id=0)
        results.append(out[0, len(ids):].tolist())
    return results


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Three adapters of the tiny Llama: (LoRARequest, reference tokens) each."""
    root = tmp_path_factory.mktemp("lora")
    specs = [("qv", 8, ["q_proj", "v_proj"], False), ("all", 4, ALL, True),
             ("mlp", 16, ["gate_proj", "up_proj", "down_proj", "o_proj"], False)]
    out = {}
    for i, (name, rank, targets, rslora) in enumerate(specs, 1):
        model = make_adapter(tiny_llama, root / name, rank, targets, seed=i, rslora=rslora)
        out[name] = (LoRARequest(name, i, str(root / name)), peft_greedy(model, PROMPTS))
    return out


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_alone_and_all_mixed_equal_hf_peft(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=16, max_num_batched_tokens=16)
    try:
        base = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert base == hf_greedy(tiny_llama, PROMPTS, NEW)
        for lora, ref in adapters.values():
            assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                        lora_request=lora)) == ref, lora.lora_name
            assert ref != base
        # one batch: three adapters and the base model, each prompt under each
        loras = [None] + [lora for lora, _ in adapters.values()]
        prompts = [p for _ in loras for p in PROMPTS]
        per_prompt = [lora for lora in loras for _ in PROMPTS]
        mixed = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False,
                                     lora_request=per_prompt))
        assert mixed == base + [t for _, ref in adapters.values() for t in ref]
        core = llm.llm_engine.engine_core
        assert core.kv.num_free_blocks == core.num_blocks
    finally:
        llm.shutdown()


def test_more_adapters_than_slots_swap_and_stay_correct(tiny_llama, adapters):
    """max_loras=1, host cache of 2: three adapters in flight take turns in the slot."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=1,
              max_cpu_loras=2, max_lora_rank=16)
    try:
        names = ["qv", "all", "mlp", "qv", "mlp"]
        prompts = [PROMPTS[i % 2] for i in range(len(names))]
        outs = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False,
                                    lora_request=[adapters[n][0] for n in names]))
        assert outs == [adapters[n][1][i % 2] for i, n in enumerate(names)]
        runner = llm.llm_engine.engine_core.runner
        assert len(runner.lora_cache._cache) == 2  # noqa: SLF001 - the LRU bound
    finally:
        llm.shutdown()


def test_prefix_cache_is_per_adapter(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
              block_size=4)
    try:
        lora, ref = adapters["all"]
        prompt = PROMPTS[1]
        llm.generate(prompt, GREEDY, use_tqdm=False)  # the base model's blocks cached
        first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert first.num_cached_tokens == 0  # nothing reused from the base model
        assert again.num_cached_tokens == 16  # its own blocks reused (4 full of 19 tokens)
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == ref[1]
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_by_name(tiny_llama, adapters, tmp_path):
    lora, _ = adapters["all"]
    plain = LLM(str(tiny_llama), dtype="float32")
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            plain.generate("hi", GREEDY, use_tqdm=False, lora_request=lora)
    finally:
        plain.shutdown()
    # an adapter that also trains the LM head: named in the error
    head = tmp_path / "head"
    head.mkdir()
    src = adapters["qv"][0].lora_path
    config = json.loads(open(f"{src}/adapter_config.json").read())
    (head / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(f"{src}/adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.ones(8, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.ones(10, 8)
    save_file(tensors, head / "adapter_model.safetensors")
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(InvalidRequestError, match="lm_head"):
            llm.generate("hi", GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("head", 9, str(head)))
        with pytest.raises(InvalidRequestError, match="max_lora_rank"):
            llm.generate("hi", GREEDY, use_tqdm=False, lora_request=adapters["mlp"][0])
        with pytest.raises(InvalidRequestError, match="no LoRA adapter"):
            llm.generate("hi", GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("gone", 10, str(tmp_path / "none")))
        other = tmp_path / "other"  # an adapter of a model with another hidden size
        other.mkdir()
        (other / "adapter_config.json").write_text(json.dumps(config))
        tensors = load_file(f"{src}/adapter_model.safetensors")
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[key] = torch.ones(8, 32)
        save_file(tensors, other / "adapter_model.safetensors")
        with pytest.raises(InvalidRequestError, match="another model"):
            llm.generate("hi", GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("other", 11, str(other)))
        core = llm.llm_engine.engine_core
        core.add_lora(LoRARequest("first", 12, src))
        with pytest.raises(InvalidRequestError, match="already stands for"):
            llm.generate("hi", GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("second", 12, str(head)))
        ok = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
        assert _tokens(ok) == adapters["all"][1]  # the engine still serves
    finally:
        llm.shutdown()


def test_tp2_equals_tp1_with_an_adapter(tiny_llama, adapters):
    lora, ref = adapters["all"]
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
              tensor_parallel_size=2)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                    lora_request=lora)) == ref
        mlp, mlp_ref = adapters["mlp"]
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                    lora_request=mlp)) == mlp_ref
    finally:
        llm.shutdown()


def test_default_model_with_an_adapter_equals_hf_peft(default_model_reference, tmp_path):
    model = make_adapter(default_model_reference, tmp_path / "smol", 8, ALL, seed=5)
    ref = peft_greedy(model, PROMPTS)
    del model
    llm = LLM("default", dtype="float32", enable_lora=True, max_lora_rank=8,
              lora_modules={"smol": str(tmp_path / "smol")})
    try:
        lora = LoRARequest("smol", adapter_id("smol"), str(tmp_path / "smol"))
        assert llm.llm_engine.engine_core.list_loras() == [lora]
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                    lora_request=lora)) == ref
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def lora_server(tiny_llama, adapters):
    """The real engine with enable_lora and the "qv" adapter loaded at start."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.wire.core_server import EngineCoreServer
    from tests.test_core_client import free_address
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", enable_lora=True,
                                   max_loras=2, max_lora_rank=16,
                                   lora_modules={"qv": adapters["qv"][0].lora_path}))
    address = free_address()
    server = EngineCoreServer(core, address).start()
    yield address
    server.shutdown()


def test_adapters_over_http_listed_loaded_served_unloaded(lora_server, tiny_llama, adapters):
    from engine.model.loader import load_tokenizer
    from tests.test_openai_app import MODEL, _Real, serve
    tok = load_tokenizer(tiny_llama)
    real = _Real(lora_server, tok)
    greedy = {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0}
    oai_greedy = {**greedy, "extra_body": {"ignore_eos": True}}
    greedy["ignore_eos"] = True

    async def test(http, oai):
        r = {"models": await oai.models.list()}
        r["qv"] = await oai.completions.create(model="qv", **oai_greedy)
        r["base"] = await oai.completions.create(model=MODEL, **oai_greedy)
        r["unknown"] = await http.post("/v1/completions", json={**greedy, "model": "nope"})
        r["load"] = await http.post("/v1/load_lora_adapter", json={
            "lora_name": "all", "lora_path": adapters["all"][0].lora_path})
        r["again"] = await http.post("/v1/load_lora_adapter", json={
            "lora_name": "all", "lora_path": adapters["all"][0].lora_path})
        r["bad"] = await http.post("/v1/load_lora_adapter", json={
            "lora_name": "bad", "lora_path": "/nonexistent"})
        r["all"] = await oai.completions.create(model="all", **oai_greedy)
        r["card"] = await oai.models.retrieve("all")
        r["chat"] = await http.post("/v1/chat/completions", json={
            "model": "all", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        r["unload"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
        r["gone"] = await http.post("/v1/completions", json={**greedy, "model": "all"})
        r["unload_again"] = await http.post("/v1/unload_lora_adapter",
                                            json={"lora_name": "all"})
        r["after"] = await oai.models.list()
        return r

    r = serve(real, test, dev_mode=True)
    listed = {m.id: m for m in r["models"].data}
    assert set(listed) == {MODEL, "qv"} and listed["qv"].parent == MODEL
    assert listed["qv"].root == "qv"  # no server path shown (issue 40, finding 8)
    assert "lora" not in r["models"].model_dump_json().replace('"qv"', "")
    assert r["qv"].choices[0].text == tok.decode(adapters["qv"][1][0])
    assert r["base"].choices[0].text == tok.decode(hf_greedy(tiny_llama, PROMPTS[:1], NEW)[0])
    assert r["unknown"].status_code == 404 and r["unknown"].json()["error"]["param"] == "model"
    assert r["load"].status_code == 200, r["load"].text
    assert r["again"].status_code == 400 and "already" in r["again"].json()["error"]["message"]
    assert r["bad"].status_code == 400 and "no LoRA adapter" in r["bad"].json()["error"][
        "message"]
    assert r["all"].choices[0].text == tok.decode(adapters["all"][1][0])
    assert r["card"].id == "all" and r["card"].parent == MODEL
    assert r["chat"].status_code == 200
    assert r["unload"].status_code == 200
    assert r["gone"].status_code == 404 and r["unload_again"].status_code == 404
    assert {m.id for m in r["after"].data} == {MODEL, "qv"}


def test_mock_engines_refuse_adapters(tokenizer):
    from tests.test_core_client import Engines
    from tests.test_openai_app import serve
    engines = Engines(tokenizer)
    try:
        engines.add()

        async def test(http, oai):
            return await http.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                                   "lora_path": "/tmp"})
        response = serve(engines, test, dev_mode=True)
        assert response.status_code == 400 and "LoRA" in response.json()["error"]["message"]
    finally:
        engines.stop()


def test_removing_an_adapter_lets_its_running_requests_finish(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16)
    try:
        lora, ref = adapters["all"]
        engine = llm.llm_engine
        core = engine.engine_core
        assert core.add_lora(lora) and core.list_loras() == [lora]
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=lora)
        engine.step()
        engine.step()  # running, with tokens out
        assert core.remove_lora(lora.lora_int_id) and core.list_loras() == []
        assert not core.remove_lora(lora.lora_int_id)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert done[0].outputs[0].token_ids == ref[0]
        assert core.kv.num_free_blocks == core.num_blocks
    finally:
        llm.shutdown()


def test_router_prefers_an_engine_that_ran_the_adapter_unless_overloaded():
    import itertools
    from types import SimpleNamespace

    from engine.wire.core_client import EngineClient
    from engine.wire.routing import Router
    client = object.__new__(EngineClient)  # only the routing policy, no sockets
    engines = [SimpleNamespace(index=i, dead=False, draining=False, step_running_s=0.0,
                               stats=None, in_flight=0, adapters=set()) for i in range(2)]
    client.engines, client._rr, client.dead_error = engines, itertools.count(), None
    client.stalled_step_s = 10.0
    client.router = Router()  # no prefix cached anywhere: the cost is the load
    engines[1].adapters.add(7)
    engines[1].in_flight = 2  # within max(2, 0 // 4) of the least loaded
    assert client._pick(None, 7)[0] is engines[1]
    assert client._pick(None, None)[0] is engines[0]  # no adapter: least loaded
    engines[1].in_flight = 3  # overloaded: the least loaded engine loads it instead
    assert client._pick(None, 7)[0] is engines[0]
    engines[0].in_flight, engines[1].in_flight = 40, 49  # a quarter of 40 is the slack
    assert client._pick(None, 7)[0] is engines[1]


def test_an_adapter_gone_from_disk_fails_its_requests_not_the_engine(tiny_llama, adapters,
                                                                     tmp_path):
    import shutil
    src = adapters["qv"][0].lora_path
    shutil.copytree(src, tmp_path / "qv")
    doomed = LoRARequest("doomed", 42, str(tmp_path / "qv"))
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
              max_cpu_loras=1)
    try:
        engine = llm.llm_engine
        engine.add_request("doomed", PROMPTS[0], GREEDY, lora_request=doomed)  # read: ok
        engine.add_request("other", PROMPTS[0], GREEDY, lora_request=adapters["all"][0])
        shutil.rmtree(tmp_path / "qv")  # the host cache (1) kept only "all"
        engine.add_request("base", PROMPTS[1], GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done["doomed"].outputs[0].finish_reason == "error"
        assert done["other"].outputs[0].token_ids == adapters["all"][1][0]
        assert done["base"].outputs[0].token_ids == hf_greedy(tiny_llama, PROMPTS[1:], NEW)[0]
        core = engine.engine_core
        assert core.kv.num_free_blocks == core.num_blocks
    finally:
        llm.shutdown()


def test_a_waiting_adapter_is_not_starved_by_newcomers_of_the_running_one(tiny_llama,
                                                                        adapters):
    """max_loras=1: A runs; B waits for the slot; a later A request waits behind B."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16)
    try:
        engine = llm.llm_engine
        a, b = adapters["qv"][0], adapters["all"][0]
        engine.add_request("a1", PROMPTS[0], GREEDY, lora_request=a)
        engine.step()
        engine.add_request("b", PROMPTS[0], GREEDY, lora_request=b)
        engine.add_request("a2", PROMPTS[0], GREEDY, lora_request=a)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        assert finished == ["a1", "b", "a2"]
    finally:
        llm.shutdown()


def test_adapters_load_only_from_the_allowed_roots(tiny_llama, adapters, tmp_path):
    """allowed_lora_roots: an adapter outside them is refused, a symlink out of a root
    too; lora_modules given at start load wherever they are."""
    import shutil
    (qv, _), (mlp, _), (all_, _) = adapters["qv"], adapters["mlp"], adapters["all"]
    root = tmp_path / "root"
    shutil.copytree(qv.lora_path, root / "qv")
    (root / "escape").symlink_to(mlp.lora_path, target_is_directory=True)
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
              allowed_lora_roots=str(root), lora_modules={"all": all_.lora_path})
    try:
        core = llm.llm_engine.engine_core
        assert core.add_lora(LoRARequest("qv", 1, str(root / "qv")))
        for path in (mlp.lora_path, str(root / "escape"), str(root / "qv" / ".." / "..")):
            with pytest.raises(InvalidRequestError, match="allowed_lora_roots"):
                core.add_lora(LoRARequest("other", 3, path))
        with pytest.raises(InvalidRequestError, match="allowed_lora_roots"):  # a request's
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=mlp)
        assert {r.lora_name for r in core.list_loras()} == {"all", "qv"}
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="allowed_lora_roots needs enable_lora"):
        LLM(str(tiny_llama), allowed_lora_roots=str(root))
