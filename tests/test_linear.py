"""Prepacked (oneDNN) linear layers give the same results as nn.Linear and cost no memory."""
import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.linear import Linear, can_pack, pack_linears


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_dense(dtype, rows):
    if dtype == torch.bfloat16 and not can_pack(torch.device("cpu"), dtype):
        pytest.skip("bf16 packing needs a CPU with native bf16 (avx512_bf16/AMX)")
    assert can_pack(torch.device("cpu"), dtype)
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True).to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x, weight, bias)
    layer.pack()
    assert layer.weight is None and layer.packed_bytes() == weight.numel() * weight.element_size()
    got = layer(x)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tied_weight_stays_dense():
    assert can_pack(torch.device("cpu"), torch.float32)  # oneDNN ships in torch's CPU build
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(50, 32)
    model.head = Linear(32, 50, bias=False)
    model.head.weight = model.embed.weight
    model.other = Linear(32, 32)
    assert pack_linears(model, keep_dense={id(model.embed.weight)}) == 2
    assert model.head.weight is model.embed.weight  # the embedding still reads it
    assert model.other.weight is None
    x = torch.randn(3, 32)
    torch.testing.assert_close(model.head(x), x @ model.embed.weight.t(), rtol=1e-5, atol=1e-5)


def test_cpu_engine_packs_its_linears(tiny_llama):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    assert can_pack(torch.device("cpu"), torch.float32)  # oneDNN ships in torch's CPU build
    core = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32"))
    linears = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert core.runner.memory_usage()["weights_bytes"] > 0
