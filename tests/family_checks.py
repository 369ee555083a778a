"""The checks every model family runs against transformers (issue 43), on a tiny
random-weight checkpoint made with the family's own config class: greedy tokens equal
HF's and teacher-forced logprobs agree within fp32 rounding, through chunked prefill
and a prefix-cache hit, with n=2 and under preemption."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.test_parity import _prompts

NEW_TOKENS = 16


def greedy(llm, prompts, n: int = NEW_TOKENS, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False, **kwargs)]


def hf_logprobs(model_dir: Path, sequences) -> list[list[float]]:
    """Each token's logprob (from the second on) under transformers, fp32."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in sequences:
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        out.append([lp[i, t].item() for i, t in enumerate(ids[1:])])
    return out


def prompt_logprobs(llm, sequences) -> list[list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return [[e[t].logprob for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
            for o in llm.generate(sequences, params, use_tqdm=False)]


def check_chunked_prefill_and_prefix_hit(model: Path, **engine_kwargs):
    """Prompts longer than a step's 24-token budget run in chunks, and the last two share
    a cached prefix: greedy equals HF's, teacher-forced logprobs within 1e-4. Returns
    the engine's model module (shut down) for the caller's checks."""
    prompts = _prompts([3, 17, 70, 9])
    prompts += [prompts[2][:48] + p for p in _prompts([5, 12], seed=1)]
    llm = LLM(str(model), dtype="float32", max_num_batched_tokens=24, block_size=8,
              enable_prefix_caching=True, **engine_kwargs)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in out]
        assert all(o.num_cached_tokens >= 40 for o in out[-2:])
        assert got == hf_greedy(model, prompts, NEW_TOKENS)
        sequences = [p + g for p, g in zip(prompts, got)]
        for mine, ref in zip(prompt_logprobs(llm, sequences), hf_logprobs(model, sequences)):
            assert mine == pytest.approx(ref, abs=1e-4)
        return llm.llm_engine.engine_core.runner.model
    finally:
        llm.shutdown()


def check_n2_and_preemption(model: Path, blocks: int = 24, **engine_kwargs) -> None:
    """`blocks` blocks of 8 cannot hold these six sequences at once, so some are preempted
    and recomputed and still match HF; n=2 greedy samples are both HF's tokens."""
    prompts = _prompts([30, 31, 29, 40, 12, 25])
    llm = LLM(str(model), dtype="float32", block_size=8, num_gpu_blocks_override=blocks,
              **engine_kwargs)
    try:
        want = hf_greedy(model, prompts, 40)
        assert greedy(llm, prompts, 40) == want
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
        for out, ref in zip(llm.generate(prompts[:2], params, use_tqdm=False), want):
            assert [list(c.token_ids) for c in out.outputs] == [ref[:12]] * 2
    finally:
        llm.shutdown()


def check_refused(model: Path, folder: Path, error: type, match: str, **changes) -> None:
    """The checkpoint with `changes` in its config.json is refused at start with `error`
    matching `match`."""
    changed = with_config(model, folder, **changes)
    with pytest.raises(error, match=match):
        LLM(str(changed), dtype="float32")


def check_tp2_matches_tp1(model: Path) -> None:
    """Two gloo ranks give one rank's greedy tokens and logprobs, each holding about half
    the weights (norms and the like are replicated)."""
    from tests.test_tensor_parallel import _tp_vs_single
    usage, whole = _tp_vs_single(model, 2, max_num_batched_tokens=32, block_size=8)
    assert all(0.3 * whole < b < 0.7 * whole for b in usage["per_rank_weights_bytes"])


def with_config(src: Path, folder: Path, **changes) -> Path:
    """A copy of a checkpoint (its files linked) whose config.json has changes."""
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def check_served_like_offline(model: Path) -> None:
    """`flotilla serve`'s path: the engine-core server and the OpenAI app over it; a chat
    completion, templated by the checkpoint's tokenizer, equals LLM.chat's greedy text."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.model.loader import load_tokenizer
    from engine.wire.core_server import EngineCoreServer
    from tests.test_core_client import free_address
    from tests.test_openai_app import MODEL, _Real, serve
    messages = [{"role": "user", "content": "Name a colour."}]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(model), dtype="float32")
    try:
        offline = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    core = EngineCore(EngineConfig(model=str(model), dtype="float32"))
    address = free_address()
    server = EngineCoreServer(core, address).start()
    try:
        async def chat(http, oai):
            return await oai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=10, temperature=0.0,
                extra_body={"ignore_eos": True})
        reply = serve(_Real(address, load_tokenizer(model)), chat)
    finally:
        server.shutdown()
    assert reply.choices[0].message.content == offline
    assert reply.usage.completion_tokens == 10


def served_completion_and_metrics(core, model: Path, prompt, max_tokens: int, **create):
    """`core` behind the engine-core server and the OpenAI app: one completion (ignore_eos)
    and the app's /metrics text after it; the server is shut down after."""
    from engine.model.loader import load_tokenizer
    from engine.wire.core_server import EngineCoreServer
    from tests.test_core_client import free_address
    from tests.test_openai_app import MODEL, _Real, serve
    address = free_address()
    server = EngineCoreServer(core, address).start()
    try:
        async def test(http, oai):
            reply = await oai.completions.create(model=MODEL, prompt=prompt,
                                                 max_tokens=max_tokens,
                                                 extra_body={"ignore_eos": True}, **create)
            return reply, (await http.get("/metrics")).text
        return serve(_Real(address, load_tokenizer(model)), test)
    finally:
        server.shutdown()

