"""Paged attention: the native CPU kernel and the torch path agree with plain attention."""
import pytest
import torch

from engine.kernels import cpu_kernels
from engine.layers.attention import AttentionMetadata, _decode_attention


def _kernels():
    kernels = cpu_kernels()
    assert kernels is not None, "the native CPU kernels should build on this machine"
    return kernels


def _reference(q, kc, vc, tables, lens, starts, scale):
    """Dense causal attention of each query row over its sequence's gathered context
    (kv heads repeated); kc, vc: [KVH, blocks, bs, D]; row j of a sequence's n rows is
    its token ctx - n + j and sees keys 0 .. ctx - n + j."""
    kvh, _, bs, d = kc.shape
    group = q.shape[1] // kvh
    outs = []
    for s in range(len(lens)):
        ctx, rows = int(lens[s]), range(int(starts[s]), int(starts[s + 1]))
        k = kc[:, tables[s]].reshape(kvh, -1, d)[:, :ctx].float().repeat_interleave(group, 0)
        v = vc[:, tables[s]].reshape(kvh, -1, d)[:, :ctx].float().repeat_interleave(group, 0)
        for j, r in enumerate(rows):
            seen = ctx - len(rows) + j + 1
            w = torch.softmax((q[r].float().unsqueeze(1) @ k[:, :seen].transpose(1, 2)) * scale,
                              dim=-1)
            outs.append((w @ v[:, :seen]).squeeze(1))
    return torch.stack(outs)


def _problem(dtype, heads, kv_heads, d, bs, blocks, width, lens, query_lens, seed=0):
    torch.manual_seed(seed)
    kc = torch.randn(kv_heads, blocks, bs, d).to(dtype)
    vc = torch.randn(kv_heads, blocks, bs, d).to(dtype)
    lens = torch.tensor(lens)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    q = (2 * torch.randn(int(starts[-1]), heads, d)).to(dtype)
    tables = torch.randperm(blocks)[:len(lens) * width].view(len(lens), width)
    return q, kc, vc, tables, lens, starts


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_paths_match_dense_attention(dtype, tol, heads, kv_heads):
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
    torch_path = AttentionMetadata(None, seqs, tables, lens, decode_bias=bias)
    got = _decode_attention(q, kc_t, vc, torch_path, 0.125).float()
    assert torch.allclose(got, expected, atol=tol, rtol=tol)

    got = _kernels().paged_attention(q, kc_t, vc, tables, lens, starts, 0.125).float()
    assert torch.allclose(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (8, 1, 64, 16),
                                                 (16, 2, 128, 16), (6, 6, 128, 16),
                                                 (4, 2, 16, 8)])
def test_native_kernel_attends_decodes_and_prefill_chunks_causally(dtype, heads, kv_heads, d, bs):
    """One call, a mixed batch: two decodes, a fresh prompt, a chunk after cached context
    (chunked prefill / prefix hit), a one-token prompt, an odd-length prompt."""
    lens = [40, 7, 64, 70, 1, 33]
    query_lens = [1, 1, 64, 21, 1, 33]
    width = max(-(-n // bs) for n in lens)
    q, kc, vc, tables, lens, starts = _problem(dtype, heads, kv_heads, d, bs, 90, width,
                                               lens, query_lens, seed=3)
    expected = _reference(q, kc, vc, tables, lens, starts, d ** -0.5)
    got = _kernels().paged_attention(q, kc.transpose(2, 3).contiguous(), vc, tables, lens,
                                     starts, d ** -0.5)
    if dtype == torch.float32:
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    else:  # float32 math inside: within one bf16 rounding of the exact result
        err = (got.float() - expected).abs()
        assert (err <= expected.abs() * 2 ** -8 + 1e-3).all(), err.max()


def test_native_kernel_ignores_garbage_past_the_context():
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
    got = _kernels().paged_attention(q, kc.transpose(2, 3).contiguous(), vc, tables, lens,
                                     starts, 0.125)
    assert not got.isnan().any()
    assert torch.allclose(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_native_kernel_rejects_inconsistent_row_offsets():
    q, kc, vc, tables, lens, starts = _problem(torch.float32, 2, 1, 16, 8, 10, 2, [5], [3])
    with pytest.raises(RuntimeError, match="query_start"):
        _kernels().paged_attention(q, kc.transpose(2, 3).contiguous(), vc, tables, lens,
                                   torch.tensor([0, 2]), 0.25)
    with pytest.raises(RuntimeError, match="context length"):
        _kernels().paged_attention(q, kc.transpose(2, 3).contiguous(), vc, tables,
                                   torch.tensor([40]), starts, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cache_write_matches_the_torch_path(dtype):
    from engine.layers.attention import write_kv
    kernels = _kernels()
    torch.manual_seed(0)
    kv_heads, d, bs, blocks, tokens = 3, 64, 16, 12, 37
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * d).to(dtype)  # k, v: strided views
    k = qkv[:, 9 * d:(9 + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (9 + kv_heads) * d:].view(tokens, kv_heads, d)
    slots = torch.randperm(blocks * bs)[:tokens]
    caches = []
    for store in (None, kernels.store_kv):
        kc = torch.zeros(kv_heads, blocks, d, bs, dtype=dtype)
        vc = torch.zeros(kv_heads, blocks, bs, d, dtype=dtype)
        meta = AttentionMetadata(slots, 0, None, None, slot_blocks=slots // bs,
                                 slot_offsets=slots % bs, native_store=store)
        write_kv(k, v, kc, vc, meta)
        caches.append((kc, vc))
    assert caches[0][0].abs().sum() > 0
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_native_kernel_reads_q_as_a_row_view_of_the_fused_qkv():
    kernels = _kernels()
    torch.manual_seed(1)
    rows, heads, kv_heads, d, bs, blocks = 6, 9, 3, 64, 16, 30
    kc = torch.randn(kv_heads, blocks, d, bs).bfloat16()
    vc = torch.randn(kv_heads, blocks, bs, d).bfloat16()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).bfloat16()
    q = qkv[:, :heads * d].view(rows, heads, d)  # rows (heads + 2 kv_heads) * d apart
    assert not q.is_contiguous()
    tables = torch.randperm(blocks)[:4 * 5].view(4, 5)
    lens, starts = torch.tensor([1, 16, 50, 80]), torch.tensor([0, 1, 2, 3, 6])
    strided = kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.125)
    dense = kernels.paged_attention(q.contiguous(), kc, vc, tables, lens, starts, 0.125)
    assert torch.equal(strided, dense)
