"""Speculative decoding (engine/spec_decode, issue 44): proposed tokens verified in one
step change nothing of what a request gets. Greedy tokens equal those without
speculation for every proposer (chunked prefill, a prefix hit, n=2, preemption); a
seeded request at temperature 1 gives its tokens without speculation; rejection
sampling keeps the target distribution (chi-square, a deliberately bad proposer);
structured outputs, stop strings and logprobs are unchanged; rejected tokens' blocks
go back to the pool; the counters reach /metrics."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.spec_decode import proposers
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposers.base import Proposer
from tests.conftest import TINY
from tests.test_parity import _prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


class OracleProposer(Proposer):
    """Proposes the reference continuation (ORACLE: prompt -> greedy output), with every
    third proposal wrong from its second token: accepted and rejected tokens both."""

    answers: dict[tuple[int, ...], list[int]] = {}
    calls = 0

    def propose(self, request, k):
        ref = self.answers.get(tuple(request.prompt_token_ids), [])
        done = request.num_output_tokens
        out = list(ref[done:done + k])
        OracleProposer.calls += 1
        if OracleProposer.calls % 3 == 0 and len(out) > 1:
            out[1] = (out[1] + 1) % 100 + 100
        return out


class ConstantProposer(Proposer):
    """Always proposes token 0: a bad proposer, so that rejections happen."""

    def propose(self, request, k):
        return [0] * k


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setitem(proposers.PROPOSERS, "oracle", OracleProposer)
    monkeypatch.setitem(proposers.PROPOSERS, "constant", ConstantProposer)
    OracleProposer.answers = {}
    return OracleProposer


def _greedy(llm, prompts, n=24, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **params)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _engine(model, spec=None, **kwargs):
    return LLM(str(model), dtype="float32", block_size=8, max_num_batched_tokens=24,
               speculative_config=spec, **kwargs)


def _repetitive_prompts():
    """Prompts that repeat themselves (what ngram and suffix copy from), a long one in
    chunks, two sharing a cached prefix."""
    base = _prompts([7, 11, 5], seed=3)
    prompts = [b * 4 for b in base] + _prompts([40], seed=4)
    prompts += [prompts[3][:32] + p for p in _prompts([6, 9], seed=5)]
    return prompts


def _check_cache_holds_known_tokens(llm, sequences):
    """Every block the prefix cache can hand out holds a block of some request's real
    tokens at its place: no rejected proposal was ever cached."""
    kv = llm.llm_engine.engine_core.kv
    bs = kv.block_size
    real = {tuple(s[i:i + bs]) for s in sequences for i in range(0, len(s) - bs + 1, bs)}
    cached = [kv.blocks[b].token_ids for b in kv.cached.values()]
    assert cached and all(tokens in real for tokens in cached)


def _check_pool_whole(llm):
    core = llm.llm_engine.engine_core
    assert core.kv.num_free_blocks == core.kv.usable_blocks
    assert not core.scheduler.running and not core.scheduler.waiting


def _draft(tiny_models, which: str) -> dict:
    """A draft_model config: the target itself (its proposals are nearly all accepted) or
    another architecture's random checkpoint over the same vocabulary (mostly not)."""
    return {"method": "draft_model", "num_speculative_tokens": 3,
            "model": str(tiny_models["llama" if which == "self" else "qwen2"])}


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX, {"method": "oracle",
                                                  "num_speculative_tokens": 5},
                                  "draft-self", "draft-other", "eagle3"],
                         ids=["ngram", "suffix", "oracle", "draft-self", "draft-other",
                              "eagle3"])
def test_greedy_tokens_equal_without_speculation(tiny_models, tiny_llama, oracle, spec,
                                                 tmp_path):
    if spec == "eagle3":
        spec = {"method": "eagle3", "num_speculative_tokens": 3,
                "model": str(_eagle3_head(tmp_path / "head", tiny_llama)[0])}
    elif isinstance(spec, str):
        spec = _draft(tiny_models, spec.split("-")[1])
    prompts = _repetitive_prompts()
    plain = _engine(tiny_llama, enable_prefix_caching=True)
    try:
        want = _greedy(plain, prompts)
    finally:
        plain.shutdown()
    oracle.answers = {tuple(p): w for p, w in zip(prompts, want)}
    llm = _engine(tiny_llama, spec, enable_prefix_caching=True)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == want
        assert all(o.num_cached_tokens >= 32 for o in out[-2:])  # the prefix hit
        stats = llm.llm_engine.engine_core.get_stats()
        assert stats.spec_num_draft_tokens > 0
        if spec["method"] == "oracle":  # both outcomes happened
            assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
            assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1] > 0
        if spec.get("model") == str(tiny_llama):  # the target as its own draft
            assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
        params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
        for got, ref in zip(llm.generate(prompts[:2], params, use_tqdm=False), want):
            assert [list(c.token_ids) for c in got.outputs] == [ref[:12]] * 2
        _check_pool_whole(llm)
        _check_cache_holds_known_tokens(llm, [p + w for p, w in zip(prompts, want)])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["oracle", "draft_model", "eagle3"])
def test_greedy_equal_under_preemption(tiny_llama, oracle, method, tmp_path):
    """24 blocks of 8 cannot hold these sequences and their proposals: requests are
    preempted (their proposals dropped; a draft model computes its cache again in the
    new blocks) and recomputed, with the same tokens."""
    prompts = _prompts([30, 31, 29, 40, 12, 25])
    plain = _engine(tiny_llama, num_gpu_blocks_override=24)
    try:
        want = _greedy(plain, prompts, 40)
    finally:
        plain.shutdown()
    oracle.answers = {tuple(p): w for p, w in zip(prompts, want)}
    spec = {"method": method, "num_speculative_tokens": 6}
    if method == "draft_model":
        spec["model"] = str(tiny_llama)
    elif method == "eagle3":
        spec["model"] = str(_eagle3_head(tmp_path / "head", tiny_llama)[0])
    llm = _engine(tiny_llama, spec, num_gpu_blocks_override=24)
    try:
        assert _greedy(llm, prompts, 40) == want
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        stats = core.get_stats()  # a random EAGLE-3 head's guesses are all rejected
        assert (stats.spec_num_draft_tokens if method == "eagle3"
                else stats.spec_num_accepted_tokens) > 0
        _check_pool_whole(llm)
    finally:
        llm.shutdown()


def test_seeded_sampling_and_logprobs_unchanged(tiny_llama, oracle):
    """A seeded request at temperature 1 draws its n-th token from its n-th uniform with
    or without speculation, so its tokens are the same; logprobs are the model's."""
    prompts = _prompts([9, 14], seed=7)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True,
                            logprobs=2)
    plain = _engine(tiny_llama)
    try:
        want = plain.generate(prompts, params, use_tqdm=False)
    finally:
        plain.shutdown()
    oracle.answers = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want)}
    llm = _engine(tiny_llama, {"method": "oracle", "num_speculative_tokens": 4})
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.engine_core.get_stats().spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-4)


def _tiny_vocab_model(folder, tokenizer_dir):
    """A Llama over 8 tokens, weights spread wide so its next-token distributions are
    far from uniform."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.model.loader import load_tokenizer
    config = LlamaConfig(**{**TINY, "initializer_range": 0.6}, vocab_size=8, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    load_tokenizer(tokenizer_dir).save_pretrained(folder)
    return folder


def _target_marginals(model, prompt):
    """The exact distributions of the 2nd and 3rd generated tokens (summed over the
    tokens before them), from transformers at temperature 1."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

    def next_probs(seqs):
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor(seqs)).logits[:, -1].double(), -1)
    p1 = next_probs([prompt])[0]
    firsts = [prompt + [a] for a in range(8)]
    p2 = next_probs(firsts)  # [a, b]
    pairs = [prompt + [a, b] for a in range(8) for b in range(8)]
    p3 = next_probs(pairs).view(8, 8, 8)
    joint2 = p1[:, None] * p2
    return joint2.sum(0), (joint2[:, :, None] * p3).sum((0, 1))


def test_rejection_sampling_keeps_the_target_distribution(tmp_path, tiny_tokenizer_dir,
                                                          oracle):
    """2,400 samples of 3 tokens at temperature 1 with a proposer that always guesses
    token 0: the 2nd and 3rd tokens (verified ones) follow the model's distribution
    (chi-square, p > 1e-4), and most guesses were rejected."""
    model = _tiny_vocab_model(tmp_path / "v8", tiny_tokenizer_dir)
    prompt = [3, 5, 4, 6]
    p2, p3 = _target_marginals(model, prompt)
    llm = LLM(str(model), dtype="float32", max_num_seqs=256,
              speculative_config={"method": "constant", "num_speculative_tokens": 2})
    try:
        n = 2400
        params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
        out = llm.generate([prompt] * n, params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    finally:
        llm.shutdown()
    tokens = torch.tensor([o.outputs[0].token_ids for o in out])
    assert stats.spec_num_draft_tokens >= n  # every request verified proposals
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    for position, p in ((1, p2), (2, p3)):
        seen = torch.bincount(tokens[:, position], minlength=8).double()
        expected = p * n
        keep = expected >= 5  # chi-square's rule of thumb; the rest pooled
        f_obs = torch.cat([seen[keep], seen[~keep].sum().view(1)])
        f_exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
        if f_exp[-1] < 5:
            f_obs, f_exp = f_obs[:-1], f_exp[:-1]
            f_exp = f_exp * f_obs.sum() / f_exp.sum()
        stat = ((f_obs - f_exp) ** 2 / f_exp).sum()
        dof = torch.tensor((len(f_obs) - 1) / 2, dtype=torch.float64)
        pvalue = torch.special.gammaincc(dof, stat / 2).item()  # chi-square's survival
        assert pvalue > 1e-4, (position, seen, expected, pvalue)


def test_structured_output_stop_strings_and_opt_out(tiny_llama, oracle):
    """With the oracle's proposals (every third one wrong, which the grammar may refuse
    mid-proposal): a regex-constrained JSON object is valid and the same as without
    speculation; a stop string cuts the same text at the same token; a request that
    opts out takes no proposals."""
    from engine.structured.params import StructuredOutputsParams
    prompts = _prompts([12, 15], seed=9)
    pattern = r'\{"name": "[a-z]{3,8}", "n": [0-9]{1,2}\}'
    so = SamplingParams(temperature=0.0, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(regex=pattern))
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _engine(tiny_llama)
    try:
        json_plain = [o.outputs[0] for o in plain.generate(prompts, so, use_tqdm=False)]
        free_plain = [o.outputs[0] for o in plain.generate(prompts, free, use_tqdm=False)]
        stop = free_plain[0].text[len(free_plain[0].text) // 2:][:3]  # met midway
        stop_params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
        stop_plain = plain.generate(prompts[:1], stop_params, use_tqdm=False)[0].outputs[0]
    finally:
        plain.shutdown()
    oracle.answers = {tuple(p): list(j.token_ids) for p, j in zip(prompts, json_plain)}
    llm = _engine(tiny_llama, {"method": "oracle", "num_speculative_tokens": 4})
    try:
        json_spec = [o.outputs[0] for o in llm.generate(prompts, so, use_tqdm=False)]
        core = llm.llm_engine.engine_core
        assert core.get_stats().spec_num_accepted_tokens > 0
        oracle.answers = {tuple(p): list(f.token_ids) for p, f in zip(prompts, free_plain)}
        stop_spec = llm.generate(prompts[:1], stop_params, use_tqdm=False)[0].outputs[0]
        drafted = core.get_stats().spec_num_draft_tokens
        opt_out = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                 speculative_decoding=False)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, opt_out,
                                                             use_tqdm=False)] == \
            [list(f.token_ids[:12]) for f in free_plain]
        assert core.get_stats().spec_num_draft_tokens == drafted
        _check_pool_whole(llm)
    finally:
        llm.shutdown()
    for mine, ref in zip(json_spec, json_plain):
        assert mine.token_ids == ref.token_ids and mine.text == ref.text
        assert set(json.loads(mine.text)) == {"name", "n"}
    assert stop in free_plain[0].text and stop_plain.finish_reason == "stop"
    assert (stop_spec.text, stop_spec.token_ids, stop_spec.finish_reason) == (
        stop_plain.text, stop_plain.token_ids, "stop")


def test_served_with_metrics(tiny_llama, oracle):
    """The engine-core server with speculative_config behind the OpenAI app: a completion
    equals the offline one without speculation, and /metrics counts drafts and accepted
    tokens."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.model.loader import load_tokenizer
    from tests.family_checks import served_completion_and_metrics
    prompt = _repetitive_prompts()[0]
    llm = _engine(tiny_llama)
    try:
        want = _greedy(llm, [prompt], 16)[0]
    finally:
        llm.shutdown()
    oracle.answers = {tuple(prompt): want}
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32",
                                   speculative_config={"method": "oracle"}))
    reply, metrics = served_completion_and_metrics(core, tiny_llama, prompt, 16,
                                                   temperature=0.0)
    assert reply.usage.completion_tokens == 16
    assert reply.choices[0].text == load_tokenizer(tiny_llama).decode(want)
    values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode")}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total"] > 0


def test_a_draft_of_another_vocabulary_is_refused(tmp_path, tiny_tokenizer_dir, tiny_llama):
    draft = _tiny_vocab_model(tmp_path / "v8", tiny_tokenizer_dir)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        LLM(str(tiny_llama), dtype="float32", speculative_config={"model": str(draft)})


@pytest.mark.parametrize("spec, match", [
    ({"method": "medusa", "model": "x"}, "not served"),
    ({"method": "eagle3"}, "only then"),
    ({"method": "ngram", "model": "x"}, "only then"),
    ({"method": "ngramx"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "typo": 1}, "unknown or unsupported keys"),
    ({"num_speculative_tokens": 3}, "needs a method"),
])
def test_bad_configs_are_refused(spec, match):
    from engine.config import EngineConfig
    with pytest.raises(InvalidRequestError, match=match):
        EngineConfig(speculative_config=spec)


def test_suffix_proposer_follows_the_longest_match_and_shared_responses():
    """The suffix proposer proposes what followed the longest earlier match, as far as the
    match is long (max_spec_factor 1), and learns from finished requests' responses."""
    from engine.core.request import Request
    config = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8})
    proposer = proposers.make_proposer(config)
    params = SamplingParams()
    r = Request("a", [5, 6, 7, 8, 9, 1, 2, 5, 6, 7], params, ())
    assert proposer.propose(r, 8) == [8, 9, 1]  # matched 3 tokens: 3 proposed
    other = Request("b", [40, 41], params, ())
    other.append_token(42)
    for t in (43, 44, 45, 46):
        other.append_token(t)
    proposer.finish(other)  # its response 42..46 joins the shared index
    asking = Request("c", [9, 42, 43, 44], params, ())
    assert proposer.propose(asking, 8) == [45, 46]
    ngram = proposers.make_proposer(SpeculativeConfig.from_dict(NGRAM))
    assert ngram.propose(r, 3) == [8, 9, 1]


def _eagle3_head(folder, target, draft_vocab=512):
    """A random EAGLE-3 head for the tiny Llama, in the published layout (midlayer.*, fc,
    d2t over a draft vocabulary of the target's ids), reading layers 0, 1 and 1."""
    from safetensors.torch import save_file
    cfg = json.loads((target / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"], "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}))
    g = torch.Generator().manual_seed(5)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale
    target_ids = torch.randperm(cfg["vocab_size"], generator=g)[:draft_vocab].sort().values
    weights = {
        "fc.weight": rand(h, 3 * h), "norm.weight": 1 + rand(h, scale=0.1),
        "lm_head.weight": rand(draft_vocab, h, scale=1.0),
        "d2t": target_ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(cfg["vocab_size"], dtype=torch.bool),
        "midlayer.input_layernorm.weight": 1 + rand(h, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter)}
    save_file(weights, str(folder / "model.safetensors"))
    return folder, weights


def _eagle3_reference(target, weights, tokens, k):
    """The head's k greedy proposals after `tokens`, computed over the whole sequence in
    plain torch from transformers' hidden states (no paging, no engine code)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    cfg = hf.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    w = {n.removeprefix("midlayer."): t.float() for n, t in weights.items()}

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def rope(x, pos):
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
        ang = pos.float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        streams = torch.cat([states[0][0], states[1][0], states[1][0]], -1)
        embed = hf.model.embed_tokens.weight
        hidden = streams[:-1] @ w["fc.weight"].T  # positions 0 .. n-2
        nxt = list(tokens[1:])
        proposals = []
        for _ in range(k):
            n = hidden.shape[0]
            x = torch.cat([rms(embed[torch.tensor(nxt)], w["input_layernorm.weight"]),
                           rms(hidden, w["hidden_norm.weight"])], -1)
            pos = torch.arange(n)
            q = rope((x @ w["self_attn.q_proj.weight"].T).view(n, heads, d), pos)
            kk = rope((x @ w["self_attn.k_proj.weight"].T).view(n, kv, d), pos)
            vv = (x @ w["self_attn.v_proj.weight"].T).view(n, kv, d)
            kk, vv = kk.repeat_interleave(heads // kv, 1), vv.repeat_interleave(heads // kv, 1)
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True)
            h1 = att.transpose(0, 1).reshape(n, -1) @ w["self_attn.o_proj.weight"].T + hidden
            m = rms(h1, w["post_attention_layernorm.weight"])
            out = (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T)
                   * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T + h1
            draft = int((rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            token = draft + int(weights["d2t"][draft])
            proposals.append(token)
            hidden = torch.cat([hidden, out[-1:]])  # fed back at the next position
            nxt.append(token)
    return proposals


def test_eagle3_random_head_proposes_what_the_reference_computes(tmp_path, tiny_llama):
    """A random EAGLE-3 head over the tiny Llama: greedy tokens equal the target's without
    speculation, and every proposal the engine made equals the plain-torch reference's
    for the request's tokens at that step (the target's kept hidden states, the head's
    paged cache, the fed-back passes and the d2t map all exact)."""
    from engine.spec_decode.proposers.eagle3 import Eagle3Proposer
    head, weights = _eagle3_head(tmp_path / "eagle3", tiny_llama)
    prompts = _prompts([9, 21], seed=8)
    plain = _engine(tiny_llama)
    try:
        want = _greedy(plain, prompts, 10)
    finally:
        plain.shutdown()
    seen = []
    original = Eagle3Proposer.propose_batch

    def recording(self, requests, rooms):
        out = original(self, requests, rooms)
        seen.extend((list(r.all_token_ids), k, p) for r, k, p in zip(requests, rooms, out))
        return out
    Eagle3Proposer.propose_batch = recording
    try:
        llm = _engine(tiny_llama, {"method": "eagle3", "model": str(head),
                                   "num_speculative_tokens": 3}, enable_prefix_caching=False)
        try:
            assert _greedy(llm, prompts, 10) == want
            _check_pool_whole(llm)
        finally:
            llm.shutdown()
    finally:
        Eagle3Proposer.propose_batch = original
    assert len(seen) >= 6
    for tokens, k, proposal in seen[:6]:
        assert proposal == _eagle3_reference(tiny_llama, weights, tokens, k)


def test_a_request_whose_proposals_keep_missing_rests(oracle):
    """backoff_after_misses 1: after each proposal rejected outright a request rests 1,
    then 2, then 4 steps; an accepted token ends the rest; 0 turns resting off."""
    from engine.core.request import Request
    from engine.spec_decode.decoder import SpecDecoder
    from engine.spec_decode.proposers import ProposerContext

    def pattern(after, outcomes):
        config = SpeculativeConfig.from_dict({"method": "constant", "num_speculative_tokens": 2,
                                              "backoff_after_misses": after})
        decoder = SpecDecoder(config, ProposerContext(None, None, 1000, "cpu", None))
        r = Request("r", [5, 6, 7], SamplingParams(max_tokens=500), ())
        r.append_token(8)
        r.num_computed_tokens = r.num_tokens - 1
        asked = []
        for accept in outcomes:
            decoder.propose([r])
            asked.append(bool(r.spec_tokens))
            emitted = 1
            if r.spec_tokens:
                r.num_computed_tokens += 1 + len(r.spec_tokens)
                emitted += decoder.settle(r, [0, 0, 0] if accept else [1, 1, 1])
            else:
                r.num_computed_tokens += 1
            for _ in range(emitted):
                r.append_token(9)
        return asked
    misses = [False] * 12
    assert pattern(1, misses) == [True, False, True, False, False, True, False, False, False,
                                  False, True, False]
    assert pattern(0, misses) == [True] * 12
    assert pattern(1, [False, False, True, True, True, True]) == [True, False, True, True,
                                                                   True, True]


def test_the_status_line_reports_the_acceptance_rate():
    from engine.core.stats_logger import StatsLogger
    from engine.core_messages import SchedulerStats
    now = [0.0]
    log = StatsLogger(10.0, clock=lambda: now[0])
    now[0] = 11.0
    line = log.maybe_log(lambda: SchedulerStats(spec_num_draft_tokens=40,
                                                spec_num_accepted_tokens=30))
    assert "spec decode acceptance rate: 75.0% (30/40 tokens)" in line
    now[0] = 22.0  # nothing proposed in this interval: no such part
    assert "spec decode" not in log.maybe_log(lambda: SchedulerStats(
        spec_num_draft_tokens=40, spec_num_accepted_tokens=30))


def test_a_proposal_never_preempts_a_request():
    """Two decoding requests in a pool that holds their tokens but not one's proposal:
    the proposal is dropped, nobody is preempted."""
    from engine.config import EngineConfig
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.request import Request, RequestStatus
    from engine.core.scheduler import Scheduler
    kv = KVCacheManager(2, 4, enable_prefix_caching=False)
    scheduler = Scheduler(EngineConfig(), kv, 64, 64)
    requests = [Request(str(i), [1, 2, 3], SamplingParams(), ()) for i in range(2)]
    for r in requests:
        r.append_token(4)
        r.num_computed_tokens = 3
        r.status = RequestStatus.RUNNING
        assert kv.allocate(r, 1)
        scheduler.running.append(r)
    requests[0].spec_tokens = [5, 6, 7]  # positions 4..6: a block the pool does not have
    out = scheduler.schedule()
    assert out.requests == requests and out.num_new_tokens == [1, 1]
    assert not out.preempted and requests[0].spec_tokens == []


def test_checking_a_config_imports_no_torch_and_every_method_resolves():
    """The CLI and the ingress check speculative_config without importing torch; the
    engine resolves each method to its proposer class."""
    import subprocess
    import sys
    code = ("import sys; from engine.config import EngineConfig; "
            "EngineConfig(speculative_config={'method': 'suffix'}); "
            "EngineConfig(speculative_config={'model': '/m', 'method': 'draft_model'}); "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    import importlib
    for method, where in proposers.PROPOSERS.items():
        if isinstance(where, str):
            module, name = where.split(":")
            assert issubclass(getattr(importlib.import_module(module), name), Proposer), method
