"""Sampler behaviour: seeds, greedy equivalences, n > 1, logprobs, penalties, stop tokens."""
import math
import random

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.outputs import OutputKind


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", block_size=8)


def _prompts(k, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 30))] for _ in range(k)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_independent_of_batch_composition(llm):
    target = _prompts(1, seed=5)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm.generate([target], seeded, use_tqdm=False))[0]
    others = _prompts(4, seed=9)
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 2
                         + [seeded] + [SamplingParams(temperature=0.7, max_tokens=10)] * 2,
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = seeded.clone(seed=4321)
    assert _tokens(llm.generate([target], other_seed, use_tqdm=False))[0] != alone


def test_top_k_one_equals_greedy(llm):
    prompts = _prompts(3)
    greedy = _tokens(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                          ignore_eos=True), use_tqdm=False))
    top1 = _tokens(llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=20,
                                                        ignore_eos=True), use_tqdm=False))
    assert top1 == greedy


def test_n_samples_share_prompt_blocks(llm):
    prompt = list(range(1000, 1064))  # 8 full blocks of 8
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    engine.add_request("fan", prompt, params, OutputKind.FINAL_ONLY)
    engine.step()
    kv = engine.engine_core.kv
    used = kv.num_blocks - kv.num_free_blocks
    assert used < 3 * 8  # the three sequences hold the 7 shareable prompt blocks once
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    (out,) = done
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    assert kv.num_free_blocks == kv.num_blocks


def test_logprobs_sampled_and_top_k(llm):
    out = llm.generate([_prompts(1)[0]], SamplingParams(temperature=0.0, max_tokens=5,
                                                        logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy: the sampled one is top-1
        assert len(entry) == 3
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_min_tokens_and_stop_token_ids(llm):
    prompt = _prompts(1, seed=3)[0]
    free = _tokens(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                         ignore_eos=True), use_tqdm=False))[0]
    stop_at = free[3]
    first = free.index(stop_at)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                stop_token_ids=[stop_at]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == free[:first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    later = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)
    assert len(later[0].outputs[0].token_ids) >= 8


def test_penalties_change_greedy_output(llm):
    prompt = _prompts(1, seed=4)[0]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _tokens(llm.generate([prompt], base, use_tqdm=False))[0]
    for change in (dict(repetition_penalty=2.0), dict(frequency_penalty=2.0),
                   dict(presence_penalty=2.0)):
        penalized = _tokens(llm.generate([prompt], base.clone(**change), use_tqdm=False))[0]
        assert len(penalized) == 24
        assert penalized != plain or len(set(plain)) == len(plain), change
    # a strong repetition penalty never repeats a token greedily
    rep = _tokens(llm.generate([prompt], base.clone(repetition_penalty=1e6), use_tqdm=False))[0]
    assert not set(rep) & set(prompt) and len(set(rep)) == len(rep)


def test_min_p_and_top_p_restrict_to_likely_tokens(llm):
    prompt = _prompts(1, seed=6)[0]
    greedy = _tokens(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                           ignore_eos=True), use_tqdm=False))[0]
    # a nucleus this small, or min_p = 1, keeps only the top token: greedy again
    for params in (SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True),
                   SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10, ignore_eos=True)):
        assert _tokens(llm.generate([prompt], params, use_tqdm=False))[0] == greedy


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-2), dict(min_p=2), dict(n=0), dict(max_tokens=0),
                                 dict(logprobs=21), dict(presence_penalty=3),
                                 dict(repetition_penalty=0), dict(min_tokens=5, max_tokens=2)])
def test_invalid_sampling_params_raise_typed_error(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_native_greedy_argmax_matches_torch_and_takes_the_first_maximum(kernels):
    import torch

    from engine.executor.sampler import Sampler
    torch.manual_seed(0)
    logits = torch.randn(9, 1000)
    logits[2, 17] = logits[2, 900] = logits[2].max() + 1  # a tie: the first index wins
    logits[4, 999] = 50.0  # the last column
    logits[5] = -1e30
    sampler = Sampler(1000, kernels.argmax_rows)
    assert torch.equal(sampler._argmax(logits), logits.argmax(dim=-1))
    assert sampler._argmax(logits)[2].item() == 17
    logits[6, 3] = float("nan")  # torch's rule: NaN is the maximum, the first one wins
    logits[6, 700] = float("nan")
    logits[7, 998] = float("nan")  # the last 16 columns
    logits[7, 999] = float("-nan")
    logits[8, 0] = float("inf")
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))
    assert kernels.argmax_rows(logits)[6].item() == 3
    assert torch.equal(sampler._argmax(logits), logits.argmax(dim=-1))


def _sampling_request(params):
    from engine.core.request import Request
    return Request("r", [1, 2, 3], params, eos_token_ids=[0])


def test_random_draws_follow_the_distribution_and_never_pick_masked_tokens():
    """Frequencies over many draws match softmax(logits / T) within a few standard
    errors; top-k-masked and zero-probability tokens are never drawn."""
    import torch

    from engine.executor.sampler import Sampler
    vocab = 64
    logits = torch.full((1, vocab), -1e4)
    logits[0, 6:10] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    want = torch.softmax(logits[0], dim=-1)
    params = SamplingParams(temperature=1.0, max_tokens=1)
    rows = 4000
    sampler = Sampler(vocab, seed=7)
    batch = logits.expand(rows, vocab).contiguous()
    drawn = torch.tensor(sampler(batch, [_sampling_request(params)] * rows).token_ids)
    freq = torch.bincount(drawn, minlength=vocab).double() / rows
    stderr = (want.double() * (1 - want.double()) / rows).sqrt()
    assert ((freq - want.double()).abs() <= 4 * stderr + 1e-9).all(), (freq[:12], want[:12])
    assert freq[:6].sum() == 0 and freq[10:].sum() == 0

    top2 = SamplingParams(temperature=1.0, top_k=2, max_tokens=1)
    drawn = sampler(batch, [_sampling_request(top2)] * rows).token_ids
    assert set(drawn) == {6, 7}  # both kept tokens appear, nothing else


def test_seeded_rows_repeat_and_unseeded_rows_vary():
    import torch

    from engine.executor.sampler import Sampler
    logits = torch.zeros(8, 32)  # uniform over 32 tokens
    sampler = Sampler(32, seed=0)

    def draw(seed):
        requests = [_sampling_request(SamplingParams(temperature=1.0, seed=seed, max_tokens=1))
                    for _ in range(8)]
        return sampler(logits, requests).token_ids

    assert draw(11) == draw(11)  # each row's generator is seeded alike: same draws
    assert len(set(draw(None))) > 1


def test_native_draws_equal_the_torch_path_at_the_same_uniforms(kernels):
    """kernels.sample_rows inverts the same CDF at the same uniform as the torch path:
    the same tokens row for row (temperatures, greedy and seeded rows mixed, masked
    tokens, a vocabulary that is no multiple of the kernel's chunk), and it never draws a
    token of -inf logit."""
    import torch

    from engine.executor.sampler import Sampler
    vocab, rows = 1037, 48
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[:, 500:900] = float("-inf")  # masked (bad words, grammar, allowed ids)
    logits[5, :] = float("-inf")
    logits[5, 1036] = 0.0  # only the last token is allowed
    temps = [0.0, 0.3, 1.0, 1.7] * (rows // 4)
    requests = [_sampling_request(SamplingParams(temperature=t, max_tokens=1,
                                                 seed=11 if i % 7 == 0 else None))
                for i, t in enumerate(temps)]
    native = Sampler(vocab, kernels.argmax_rows, seed=5, native_sample=kernels.sample_rows)
    torch_path = Sampler(vocab, kernels.argmax_rows, seed=5)
    for _ in range(5):
        for r in requests:
            if r.params.seed is not None:
                r.generator = torch.Generator().manual_seed(r.params.seed)
        got = native(logits.clone(), requests).token_ids
        for r in requests:
            if r.params.seed is not None:
                r.generator = torch.Generator().manual_seed(r.params.seed)
        want = torch_path(logits.clone(), requests).token_ids
        assert got == want
        assert got[5] == 1036 and not any(500 <= t < 900 for t in got)


def test_native_draws_follow_the_distribution(kernels):
    import torch

    from engine.executor.sampler import Sampler
    vocab, rows = 300, 6000
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, 250:254] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])) * 2  # T = 2 undoes it
    want = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    sampler = Sampler(vocab, seed=1, native_sample=kernels.sample_rows)
    drawn = sampler(logits, [_sampling_request(SamplingParams(temperature=2.0, max_tokens=1))]
                    * rows).token_ids
    counts = torch.bincount(torch.tensor(drawn), minlength=vocab)
    assert counts[250:254].sum().item() == rows  # nothing else has any weight
    freq = counts.double() / rows
    stderr = (want * (1 - want) / rows).sqrt()
    assert ((freq[250:254] - want).abs() <= 4 * stderr).all(), freq[250:254]
