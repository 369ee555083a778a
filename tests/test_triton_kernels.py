"""The Triton kernels (engine.model.triton_kernels) against plain-torch references.

Without a GPU they run under Triton's interpreter (conftest sets TRITON_INTERPRET=1
before anything imports triton), on CPU tensors in float32 and float16; with one they
run compiled on it, bf16 included. Shapes are tiny, lengths ragged, block tables
shuffled, with a prefix shared by two sequences and split-KV on and off.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM
from engine.model.layers import flex_paged
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.triton_kernels import availability, interpreting
from tests.conftest import hf_greedy
from tests.test_flex_attention import check_prefix_hits_and_n
from tests.test_parity import NEW_TOKENS, _greedy, _prompts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(availability(DEVICE) is not None,
                                reason=f"Triton kernels: {availability(DEVICE)}")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _tol(dtype):
    return dict(atol=TOL[dtype], rtol=TOL[dtype])


def _paged_case(seed: int, seqs: list[tuple[int, int]], shared_prefix: int, page: int,
                kv_heads: int, group: int, dim: int, dtype: torch.dtype):
    """A cache with shuffled pages holding garbage, sequences (context, new tokens) whose
    first two share `shared_prefix` tokens' pages (whole pages, as the prefix cache shares
    them), their queries, and each sequence's block table."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    cache = torch.randn(flex_paged.cache_shape(1, num_blocks, kv_heads, page, dim),
                        generator=gen)[0].to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    shared = [free.pop() for _ in range(shared_prefix // page)]
    for i, (ctx, n) in enumerate(seqs):
        pages = -(-(ctx + n) // page)
        own = shared if i < 2 and shared_prefix else []
        tables.append(own + [free.pop() for _ in range(pages - len(own))])
    tokens = sum(n for _, n in seqs)
    q = torch.randn(tokens, kv_heads * group, dim, generator=gen).to(dtype)
    return cache.to(DEVICE), q.to(DEVICE), tables


def _reference(q, k_cache, v_cache, page, seqs, tables, scale):
    """Dense float32 attention per query over its sequence's slots up to its position."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out, row = torch.empty(q.shape, dtype=torch.float32), 0
    for (ctx, n), table in zip(seqs, tables):
        slots = [table[p // page] * page + p % page for p in range(ctx + n)]
        keys = k_cache[:, slots].float().cpu().repeat_interleave(heads // kv_heads, 0)
        values = v_cache[:, slots].float().cpu().repeat_interleave(heads // kv_heads, 0)
        for j in range(n):
            p = ctx + j
            scores = torch.einsum("hd,hkd->hk", q[row].float().cpu(), keys[:, :p + 1]) * scale
            out[row] = torch.einsum("hk,hkd->hd", scores.softmax(-1), values[:, :p + 1])
            row += 1
    return out


def _launch(seqs, tables, block_q, splits, first=0):
    from engine.model.triton_kernels.paged_attention import AttentionLaunch
    tiles = [(s, j) for s, (_, n) in enumerate(seqs) for j in range(0, n, block_q)]
    starts = [first]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    as_int = dict(dtype=torch.int32, device=DEVICE)
    return AttentionLaunch(
        torch.tensor([s for s, _ in tiles], **as_int), torch.tensor([j for _, j in tiles],
                                                                    **as_int),
        torch.tensor(starts, **as_int), torch.tensor([c + n for c, n in seqs], **as_int),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], **as_int), block_q, splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kv_heads,group", [(2, 4), (1, 8), (4, 1)])  # GQA, MQA, MHA
def test_decode_attention_matches_dense(dtype, splits, kv_heads, group):
    """Single-token queries of ragged contexts (one longer than a split's share, one of a
    single key, two sharing a prefix), split-KV off and on."""
    from engine.model.triton_kernels.paged_attention import SplitScratch, attend
    page, dim = 16, 32
    seqs = [(40, 1), (47, 1), (0, 1), (130, 1), (15, 1)]
    cache, q, tables = _paged_case(splits, seqs, 32, page, kv_heads, group, dim, dtype)
    k_cache, v_cache = cache[0], cache[1]
    out = torch.full_like(q, float("nan"))
    scratch = SplitScratch.allocate(8, q.shape[1], dim, DEVICE)
    attend(q, k_cache, v_cache, out, _launch(seqs, tables, 1, splits), dim ** -0.5, page,
           16, scratch)
    ref = _reference(q, k_cache, v_cache, page, seqs, tables, dim ** -0.5)
    torch.testing.assert_close(out.float().cpu(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,block_q", [(16, 8), (32, 4)])
def test_prefill_attention_over_cached_context_matches_dense(dtype, page, block_q):
    """Prompt chunks fresh and after cached context (chunked prefill, a prefix-cache hit
    shared by two sequences), tiles cutting across pages and past a chunk's end, after a
    decode row (the launch's tokens start past it)."""
    from engine.model.triton_kernels.paged_attention import attend
    kv_heads, group, dim = 2, 2, 16
    seqs = [(32, 9), (32, 21), (0, 37), (75, 5)]
    cache, q, tables = _paged_case(7, [(0, 1)] + seqs, 32, page, kv_heads, group, dim, dtype)
    tables = tables[1:]
    k_cache, v_cache = cache[0], cache[1]
    out = torch.zeros_like(q)
    attend(q, k_cache, v_cache, out, _launch(seqs, tables, block_q, 1, first=1), 0.3, page, 16)
    ref = _reference(q[1:], k_cache, v_cache, page, seqs, tables, 0.3)
    torch.testing.assert_close(out[1:].float().cpu(), ref, **_tol(dtype))
    assert not out[0].any()  # the decode row is not the launch's


def _fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 cache holds it: x / scale saturated at +-448, in e4m3."""
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["decode", "decode-split", "prefill"])
def test_attention_over_an_fp8_cache_matches_dense(dtype, kind):
    """An e4m3 cache holding keys / k_scale and values / v_scale (k_scale small enough
    that the larger keys saturate at 448): the output equals dense attention over the
    cache's values times their scales, decodes (split-KV too) and prefill chunks."""
    from engine.model.triton_kernels.paged_attention import SplitScratch, attend
    page, kv_heads, group, dim = 16, 2, 4, 32
    seqs = ([(40, 1), (47, 1), (0, 1), (130, 1)] if kind != "prefill"
            else [(32, 9), (0, 21), (75, 5)])
    block_q, splits = {"decode": (1, 1), "decode-split": (1, 3), "prefill": (8, 1)}[kind]
    cache, q, tables = _paged_case(11, seqs, 32, page, kv_heads, group, dim, dtype)
    k_scale, v_scale = 0.006, 0.02
    k8, v8 = _fp8(cache[0] * 2, k_scale).to(DEVICE), _fp8(cache[1], v_scale).to(DEVICE)
    assert (k8.float().abs() == 448).any()  # some keys saturated
    out = torch.full_like(q, float("nan"))
    attend(q, k8, v8, out, _launch(seqs, tables, block_q, splits), 0.2, page, 16,
           SplitScratch.allocate(8, q.shape[1], dim, DEVICE), k_scale, v_scale)
    ref = _reference(q, k8.float() * k_scale, v8.float() * v_scale, page, seqs, tables, 0.2)
    torch.testing.assert_close(out.float().cpu(), ref, **_tol(dtype))


def test_e4m3_rounding_is_torch_s():
    """The cache write's own rounding to e4m3 (the interpreter's conversion is wrong where
    rounding carries into the exponent and on subnormals) gives torch's bytes for values
    across e4m3's range: subnormals, carries (124 -> 128), ties, +-448 and signed zeros."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2048, generator=gen) * s for s in (1e-3, 0.05, 1, 30, 300)]
                  + [torch.tensor([124., -124., 7.9, 0.0019, 464., -1000., -0.0, 2 ** -10,
                                   3 * 2 ** -11, 9.5 * 2 ** -9, 52.0, 56.0])])
    x = torch.cat([x, torch.zeros(16384 - x.numel())])
    got = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=DEVICE)
    from tests.triton_probes import e4m3_store_kernel
    e4m3_store_kernel[(1,)](x.to(DEVICE), got, N=x.numel())
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    bad = got.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not bad.any(), (x[bad][:8], got.cpu()[bad][:8], want[bad][:8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_into_an_fp8_cache(dtype):
    """The rotated k (rounded to the activation dtype) and v land as x / scale in e4m3,
    saturated: torch's own conversion, byte for byte (the quotient correctly rounded on
    a GPU too)."""
    from transformers import LlamaConfig

    from engine.model.triton_kernels.fused_ops import rope_write_kv
    heads, kv_heads, t, head_dim = 4, 2, 5, 32
    gen = torch.Generator().manual_seed(4)
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, 64)
    positions = torch.tensor([0, 5, 6, 33, 63])
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    cache = torch.zeros(2, kv_heads, 32, head_dim, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([9, 3, 30, 17, 0])
    got, cache = qkv.clone().to(DEVICE), cache.to(DEVICE)
    rope_write_kv(got, positions.to(DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
                  heads, kv_heads, head_dim, cache[0], cache[1], slots.to(DEVICE), 0.01, 0.5)
    got, cache = got.cpu(), cache.cpu()
    _, g_k, g_v = got.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    assert torch.equal(g_v, qkv[:, -kv_heads * head_dim:])  # v itself is not scaled
    for held, want, scale in ((cache[0], g_k, 0.01), (cache[1], g_v, 0.5)):
        want8 = _fp8(want.view(t, kv_heads, head_dim), scale)
        held = held[:, slots].transpose(0, 1)
        assert (want8.float().abs() == 448).any() or scale == 0.5
        assert torch.equal(held.view(torch.uint8), want8.view(torch.uint8))


def test_padded_decode_rows_write_zeros():
    """A captured batch's padding rows (no context) attend to nothing and read as 0."""
    from engine.model.triton_kernels.paged_attention import SplitScratch, attend
    seqs = [(9, 1), (0, 0)]
    cache, q, tables = _paged_case(3, [(9, 1), (0, 1)], 0, 16, 2, 2, 16, torch.float32)
    launch = _launch([(9, 1), (0, 1)], tables, 1, 2)
    launch.seq_lens[1] = 0
    out = torch.full_like(q, float("nan"))
    attend(q, cache[0], cache[1], out, launch, 0.25, 16, 16,
           SplitScratch.allocate(2, q.shape[1], 16, DEVICE))
    ref = _reference(q[:1], cache[0], cache[1], 16, seqs[:1], tables[:1], 0.25)
    torch.testing.assert_close(out[:1].cpu(), ref, **_tol(torch.float32))
    assert (out[1] == 0).all()


def test_graph_batch_matches_the_eager_step():
    """A captured decode batch's launch (graph_step: the static int64 buffers, rows padded
    with the scratch page and no context, splits fixed by the table width) gives the
    eager step's output for the real rows and zeros for the padding."""
    from engine.model.layers.triton_paged import TritonPagedAttention
    from engine.model.triton_kernels.paged_attention import attend
    seqs = [(40, 1), (3, 1), (90, 1)]
    cache, q, tables = _paged_case(5, seqs, 32, 8, 2, 2, 16, torch.float32)
    k_cache, v_cache = cache[0], cache[1]
    backend = TritonPagedAttention(8, 4, 2, 16, 8, DEVICE, sm_count=16)  # splits at 4 rows
    eager = backend.step([1] * 3, [c + n for c, n in seqs], tables, 3)
    arrays = [eager.decode.tile_seq, eager.decode.tile_q, eager.decode.query_start,
              eager.decode.seq_lens, eager.decode.block_tables]
    assert all(a.data_ptr() % 16 == 0 for a in arrays)  # no kernel variant per offset
    want = torch.zeros_like(q)
    attend(q, k_cache, v_cache, want, eager.decode, 0.25, 8, 16, backend.scratch)
    scratch_page, width = 63, 16  # the graphs' width: every table as long as the longest
    padded = [t + [scratch_page] * (width - len(t)) for t in tables] + [[scratch_page] * width]
    lens = torch.tensor([c + n for c, n in seqs] + [0], device=DEVICE)
    graph = backend.graph_step(4, lens, torch.tensor(padded, device=DEVICE))
    assert graph.decode.num_splits == backend.num_splits(4, width * 8) > 1
    got = torch.full((4, *q.shape[1:]), float("nan"), device=DEVICE)
    attend(torch.cat([q, torch.ones_like(q[:1])]), k_cache, v_cache, got, graph.decode,
           0.25, 8, 16, backend.scratch)
    torch.testing.assert_close(got[:3], want, **_tol(torch.float32))
    assert (got[3] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(dtype):
    from engine.model.layers.norm import RMSNorm
    from engine.model.triton_kernels.fused_ops import TritonLayerOps, rms_norm
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 96, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    norm = RMSNorm(96, 1e-6).to(DEVICE, dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype).to(DEVICE)
    want, want_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), **_tol(dtype))
    got_x, got_residual = x.clone(), residual.clone()
    TritonLayerOps.fused_add_rms_norm(got_x, got_residual, norm.weight, 1e-6)
    torch.testing.assert_close(got_residual, want_residual, **_tol(dtype))
    torch.testing.assert_close(got_x, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: a half that is not a power of two
def test_rope_and_cache_write_match_torch(dtype, head_dim):
    """q and k heads rotated in place inside the fused qkv rows, as apply_rotary does;
    k and v land in their (shuffled) slots; v and other slots untouched."""
    from transformers import LlamaConfig

    from engine.model.layers.rotary import apply_rotary
    from engine.model.triton_kernels.fused_ops import rope_write_kv
    heads, kv_heads, t = 4, 2, 6
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, 64)
    positions = torch.tensor([0, 5, 6, 7, 33, 63])
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    rope = rotary.lookup(positions, torch.float32)
    want_q, want_k = apply_rotary(q.float().view(t, heads, head_dim),
                                  k.float().view(t, kv_heads, head_dim), rope.cos, rope.sin)
    cache = torch.zeros(2, kv_heads, 8 * 4, head_dim, dtype=dtype)
    slots = torch.tensor([9, 3, 30, 17, 0, 22])
    got = qkv.clone().to(DEVICE)
    cache = cache.to(DEVICE)
    rope_write_kv(got, positions.to(DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
                  heads, kv_heads, head_dim, cache[0], cache[1], slots.to(DEVICE))
    got, cache = got.cpu(), cache.cpu()
    g_q, g_k, g_v = got.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    torch.testing.assert_close(g_q.float().view(t, heads, head_dim), want_q, **_tol(dtype))
    torch.testing.assert_close(g_k.float().view(t, kv_heads, head_dim), want_k, **_tol(dtype))
    assert torch.equal(g_v, v)
    torch.testing.assert_close(cache[0][:, slots].transpose(0, 1), g_k.view(t, kv_heads, -1))
    assert torch.equal(cache[1][:, slots].transpose(0, 1), v.view(t, kv_heads, -1))
    untouched = torch.ones(cache.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert not cache[:, :, untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    from engine.model.triton_kernels.fused_ops import silu_and_mul
    x = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(2)).to(dtype)
    gate, up = x.float().split(1100, -1)
    want = (torch.nn.functional.silu(gate).to(dtype).float() * up)
    torch.testing.assert_close(silu_and_mul(x.to(DEVICE)).float().cpu(), want, **_tol(dtype))


def test_split_counts_follow_the_batch():
    """Few rows get segments until the device is busy (132 SMs x 4 programs), capped by
    the key tiles and MAX_SPLITS; a batch that fills the device gets none, and the
    scratch holds only the rows that split."""
    from engine.model.layers.triton_paged import BLOCK_N, TritonPagedAttention
    backend = TritonPagedAttention(16, 32, 8, 32, 256, torch.device("cpu"), sm_count=132)
    assert backend.num_splits(1, 100 * BLOCK_N) == 16
    assert backend.num_splits(1, 3 * BLOCK_N) == 2  # 3 key tiles, rounded to a power of 2
    assert backend.num_splits(16, 100 * BLOCK_N) == 4  # 128 programs: 528 / 128 -> 5 -> 4
    assert backend.num_splits(64, 100 * BLOCK_N) == 2
    assert backend.num_splits(66, 100 * BLOCK_N) == 1
    assert backend.num_splits(256, 100 * BLOCK_N) == 1
    assert backend.scratch.out.shape[0] == 66


@pytest.mark.skipif(DEVICE.type != "cpu" or not interpreting(), reason="interpreter run")
def test_triton_engine_matches_hf_with_chunks_prefix_hits_and_preemption(tiny_llama):
    """The engine on attention_backend triton (every layer's rotary, cache writes,
    attention, norms and SiLU in Triton under the interpreter): chunked prefill,
    split-KV decodes, prefix-cache hits, n = 2 and preemption give HF's greedy tokens."""
    prompts = _prompts([17, 17, 70, 5, 33])
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=48, block_size=8,
              attention_backend="triton", num_gpu_blocks_override=24, device="cpu")
    runner = llm.llm_engine.engine_core.runner
    assert runner.attention.name == "triton"
    assert _greedy(llm, prompts) == hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_prefix_hits_and_n(llm, tiny_llama, prompts[2][:40])


@pytest.mark.skipif(DEVICE.type != "cpu" or not interpreting(), reason="interpreter run")
def test_triton_engine_matches_hf_for_qwen3(tiny_models):
    """Qwen3's q / k norms run before the fused rotary + cache write."""
    prompts = _prompts([9, 30])
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", block_size=8, device="cpu",
              attention_backend="triton")
    assert _greedy(llm, prompts, 8) == hf_greedy(tiny_models["qwen3"], prompts, 8)


def test_triton_backend_refused_without_the_interpreter_on_cpu(tiny_llama, monkeypatch):
    from engine.errors import InvalidRequestError
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidRequestError, match="TRITON_INTERPRET"):
        LLM(str(tiny_llama), dtype="float32", attention_backend="triton", device="cpu")


# ---- compiled for the GPU, without one ------------------------------------------------
# Triton compiles to a Hopper cubin on the CPU (its bundled ptxas), so errors that only a
# real compile shows (tl.dot shapes, types, shared memory) are caught here, not on a
# lease. The compiler cannot run where TRITON_INTERPRET is set: a child process does it.

@pytest.mark.skipif(DEVICE.type == "cuda", reason="compiled for real by the tests above")
def test_kernels_compile_for_hopper():
    """Every kernel at the engine's launch shapes (Llama 3.1 8B and 3.2 1B heads, block
    16, bf16 and fp16, decode with and without splits, prefill; gpt-oss's sinks) compiles to an sm_90
    cubin within the SM's shared memory."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.triton_aot", "90"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(built) == 26  # gpt-oss's sink variants included
    for name, shared in built.items():
        assert shared <= 227 * 1024, (name, shared)
