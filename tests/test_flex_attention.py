"""FlexAttention paged attention (the CUDA engine's path), run here through PyTorch's
eager reference: the same masks and page maps the compiled kernel gets."""
import random
import warnings

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.layers import flex_paged
from tests.conftest import hf_greedy
from tests.test_parity import NEW_TOKENS, _greedy, _prompts

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def _reference(q, k_cache, v_cache, block_size, seqs, tables):
    """Dense attention per query over its sequence's slots, read through the table."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out, row = torch.empty_like(q), 0
    for (ctx, n), table in zip(seqs, tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx + n)]
        keys = k_cache[0][:, slots].repeat_interleave(heads // kv_heads, 0)
        values = v_cache[0][:, slots].repeat_interleave(heads // kv_heads, 0)
        for j in range(n):
            p = ctx + j
            scores = torch.einsum("hd,hkd->hk", q[row], keys[:, :p + 1]) * q.shape[-1] ** -0.5
            out[row] = torch.einsum("hk,hkd->hd", scores.softmax(-1), values[:, :p + 1])
            row += 1
    return out


@pytest.mark.parametrize("seed,pad,per_chunk", [(0, 0, False), (1, 0, False), (2, 0, True),
                                                (3, 8, True)])
def test_flex_paged_attention_matches_dense(seed, pad, per_chunk):
    """Decodes and prefill chunks (fresh, after context, spanning pages) over shuffled
    pages whose unused slots hold garbage: each query sees exactly its sequence's
    positions up to its own. pad: decode rows padded to that many, block tables to a
    fixed width (the compiled decode shapes). per_chunk: a call per prefill chunk, as on
    CUDA, where the chunk without context goes to SDPA."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks, bs, kv_heads, heads, dim = 48, 8, 2, 4, 16
    cache = torch.randn(flex_paged.cache_shape(1, num_blocks, kv_heads, bs, dim))
    k_cache, v_cache = flex_paged.cache_views(cache[0])
    seqs = [(5, 1), (33, 1), (15, 1), (0, 20), (16, 7), (40, 30), (3, 1)]
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # decodes first, as the runner orders them
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for ctx, n in seqs:
        table = [free.pop() for _ in range(-(-(ctx + n) // bs))]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + n)]
    t = len(slots)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(
        t, kv_heads, dim)
    flex_paged.write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    slot_pos = torch.full((k_cache.shape[2],), 2 ** 31 - 1, dtype=torch.int32)
    positions = torch.tensor([p for c, n in seqs for p in range(c, c + n)])
    flex_paged.write_positions(slot_pos, torch.tensor(slots), positions, bs)
    decodes = sum(1 for _, n in seqs if n == 1)
    qlens = [n for _, n in seqs]
    slens = [c + n for c, n in seqs]
    cpu = torch.device("cpu")
    groups = [flex_paged.build_group(0, qlens[:decodes], slens[:decodes], tables[:decodes],
                                     num_blocks, bs, cpu, width=12 if pad else None,
                                     pad_rows=pad)]
    spans = [(i, i + 1) for i in range(decodes, len(seqs))] if per_chunk else [
        (decodes, len(seqs))]
    for lo, hi in spans:
        groups.append(flex_paged.build_group(sum(qlens[:lo]), qlens[lo:hi], slens[lo:hi],
                                             tables[lo:hi], num_blocks, bs, cpu))
    assert any(g.fresh for g in groups) == per_chunk
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_paged.FlexPagedAttention(False, bs)(q, k, v, k_cache, v_cache, slot_pos,
                                                       groups, dim ** -0.5)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, bs, seqs, tables))


def test_page_map_marks_only_each_rows_pages():
    logical = torch.empty(2, 7, dtype=torch.int16)
    tables = torch.tensor([[4, 1, 6], [2, 6, 6]])  # row 1 padded with the scratch page 6
    flex_paged.fill_logical(logical, tables, scratch=6)
    assert logical.tolist() == [[-1, 1, -1, -1, 0, -1, -1], [-1, -1, 0, -1, -1, -1, -1]]


def test_flex_engine_matches_hf_with_chunks_prefix_hits_and_preemption(tiny_llama):
    """The engine on attention_backend flex: chunked prefill, prefix-cache hits, n > 1
    and preemption give HF's greedy tokens."""
    prompts = _prompts([17, 17, 70, 5, 33])
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=48, block_size=8,
              attention_backend="flex", num_gpu_blocks_override=24, device="cpu")
    runner = llm.llm_engine.engine_core.runner
    assert runner.attention.name == "flex"
    runner.attention.flex.pad_decodes = True  # as on CUDA: decode batches padded to static shapes
    assert _greedy(llm, prompts) == hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_prefix_hits_and_n(llm, tiny_llama, prompts[2][:40])


def check_prefix_hits_and_n(llm, model_dir, prefix: list[int]) -> None:
    """Two prompts sharing `prefix` (cached by now), n = 2 each: HF's greedy tokens twice."""
    shared = [prefix + p for p in _prompts([6, 11], seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    out = llm.generate(shared, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in out)
    expected = hf_greedy(model_dir, shared, NEW_TOKENS)
    assert [[c.token_ids for c in o.outputs] for o in out] == [[e, e] for e in expected]


def test_native_backend_needs_the_cpu_kernels(tiny_llama, monkeypatch):
    import engine.executor.model_runner
    from engine.errors import InvalidRequestError
    monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
    with pytest.raises(InvalidRequestError, match="native"):
        LLM(str(tiny_llama), dtype="float32", attention_backend="native")
