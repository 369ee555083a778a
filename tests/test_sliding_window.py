"""Sliding-window attention (issue 43): the native kernel and the Triton kernel against
dense windowed attention, never reading blocks before a window; the KV cache manager
giving back blocks that slid out of every layer's window; a Mistral with a small window
equal to transformers through chunked prefill, prefix hits, n=2 and preemption, with the
blocks a sequence holds bounded by its window."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from tests.conftest import build_tiny_model
from tests.family_checks import (check_chunked_prefill_and_prefix_hit, check_n2_and_preemption,
                                 with_config)
from tests.test_attention import _each_bf16_kernel, _native, _problem, _reference
from tests.test_parity import _prompts

WINDOW = 20  # the tiny Mistral's: shorter than most test sequences


def _poison_slid_out(kc, vc, tables, lens, starts, window, bs):
    """A cache one block longer, that block NaN, and each sequence's table naming it for
    the blocks wholly before its first row's window (as freed blocks name the null one)."""
    poison = kc.shape[1]
    nan = torch.full_like(kc[:, :1], float("nan"))
    kc, vc, tables = torch.cat([kc, nan], 1), torch.cat([vc, nan], 1), tables.clone()
    for s in range(len(lens)):
        first_row_end = int(lens[s]) - int(starts[s + 1] - starts[s]) + 1
        for b in range(max(0, first_row_end - window) // bs):
            tables[s, b] = poison
    return kc, vc, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(8, 2, 64, 16), (6, 6, 128, 16), (4, 2, 16, 8)])
@pytest.mark.parametrize("window", [1, 40])  # a single key; past two blocks of 16
def test_native_kernel_attends_within_the_window(kernels, dtype, heads, kv_heads, d, bs,
                                                 window):
    """Decodes, a fresh prompt, chunks after cached context: each row sees its last
    `window` keys; blocks wholly before a sequence's windows hold NaN and are not read."""
    lens = [90, 7, 64, 70, 1, 33]
    query_lens = [1, 1, 64, 21, 1, 33]
    width = max(-(-n // bs) for n in lens)
    q, kc, vc, tables, lens, starts = _problem(dtype, heads, kv_heads, d, bs, 90, width,
                                               lens, query_lens, seed=5)
    expected = _reference(q, kc, vc, tables, lens, starts, d ** -0.5, window)
    kc, vc, tables = _poison_slid_out(kc, vc, tables, lens, starts, window, bs)
    kc_t = kc.transpose(2, 3).contiguous()
    for name in _each_bf16_kernel(kernels, dtype):
        got = _native_windowed(kernels, q, kc_t, vc, tables, lens, starts, d ** -0.5, window)
        assert torch.isfinite(got).all(), name
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:
            err = (got.float() - expected).abs()
            assert (err <= expected.abs() * 2 ** -8 + 1e-3).all(), (name, err.max())


def _native_windowed(kernels, q, kc_t, vc, tables, lens, starts, scale, window):
    call = kernels.paged_attention
    try:
        kernels.paged_attention = lambda *a: call(*a, 1.0, 1.0, window)
        return _native(kernels, q, kc_t, vc, tables, lens, starts, scale)
    finally:
        kernels.paged_attention = call


def test_native_kernel_window_of_zero_is_full_attention(kernels):
    lens, query_lens = [50, 33], [1, 33]
    q, kc, vc, tables, lens, starts = _problem(torch.float32, 4, 2, 64, 16, 20, 4, lens,
                                               query_lens)
    kc_t = kc.transpose(2, 3).contiguous()
    full = _native(kernels, q, kc_t, vc, tables, lens, starts, 0.125)
    windowed = _native_windowed(kernels, q, kc_t, vc, tables, lens, starts, 0.125, 0)
    assert torch.equal(full, windowed)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        _native_windowed(kernels, q, kc_t, vc, tables, lens, starts, 0.125, -1)


@pytest.mark.parametrize("splits,block_q", [(1, 1), (3, 1), (1, 8)])
def test_triton_kernel_attends_within_the_window(splits, block_q):
    """The Triton kernel (interpreted on CPU): decodes with split-KV and prefill tiles,
    pages wholly before a tile's window NaN and unread."""
    from engine.model.triton_kernels import availability
    from tests.test_triton_kernels import DEVICE, _launch, _paged_case
    if availability(DEVICE) is not None:
        pytest.skip(f"Triton kernels: {availability(DEVICE)}")
    from engine.model.triton_kernels.paged_attention import SplitScratch, attend
    page, dim, window, kv_heads, group = 16, 32, 21, 2, 2
    seqs = [(40, 1), (100, 1), (0, 1), (130, 1)] if block_q == 1 else [(32, 9), (0, 37),
                                                                       (75, 5)]
    cache, q, tables = _paged_case(splits, seqs, 0, page, kv_heads, group, dim,
                                   torch.float32)
    k_cache, v_cache = cache[0], cache[1]
    ref = _windowed_paged_reference(q, k_cache, v_cache, page, seqs, tables, 0.3, window)
    poisoned = [list(t) for t in tables]
    used = {p for t in tables for p in t}
    spare = next(p for p in range(k_cache.shape[1]) if p not in used)
    k_cache[:, spare * page:(spare + 1) * page] = float("nan")
    v_cache[:, spare * page:(spare + 1) * page] = float("nan")
    for t, (ctx, _) in zip(poisoned, seqs):
        for b in range(max(0, ctx + 1 - window) // page):
            t[b] = spare
    out = torch.zeros_like(q)
    scratch = SplitScratch.allocate(8, q.shape[1], dim, DEVICE)
    attend(q, k_cache, v_cache, out, _launch(seqs, poisoned, block_q, splits), 0.3, page, 16,
           scratch, window=window)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-5, rtol=2e-5)


def _windowed_paged_reference(q, k_cache, v_cache, page, seqs, tables, scale, window):
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out, row = torch.empty(q.shape, dtype=torch.float32), 0
    for (ctx, n), table in zip(seqs, tables):
        slots = [table[p // page] * page + p % page for p in range(ctx + n)]
        keys = k_cache[:, slots].float().repeat_interleave(heads // kv_heads, 0)
        values = v_cache[:, slots].float().repeat_interleave(heads // kv_heads, 0)
        for j in range(n):
            p = ctx + j
            lo = max(0, p + 1 - window)
            scores = torch.einsum("hd,hkd->hk", q[row].float(), keys[:, lo:p + 1]) * scale
            out[row] = torch.einsum("hk,hkd->hd", scores.softmax(-1), values[:, lo:p + 1])
            row += 1
    return out


def _request(n_tokens: int) -> Request:
    return Request("r", list(range(1, n_tokens + 1)),
                   SamplingParams(max_tokens=1), eos_token_ids=())


def test_kv_manager_gives_back_blocks_that_slid_out_of_the_window():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True, windows=6)
    assert kv.null_block == 11 and kv.num_free_blocks == 11
    req = _request(30)
    assert kv.allocate(req, 30)
    assert len(req.block_ids) == 8
    req.num_computed_tokens = 30  # the next query is at position 30: it sees 25..30
    assert kv.free_slid_out(req) == 6  # blocks 0..5 hold positions 0..23
    assert req.block_ids[:6] == [kv.null_block] * 6 and kv.null_block not in req.block_ids[6:]
    assert kv.num_free_blocks == 11 - 2
    assert kv.free_slid_out(req) == 0  # idempotent
    kv.free_request(req)
    assert kv.num_free_blocks == 11 and req.num_freed_blocks == 0
    # the given-back blocks kept their hashes: the same prompt hits the whole prefix
    again = _request(30)
    assert kv.hit_tokens(kv.find_cached_prefix(again)) == 7 * 4


def test_kv_manager_without_a_window_keeps_every_block():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    req = _request(30)
    kv.allocate(req, 30)
    req.num_computed_tokens = 30
    assert kv.free_slid_out(req) == 0 and kv.null_block == -1 and kv.num_free_blocks == 4


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, tiny_tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", tiny_tokenizer_dir,
                            sliding_window=WINDOW)


def test_mistral_window_matches_hf_with_chunks_and_prefix_hits(tiny_mistral):
    model = check_chunked_prefill_and_prefix_hit(tiny_mistral)
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, WINDOW]


def test_mistral_window_on_the_torch_path_matches_hf(tiny_mistral):
    check_chunked_prefill_and_prefix_hit(tiny_mistral, attention_backend="torch")


def test_mistral_window_with_n2_and_preemption_matches_hf(tiny_mistral, tmp_path):
    """A 48-token window: sequences grow from their prompts' 4-5 blocks to 7, so 16 blocks
    preempt some (whose block tables then hold the null block) and they are recomputed."""
    check_n2_and_preemption(with_config(tiny_mistral, tmp_path / "w48", sliding_window=48),
                            blocks=16)


def test_blocks_a_sequence_holds_are_bounded_by_the_window(tiny_mistral):
    """A 150-token sequence in a pool of 10 blocks of 8 tokens: without giving back
    slid-out blocks it could not fit (19 blocks); it holds at most the window's blocks
    plus the ones its step writes."""
    llm = LLM(str(tiny_mistral), dtype="float32", block_size=8, num_gpu_blocks_override=10,
              max_num_batched_tokens=16, max_model_len=256)
    core = llm.llm_engine.engine_core
    held: list[int] = []
    schedule = core.scheduler.schedule

    def watch():
        out = schedule()
        held.extend(sum(b != core.kv.null_block for b in r.block_ids) for r in out.requests)
        return out
    core.scheduler.schedule = watch
    try:
        prompt = _prompts([40])[0]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=110,
                                                    ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 110
        assert core.max_model_len == 256  # not cut to the pool's 80 tokens
        assert core.scheduler.num_preemptions == 0
        # the window's 20 keys span at most 4 blocks of 8, plus a 16-token chunk's 2
        assert max(held) <= -(-WINDOW // 8) + 1 + 2, max(held)
        assert core.kv.num_free_blocks == core.kv.usable_blocks  # all back at the end
    finally:
        llm.shutdown()
