"""Paged attention: the native CPU kernel and the torch path agree with plain attention."""
import pytest
import torch

from engine.model.attention.block_major import cache_views
from engine.model.attention.torch_sdpa import TorchMetadata, _decode_attention
from tests.conftest import amx_granted_here


def _reference(q, kc, vc, tables, lens, starts, scale, window=0, lse=False):
    """Dense causal attention of each query row over its sequence's gathered context
    (kv heads repeated); kc, vc: [KVH, blocks, bs, D]; row j of a sequence's n rows is
    its token ctx - n + j and sees keys 0 .. ctx - n + j, or only the last `window` of
    them. lse: each row's log-sum-exp of its scores [T, H] instead."""
    kvh, _, bs, d = kc.shape
    group = q.shape[1] // kvh
    outs = []
    for s in range(len(lens)):
        ctx, rows = int(lens[s]), range(int(starts[s]), int(starts[s + 1]))
        k = kc[:, tables[s]].reshape(kvh, -1, d)[:, :ctx].float().repeat_interleave(group, 0)
        v = vc[:, tables[s]].reshape(kvh, -1, d)[:, :ctx].float().repeat_interleave(group, 0)
        for j, r in enumerate(rows):
            seen = ctx - len(rows) + j + 1
            lo = max(0, seen - window) if window else 0
            scores = (q[r].float().unsqueeze(1) @ k[:, lo:seen].transpose(1, 2)) * scale
            if lse:
                outs.append(torch.logsumexp(scores.squeeze(1), dim=-1))
                continue
            outs.append((torch.softmax(scores, dim=-1) @ v[:, lo:seen]).squeeze(1))
    return torch.stack(outs)


def _native(kernels, q, kc_t, vc, tables, lens, starts, scale):
    """The kernel over a pre-filled cache: each row's "new" key and value are the ones
    already in its slot, so the cache is rewritten with what it holds."""
    bs = kc_t.shape[3]
    slots = []
    for s in range(len(lens)):
        n, ctx = int(starts[s + 1] - starts[s]), int(lens[s])
        slots += [int(tables[s][p // bs]) * bs + p % bs for p in range(ctx - n, ctx)]
    slots = torch.tensor(slots, dtype=torch.long)
    blocks, offsets = slots // bs, slots % bs
    k = kc_t.permute(1, 3, 0, 2)[blocks, offsets].contiguous()  # [T, KVH, D]
    v = vc.permute(1, 2, 0, 3)[blocks, offsets].contiguous()
    return kernels.paged_attention(q, k, v, kc_t, vc, slots, tables, lens, starts, scale)


def _problem(dtype, heads, kv_heads, d, bs, blocks, width, lens, query_lens, seed=0):
    torch.manual_seed(seed)
    kc = torch.randn(kv_heads, blocks, bs, d).to(dtype)
    vc = torch.randn(kv_heads, blocks, bs, d).to(dtype)
    lens = torch.tensor(lens)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    q = (2 * torch.randn(int(starts[-1]), heads, d)).to(dtype)
    tables = torch.randperm(blocks)[:len(lens) * width].view(len(lens), width)
    return q, kc, vc, tables, lens, starts


def _each_bf16_kernel(kernels, dtype):
    """For bf16: every attention kernel this build has (on AVX512_BF16 CPUs both the
    vdpbf16ps one and the widening-FMA one, whichever the CPU measured faster), each
    forced in turn; the measured choice is restored afterwards."""
    if dtype != torch.bfloat16:
        yield None
        return
    chosen = kernels.attention_bf16_kernel()
    names = [n for n in ("dpbf16", "fma") if kernels.set_attention_bf16_kernel(n)] or [chosen]
    try:
        for name in names:
            if name in ("dpbf16", "fma"):
                kernels.set_attention_bf16_kernel(name)
            assert kernels.attention_bf16_kernel() == name
            yield name
    finally:
        if chosen in ("dpbf16", "fma"):
            kernels.set_attention_bf16_kernel(chosen)


def _each_prefill_kernel(kernels, dtype):
    """For bf16: "amx" (tile products for chunks of 8 or more rows) where this build and
    CPU run it, and "rows" (the per-row kernels), each forced in turn; the choice is
    restored afterwards."""
    if dtype != torch.bfloat16:
        yield None
        return
    chosen = kernels.attention_prefill_kernel()
    names = [n for n in ("amx", "rows") if kernels.set_attention_prefill_kernel(n)]
    try:
        for name in names:
            kernels.set_attention_prefill_kernel(name)
            assert kernels.attention_prefill_kernel() == name
            yield name
    finally:
        kernels.set_attention_prefill_kernel(chosen)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_paths_match_dense_attention(kernels, dtype, tol, heads, kv_heads):
    seqs, d, bs, blocks, width = 5, 64, 16, 40, 6
    if heads == 4:
        d, bs, blocks, width = 16, 8, 80, 12  # the kernel takes any head and block size
    lens = [1, 17, 96, 33, 64]
    q, kc, vc, tables, lens, starts = _problem(dtype, heads, kv_heads, d, bs, blocks, width,
                                               lens, [1] * seqs)
    expected = _reference(q, kc, vc, tables, lens, starts, 0.125)
    kc_t = kc.transpose(2, 3).contiguous()  # the cache stores key blocks transposed

    span = torch.arange(width * bs)
    bias = torch.zeros(seqs, width * bs).masked_fill_(span[None] >= lens[:, None], float("-inf"))
    torch_path = TorchMetadata(None, seqs, tables, lens, decode_bias=bias)
    got = _decode_attention(q, kc_t, vc, torch_path, 0.125).float()
    assert torch.allclose(got, expected, atol=tol, rtol=tol)

    for name in _each_bf16_kernel(kernels, dtype):
        got = _native(kernels, q, kc_t, vc, tables, lens, starts, 0.125).float()
        assert torch.allclose(got, expected, atol=tol, rtol=tol), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (8, 1, 64, 16),
                                                 (16, 2, 128, 16), (6, 6, 128, 16),
                                                 (4, 2, 16, 8)])
@pytest.mark.parametrize("block_major", [False, True])
def test_native_kernel_attends_decodes_and_prefill_chunks_causally(kernels, dtype, heads, kv_heads,
                                                                   d, bs, block_major):
    """One call, a mixed batch: two decodes, a fresh prompt, a chunk after cached context
    (chunked prefill / prefix hit), a one-token prompt, an odd-length prompt; caches
    head-major (contiguous) or block-major (the engine's strided views)."""
    lens = [40, 7, 64, 70, 1, 33]
    query_lens = [1, 1, 64, 21, 1, 33]
    width = max(-(-n // bs) for n in lens)
    q, kc, vc, tables, lens, starts = _problem(dtype, heads, kv_heads, d, bs, 90, width,
                                               lens, query_lens, seed=3)
    expected = _reference(q, kc, vc, tables, lens, starts, d ** -0.5)
    kc_t, vc_in = kc.transpose(2, 3).contiguous(), vc
    if block_major:
        cache = torch.empty(kc.shape[1], 2, kv_heads, bs, d, dtype=dtype)
        kc_t, vc_in = cache_views(cache)
        kc_t.copy_(kc.transpose(2, 3))
        vc_in.copy_(vc)
        assert not kc_t.is_contiguous() and not vc_in.is_contiguous()
    for prefill in _each_prefill_kernel(kernels, dtype):
        for name in _each_bf16_kernel(kernels, dtype):
            got = _native(kernels, q, kc_t, vc_in, tables, lens, starts, d ** -0.5)
            if dtype == torch.float32:
                assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
            else:  # float32 math inside: within one bf16 rounding of the exact result
                err = (got.float() - expected).abs()
                assert (err <= expected.abs() * 2 ** -8 + 1e-3).all(), (prefill, name, err.max())


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (16, 2, 128), (8, 8, 64)])
def test_prefill_chunks_of_every_shape_match_dense_attention(kernels, heads, kv_heads, d):
    """Chunks the AMX kernel tiles in 16-row items over pairs of 16-key blocks: lengths
    off every boundary (7 rows stay per-row, 8 go to tiles), chunks after cached context
    ending mid-block and mid-pair, two chunks of one sequence's size in one step, NaN in
    every slot past a context, and a second call that reuses the threads' scratch."""
    query_lens = [7, 8, 17, 33, 100, 16, 1]
    lens = [7, 8, 40, 33, 130, 61, 90]
    width = max(-(-n // 16) for n in lens) + 1
    q, kc, vc, tables, lens, starts = _problem(torch.bfloat16, heads, kv_heads, d, 16, 80,
                                               width, lens, query_lens, seed=11)
    for s, n in enumerate(lens.tolist()):  # poison every slot past each length
        flat_k = kc[:, tables[s]].reshape(kv_heads, -1, d)
        flat_v = vc[:, tables[s]].reshape(kv_heads, -1, d)
        flat_k[:, n:] = float("nan")
        flat_v[:, n:] = float("nan")
        kc[:, tables[s]] = flat_k.view(kv_heads, -1, 16, d)
        vc[:, tables[s]] = flat_v.view(kv_heads, -1, 16, d)
    expected = _reference(q, kc, vc, tables, lens, starts, d ** -0.5)
    kc_t = kc.transpose(2, 3).contiguous()
    for prefill in _each_prefill_kernel(kernels, torch.bfloat16):
        for _ in range(2):
            got = _native(kernels, q, kc_t, vc, tables, lens, starts, d ** -0.5).float()
            err = (got - expected).abs()
            assert not got.isnan().any(), prefill
            assert (err <= expected.abs() * 2 ** -8 + 1e-3).all(), (prefill, err.max())


def test_bf16_prefill_chunks_run_on_amx_where_the_cpu_has_it(kernels):
    chosen = kernels.attention_prefill_kernel()
    amx = amx_granted_here() and kernels.isa == "avx512"
    assert chosen == ("amx" if amx else "rows")
    assert kernels.set_attention_prefill_kernel("amx") == amx
    assert kernels.set_attention_prefill_kernel("rows")
    assert kernels.attention_prefill_kernel() == "rows"
    with pytest.raises(RuntimeError, match="amx or rows"):
        kernels.set_attention_prefill_kernel("tiles")
    kernels.set_attention_prefill_kernel(chosen)
    assert kernels.attention_prefill_kernel() == chosen


def test_native_kernel_ignores_garbage_past_the_context(kernels):
    """Cache slots past a sequence's length may hold anything (NaN included)."""
    q, kc, vc, tables, lens, starts = _problem(torch.bfloat16, 9, 3, 64, 16, 20, 3,
                                               [17, 35], [1, 3], seed=5)
    expected = _reference(q, kc, vc, tables, lens, starts, 0.125)
    for s, n in enumerate(lens.tolist()):  # poison every slot past each length
        flat_k = kc[:, tables[s]].reshape(3, -1, 64)
        flat_v = vc[:, tables[s]].reshape(3, -1, 64)
        flat_k[:, n:] = float("nan")
        flat_v[:, n:] = float("nan")
        kc[:, tables[s]] = flat_k.view(3, -1, 16, 64)
        vc[:, tables[s]] = flat_v.view(3, -1, 16, 64)
    got = _native(kernels, q, kc.transpose(2, 3).contiguous(), vc, tables, lens, starts, 0.125)
    assert not got.isnan().any()
    assert torch.allclose(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_the_bf16_kernel_is_chosen_and_can_be_forced(kernels):
    chosen = kernels.attention_bf16_kernel()
    assert chosen in ({"dpbf16", "fma"} if kernels.isa == "avx512" else {"vec"})
    with pytest.raises(RuntimeError, match="dpbf16 or fma"):
        kernels.set_attention_bf16_kernel("amx")
    assert kernels.attention_bf16_kernel() == chosen


def test_native_kernel_rejects_inconsistent_row_offsets(kernels):
    q, kc, vc, tables, lens, starts = _problem(torch.float32, 2, 1, 16, 8, 10, 2, [5], [3])
    kc_t = kc.transpose(2, 3).contiguous()
    k = v = torch.zeros(3, 1, 16)
    slots = torch.tensor([2, 3, 4])
    with pytest.raises(RuntimeError, match="query_start"):
        kernels.paged_attention(q, k, v, kc_t, vc, slots, tables, lens, torch.tensor([0, 2]),
                                   0.25)
    with pytest.raises(RuntimeError, match="context length"):
        kernels.paged_attention(q, k, v, kc_t, vc, slots, tables, torch.tensor([40]), starts,
                                   0.25)
    with pytest.raises(RuntimeError, match="one cache slot per row"):
        kernels.paged_attention(q, k, v, kc_t, vc, slots[:2], tables, lens, starts, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):  # would write out of bounds
        kernels.paged_attention(q, k, v, kc_t, vc, torch.tensor([2, 3, 80]), tables, lens,
                                   starts, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):  # would read out of bounds
        kernels.paged_attention(q, k, v, kc_t, vc, slots, torch.tensor([[10, 0]]), lens,
                                   starts, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_writes_the_cache_like_the_torch_path(kernels, dtype):
    """The kernel stores the step's keys and values itself (prefill chunks first, decodes
    inside their own work item); the cache must end up as torch's write_kv leaves it,
    and the output must match attention over that cache."""
    from engine.model.attention.torch_sdpa import write_kv
    torch.manual_seed(0)
    heads, kv_heads, d, bs, blocks = 9, 3, 64, 16, 12
    query_lens, lens = [1, 1, 20, 15], [9, 17, 20, 40]  # decodes, fresh prompt, later chunk
    tables = torch.randperm(blocks)[:4 * 3].view(4, 3)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    slots = torch.tensor([int(tables[s][p // bs]) * bs + p % bs for s in range(4)
                          for p in range(lens[s] - query_lens[s], lens[s])])
    tokens = len(slots)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)  # q, k, v: strided views
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    start = torch.randn(blocks, 2, kv_heads, bs, d).to(dtype)  # earlier context
    torch_cache, native_cache = start.clone(), start.clone()
    kc, vc = cache_views(torch_cache)
    meta = TorchMetadata(slots, 0, None, None, slot_blocks=slots // bs,
                         slot_offsets=slots % bs)
    write_kv(k, v, kc, vc, meta)
    nk, nv = cache_views(native_cache)
    got = kernels.paged_attention(q, k, v, nk, nv, slots, tables, torch.tensor(lens), starts,
                                     0.125)
    assert not torch.equal(torch_cache, start)
    assert torch.equal(native_cache, torch_cache)
    expected = _reference(q, kc.transpose(2, 3), vc, tables,
                          torch.tensor(lens), starts, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), expected, atol=tol, rtol=tol)


def test_native_kernel_reads_q_as_a_row_view_of_the_fused_qkv(kernels):
    torch.manual_seed(1)
    rows, heads, kv_heads, d, bs, blocks = 6, 9, 3, 64, 16, 30
    kc = torch.randn(kv_heads, blocks, d, bs).bfloat16()
    vc = torch.randn(kv_heads, blocks, bs, d).bfloat16()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).bfloat16()
    q = qkv[:, :heads * d].view(rows, heads, d)  # rows (heads + 2 kv_heads) * d apart
    assert not q.is_contiguous()
    tables = torch.randperm(blocks)[:4 * 5].view(4, 5)
    lens, starts = torch.tensor([1, 16, 50, 80]), torch.tensor([0, 1, 2, 3, 6])
    strided = _native(kernels, q, kc, vc, tables, lens, starts, 0.125)
    dense = _native(kernels, q.contiguous(), kc, vc, tables, lens, starts, 0.125)
    assert torch.equal(strided, dense)
