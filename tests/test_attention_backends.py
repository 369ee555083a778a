"""The attention backends (engine.model.attention): the registry, `auto`'s choice, what
each refuses (the messages the runner raised before the interface, word for word), and
each backend's forward against plain attention on one small random paged batch."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.model.attention.base import AttentionSpec
from engine.model.attention.flex import FlexBackend
from engine.model.attention.names import BACKEND_NAMES
from engine.model.attention.native import NativeBackend
from engine.model.attention.registry import (
    BACKENDS,
    auto_backend,
    choose_backend,
    make_backend,
)
from engine.model.attention.torch_sdpa import TorchBackend
from engine.model.attention.triton import TritonBackend
from engine.model.kernels import cpu_kernels
from engine.model.layers.rotary import Rope
from engine.model.shape import ModelShape
from engine.model.triton_kernels import availability

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 8
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # (a CUDA device described, not used)


def _shape(**changes) -> ModelShape:
    cfg = LlamaConfig(vocab_size=64, hidden_size=HEADS * DIM, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS)
    return dataclasses.replace(ModelShape.from_hf_config(cfg), **changes)


PLAIN = _shape()
SINKS = _shape(attention_sinks=True, architecture="GptOssForCausalLM")
WINDOWS = _shape(layer_windows=(0, 4), architecture="Gemma3ForCausalLM")


def _spec(shape=PLAIN, device=CPU, kernels=None, kv_cache_dtype="auto", block_size=BLOCK,
          **more) -> AttentionSpec:
    return AttentionSpec(shape, device, kernels, kv_cache_dtype, block_size, HEADS, KV_HEADS,
                         **more)


# ---- the registry and auto ------------------------------------------------------------

def test_the_registry_lists_the_four_backends_the_option_takes():
    assert tuple(BACKENDS) == BACKEND_NAMES == ("native", "flex", "triton", "torch")
    assert [BACKENDS[n] for n in BACKEND_NAMES] == [NativeBackend, FlexBackend, TritonBackend,
                                                  TorchBackend]
    assert all(cls.name == name for name, cls in BACKENDS.items())
    for name in ("auto", *BACKEND_NAMES):
        assert EngineConfig(attention_backend=name).attention_backend == name
    with pytest.raises(InvalidRequestError, match="attention_backend must be auto, native, "
                                                  "flex, triton or torch, got 'sdpa'"):
        EngineConfig(attention_backend="sdpa")


def test_auto_on_cpu_is_native_with_the_kernels_else_torch():
    kernels = object()  # any loaded kernel module
    for shape in (PLAIN, SINKS, WINDOWS):
        assert auto_backend(_spec(shape, kernels=kernels)) is NativeBackend
        assert auto_backend(_spec(shape)) is TorchBackend
    assert auto_backend(_spec(device=torch.device("meta"))) is TorchBackend  # other devices


def test_auto_on_cuda_is_triton_where_it_runs_else_flex_unless_windows_or_sinks(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if availability(CUDA) is not None:
        pytest.skip(f"Triton kernels: {availability(CUDA)}")
    for shape in (PLAIN, SINKS, WINDOWS):
        assert auto_backend(_spec(shape, CUDA)) is TritonBackend
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton cannot run on the GPU then
    assert availability(CUDA) is not None
    assert auto_backend(_spec(PLAIN, CUDA)) is FlexBackend
    assert auto_backend(_spec(SINKS, CUDA)) is TorchBackend
    assert auto_backend(_spec(WINDOWS, CUDA)) is TorchBackend


def test_auto_does_not_change_kernels_for_a_cache_option(monkeypatch):
    """auto picks flex on CUDA without triton; an fp8 cache is then refused, not served by
    another backend (the option is the user's to change)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(InvalidRequestError, match="not read by attention backend 'flex'"):
        make_backend("auto", _spec(PLAIN, CUDA, kv_cache_dtype="fp8"))


# ---- refusals -------------------------------------------------------------------------

def _refused(choice: str, spec: AttentionSpec) -> str:
    with pytest.raises(InvalidRequestError) as err:
        make_backend(choice, spec)
    return str(err.value)


def test_flex_refuses_sinks_windows_fp8_and_small_cuda_blocks():
    assert _refused("flex", _spec(SINKS)) == (
        "attention_backend 'flex' does not serve attention sinks (GptOssForCausalLM); use "
        "triton, native (CPU) or torch")
    assert _refused("flex", _spec(WINDOWS)) == (
        "attention_backend 'flex' does not serve sliding-window layers (Gemma3ForCausalLM); "
        "use triton, native or torch")
    assert _refused("flex", _spec(kv_cache_dtype="fp8")) == (
        "kv_cache_dtype 'fp8' is not read by attention backend 'flex'; the native (CPU), "
        "triton and torch backends read it (use attention_backend triton, or kv_cache_dtype "
        "auto)")
    assert FlexBackend.refuses_cache(_spec(device=CUDA, block_size=8)) == (
        "block_size 8 is too small for FlexAttention on CUDA (one page per KV tile; its "
        "kernels' tiles hold 16 keys at least)")
    assert FlexBackend.refuses_cache(_spec(device=CUDA, block_size=16)) is None
    assert FlexBackend.refuses_cache(_spec(block_size=8)) is None  # the eager reference
    # the model's refusal comes first, as the runner checked it first
    assert "attention sinks" in _refused("flex", _spec(SINKS, kv_cache_dtype="fp8"))


def test_native_refuses_a_device_without_the_cpu_kernels():
    assert _refused("native", _spec()) == (
        "attention_backend 'native' needs the CPU kernels (device cpu, kernels unavailable "
        "or off)")
    assert NativeBackend.refuses(_spec(kernels=object())) is None
    assert NativeBackend.refuses_cache(_spec(kernels=object(), kv_cache_dtype="fp8")) is None


def test_triton_refuses_where_its_kernels_do_not_run_and_fp8_before_8_9(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = availability(CPU)
    assert reason is not None and _refused("triton", _spec()) == (
        f"attention_backend 'triton': {reason}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert TritonBackend.refuses_cache(_spec(device=CUDA, kv_cache_dtype="fp8")) == (
        "kv_cache_dtype 'fp8': the Triton kernels read an fp8 KV cache on GPUs of compute "
        "capability 8.9 or later (Ada, Hopper), and this one is 8.0; use attention_backend "
        "torch with kv_cache_dtype fp8, or kv_cache_dtype auto")
    assert TritonBackend.refuses_cache(_spec(device=CUDA)) is None  # kv_cache_dtype auto
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert TritonBackend.refuses_cache(_spec(device=CUDA, kv_cache_dtype="fp8")) is None


def test_torch_serves_everything():
    for shape in (PLAIN, SINKS, WINDOWS):
        for device in (CPU, CUDA):
            spec = _spec(shape, device, kv_cache_dtype="fp8", block_size=4)
            assert TorchBackend.refuses(spec) is None and TorchBackend.refuses_cache(spec) is None
            assert choose_backend("torch", spec) is TorchBackend


# ---- the forward over the paged cache ---------------------------------------------------

class _Layer:
    """An attention layer without q/k norms whose rotary is the identity (the tests'
    rope tables: cos 1, sin 0)."""

    num_heads, num_kv_heads, head_dim = HEADS, KV_HEADS, DIM
    scale, k_scale, v_scale, window, sinks = 0.3, 1.0, 1.0, 0, None

    def normed_qkv(self, qkv):
        return qkv

    def rotated(self, qkv, rope):
        t = qkv.shape[0]
        q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        return (q.view(t, HEADS, DIM), k.view(t, KV_HEADS, DIM), v.view(t, KV_HEADS, DIM))


# (context before, new tokens) of each sequence in each step: step 1 prompts, step 2
# two decodes first, a chunk after its cached context, a fresh prompt
STEPS = [[(0, 11), (0, 5), (0, 9)], [(11, 1), (5, 1), (9, 7), (0, 10)]]
SEQUENCES = 4
NUM_BLOCKS = 12


def _batch(seed: int = 0):
    """Each sequence's q [L, H, D], k and v [L, KVH, D] over its whole length, and its
    block table (blocks shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [12, 6, 16, 10]
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    seqs, at = [], 0
    for n in lengths:
        pages = -(-n // BLOCK)
        seqs.append((torch.randn(n, HEADS, DIM, generator=gen),
                     torch.randn(n, KV_HEADS, DIM, generator=gen),
                     torch.randn(n, KV_HEADS, DIM, generator=gen), blocks[at:at + pages]))
        at += pages
    return seqs


def _reference(seqs, step) -> torch.Tensor:
    """Causal attention of each new token over its sequence's keys so far: [T, H * D]."""
    rows = []
    for (q, k, v, _), (ctx, n) in zip(seqs, step):
        group = HEADS // KV_HEADS
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for p in range(ctx, ctx + n):
            scores = torch.einsum("hd,khd->hk", q[p], keys[:p + 1]) * _Layer.scale
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values[:p + 1]))
    return torch.stack(rows).reshape(len(rows), HEADS * DIM)


def _run_steps(backend) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Both steps through the backend: (its output, the reference) of each."""
    seqs = _batch()
    cache = torch.zeros(backend.cache_shape(1, NUM_BLOCKS))
    views = backend.cache_views(cache[0])
    backend.cache_allocated(NUM_BLOCKS)
    layer = _Layer()
    results = []
    for step in STEPS:
        live = [(seqs[i], s) for i, s in enumerate(step)]
        qkv, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for (q, k, v, table), (ctx, n) in live:
            span = slice(ctx, ctx + n)
            qkv.append(torch.cat([q[span].flatten(1), k[span].flatten(1),
                                  v[span].flatten(1)], dim=1))
            positions.extend(range(ctx, ctx + n))
            slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + n))
            query_lens.append(n)
            seq_lens.append(ctx + n)
            tables.append(table[:-(-(ctx + n) // BLOCK)])
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        meta = backend.build_metadata(query_lens, seq_lens, tables,
                                      torch.tensor(slots, dtype=torch.long), num_decodes)
        assert meta.backend is backend and meta.num_decodes == num_decodes
        pos = torch.tensor(positions, dtype=torch.long)
        backend.prepare_step(meta, pos)
        table = torch.ones(64, DIM)
        rope = Rope(pos, table[pos][:, None], 0 * table[pos][:, None], table, 0 * table)
        out = backend.forward(layer, torch.cat(qkv), rope, views, meta)
        results.append((out, _reference([s for s, _ in live], step)))
    return results


def _check(backend_class, kernels=None, **spec) -> None:
    backend = backend_class(_spec(kernels=kernels, decode_sizes=(1, 2, 4, 8), max_pages=2,
                                  **spec))
    for out, expected in _run_steps(backend):
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_torch_forward_matches_plain_attention():
    _check(TorchBackend)


def test_native_forward_matches_plain_attention():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no native CPU kernels")
    _check(NativeBackend, kernels)


def test_flex_forward_matches_plain_attention():
    """FlexAttention's eager reference on CPU, as tests/test_flex_attention.py runs it."""
    _check(FlexBackend)


def test_triton_forward_matches_plain_attention():
    if availability(CPU) is not None:
        pytest.skip(f"Triton kernels: {availability(CPU)}")
    _check(TritonBackend)


def test_only_the_graph_backends_build_graph_metadata():
    assert [name for name, cls in BACKENDS.items() if cls.graphs] == ["flex", "triton"]
    with pytest.raises(NotImplementedError, match="'torch' captures no CUDA graphs"):
        TorchBackend(_spec()).graph_metadata()
