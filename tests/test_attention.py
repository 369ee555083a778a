"""Paged attention: the native CPU decode kernel and the torch path agree with plain attention."""
import pytest
import torch

from engine.kernels import cpu_kernels
from engine.layers.attention import AttentionMetadata, _decode_attention


def _reference(q, kc, vc, tables, lens, scale):
    """Dense attention of each query over its gathered context (repeat kv heads)."""
    kvh, _, bs, d = kc.shape
    group = q.shape[1] // kvh
    outs = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        k = kc[:, tables[s]].reshape(kvh, -1, d)[:, :n].float().repeat_interleave(group, 0)
        v = vc[:, tables[s]].reshape(kvh, -1, d)[:, :n].float().repeat_interleave(group, 0)
        w = torch.softmax((q[s].float().unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)
        outs.append((w @ v).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_paths_match_dense_attention(dtype, tol, heads, kv_heads):
    torch.manual_seed(0)
    seqs, d, bs, blocks, width = 5, 64, 16, 40, 6
    if heads == 4:
        d, bs, blocks, width = 16, 8, 80, 12  # the kernel takes any head and block size
    kc = torch.randn(kv_heads, blocks, bs, d).to(dtype)
    vc = torch.randn(kv_heads, blocks, bs, d).to(dtype)
    q = torch.randn(seqs, heads, d).to(dtype)
    lens = torch.tensor([1, 17, 96, 33, 64])
    tables = torch.randperm(blocks)[:seqs * width].view(seqs, width)
    span = torch.arange(width * bs)
    bias = torch.zeros(seqs, width * bs).masked_fill_(span[None] >= lens[:, None], float("-inf"))
    expected = _reference(q, kc, vc, tables, lens, 0.125)

    kc_t = kc.transpose(2, 3).contiguous()  # the cache stores key blocks transposed
    torch_path = AttentionMetadata(None, seqs, tables, lens, bias, [])
    got = _decode_attention(q, kc_t, vc, torch_path, 0.125).float()
    assert torch.allclose(got, expected, atol=tol, rtol=tol)

    kernels = cpu_kernels()
    assert kernels is not None, "the native CPU kernel should build on this machine"
    native = AttentionMetadata(None, seqs, tables, lens, None, [],
                               native_decode=kernels.paged_decode_attention)
    got = _decode_attention(q, kc_t, vc, native, 0.125).float()
    assert torch.allclose(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cache_write_matches_the_torch_path(dtype):
    from engine.layers.attention import write_kv
    kernels = cpu_kernels()
    assert kernels is not None, "the native CPU kernel should build on this machine"
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
        meta = AttentionMetadata(slots, 0, None, None, None, [], slot_blocks=slots // bs,
                                 slot_offsets=slots % bs, native_store=store)
        write_kv(k, v, kc, vc, meta)
        caches.append((kc, vc))
    assert caches[0][0].abs().sum() > 0
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_native_decode_reads_q_as_a_row_view_of_the_fused_qkv():
    kernels = cpu_kernels()
    assert kernels is not None
    torch.manual_seed(1)
    seqs, heads, kv_heads, d, bs, blocks = 4, 9, 3, 64, 16, 30
    kc = torch.randn(kv_heads, blocks, d, bs).bfloat16()
    vc = torch.randn(kv_heads, blocks, bs, d).bfloat16()
    qkv = torch.randn(seqs, (heads + 2 * kv_heads) * d).bfloat16()
    q = qkv[:, :heads * d].view(seqs, heads, d)  # rows (heads + 2 kv_heads) * d apart
    assert not q.is_contiguous()
    tables = torch.randperm(blocks)[:seqs * 5].view(seqs, 5)
    lens = torch.tensor([1, 16, 50, 80])
    strided = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    dense = kernels.paged_decode_attention(q.contiguous(), kc, vc, tables, lens, 0.125)
    assert torch.equal(strided, dense)
