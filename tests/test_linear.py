"""Packed linear layers give the same results as nn.Linear and cost no memory: oneDNN's
packing, and the native kernels' matmul (engine/model/kernels/linear.cpp) on every
vector path this host builds (the `kernels` fixture), against a float32 reference."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.linear import Linear, can_pack, pack_linears
from tests.conftest import amx_granted_here, cpu_flags


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
    assert linears and all(m.packing() == "native" for m in linears)  # float32: any build
    assert all(layer.mlp.gate_up_proj.fuses_glu for layer in core.runner.model.layers)
    assert core.runner.memory_usage()["weights_bytes"] > 0


@pytest.fixture(autouse=True)
def _bf16_kernel_restored():
    """The native build's bf16 linear kernel as it was before the test, even when a test
    that forces one fails midway (the module is shared by the whole session)."""
    from engine.model.kernels import cpu_kernels
    native = cpu_kernels()
    chosen = native.linear_bf16_kernel() if native is not None else ""
    yield
    if chosen:
        native.set_linear_bf16_kernel(chosen)


def _linear_dtypes(kernels):
    """Each dtype the build's linear takes; bf16 once per kernel this CPU runs (amx
    where it has AMX, and dpbf16), each forced in turn (the fixture above restores)."""
    for name in kernels.linear_dtypes():
        if name != "bfloat16":
            yield getattr(torch, name)
            continue
        for kind in kernels.linear_bf16_kernels():
            assert kernels.set_linear_bf16_kernel(kind)
            assert kernels.linear_bf16_kernel() == kind
            yield torch.bfloat16


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's thread count set to n for the block (tests default to one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _bf16_flags() -> bool:
    return "avx512_bf16" in cpu_flags()


def _check_against_float(got: torch.Tensor, x, weight, bias) -> None:
    """float32: the reference up to summation order. bf16: the kernel sums the exact
    products in float32 (as oneDNN does) and rounds once, so every output is the
    reference's rounding or one bf16 step from it where the sum sits near a tie."""
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    if got.numel() == 0:
        return
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        err = (got.float() - want).abs()
        assert (err <= want.abs() * 2 ** -8 + 1e-4).all(), err.max()
        assert (got == want.to(torch.bfloat16)).float().mean() > 0.97


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 9, 64, 300, 600])
@pytest.mark.parametrize("out_features,in_features,bias", [(160, 96, True), (170, 97, False),
                                                           (48, 2, True), (3, 5, False)])
def test_native_linear_matches_float_reference(kernels, rows, out_features, in_features, bias):
    # Widths off every vector and panel size (170, 3), odd K (97, 5), more rows than a
    # row tile (8) and than a row chunk (512).
    for dtype in _linear_dtypes(kernels):
        torch.manual_seed(rows)
        weight = torch.randn(out_features, in_features).to(dtype)
        b = torch.randn(out_features).to(dtype) if bias else None
        x = torch.randn(rows, in_features).to(dtype)
        packed = kernels.pack_linear(weight)
        _check_against_float(kernels.linear(x, packed, b, out_features), x, weight, b)


def test_native_linear_splits_rows_when_panels_are_fewer_than_threads(kernels):
    # 16 columns are one panel: with two threads the rows are split between them.
    with _torch_threads(2):
        for dtype in _linear_dtypes(kernels):
            torch.manual_seed(1)
            weight, x = torch.randn(16, 64).to(dtype), torch.randn(77, 64).to(dtype)
            got = kernels.linear(x, kernels.pack_linear(weight), None, 16)
            _check_against_float(got, x, weight, None)


def test_native_linear_takes_leading_dims_and_views(kernels):
    torch.manual_seed(2)
    weight = torch.randn(40, 32)
    packed = kernels.pack_linear(weight)
    x = torch.randn(2, 3, 32)
    got = kernels.linear(x, packed, None, 40)
    assert got.shape == (2, 3, 40)
    _check_against_float(got.reshape(6, 40), x.reshape(6, 32), weight, None)
    view = torch.randn(32, 10).t()  # not contiguous
    _check_against_float(kernels.linear(view, packed, None, 40), view, weight, None)


def test_native_linear_refuses_what_it_cannot_run(kernels):
    packed = kernels.pack_linear(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="packed weight does not hold 57 x 32"):
        kernels.linear(torch.randn(3, 32), packed, None, 57)
    with pytest.raises(RuntimeError, match="packed weight does not hold 40 x 30"):
        kernels.linear(torch.randn(3, 30), packed, None, 40)
    with pytest.raises(RuntimeError, match="input Double against a Float weight"):
        kernels.linear(torch.randn(3, 32, dtype=torch.float64), packed, None, 40)
    with pytest.raises(RuntimeError, match="a bias of 39 for 40 output features"):
        kernels.linear(torch.randn(3, 32), packed, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        kernels.pack_linear(torch.randn(2, 40, 32))
    with pytest.raises(RuntimeError, match="no kernel for Half"):
        kernels.pack_linear(torch.randn(40, 32, dtype=torch.float16))


def test_the_native_build_has_a_bf16_linear_where_the_cpu_does():
    from engine.model.kernels import cpu_kernels
    assert "float32" in cpu_kernels().linear_dtypes()
    assert ("bfloat16" in cpu_kernels().linear_dtypes()) == _bf16_flags()


def test_the_bf16_linear_runs_on_amx_where_the_cpu_has_it(kernels):
    # AMX where the CPU has it (Linux 5.16+ grants the tile state), else vdpbf16ps; the
    # two kinds read one packed layout, so a weight packed under one runs under the other
    chosen = kernels.linear_bf16_kernel()
    if "bfloat16" not in kernels.linear_dtypes():
        assert chosen == "" and kernels.linear_bf16_kernels() == []
        assert not kernels.set_linear_bf16_kernel("dpbf16")
        pytest.skip("this CPU has no avx512_bf16: only checked that no bf16 linear is "
                    "offered")
    kinds = kernels.linear_bf16_kernels()
    assert chosen == kinds[0] and kinds[-1] == "dpbf16"
    # Linux grants AMX's tile state from 5.16 on: a CPU with AMX must get it, or its bf16
    # linears run on vdpbf16ps at a fraction of the speed
    if amx_granted_here():
        assert kinds == ["amx", "dpbf16"]
    assert not kernels.set_linear_bf16_kernel("tiles")
    torch.manual_seed(7)
    weight, x = torch.randn(100, 70).bfloat16(), torch.randn(37, 70).bfloat16()
    packed = kernels.pack_linear(weight)
    for _ in _linear_dtypes(kernels):
        _check_against_float(kernels.linear(x, packed, None, 100), x, weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_packs_for_the_native_kernels_when_they_have_the_dtype(kernels, dtype):
    torch.manual_seed(3)
    layer = Linear(64, 96, bias=True).to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack(kernels=kernels)
    native = str(dtype).removeprefix("torch.") in kernels.linear_dtypes()
    x = torch.randn(9, 64).to(dtype)
    if not native and not can_pack(torch.device("cpu"), dtype):
        # bf16 on a CPU without native bf16 (Zen 3): neither packs it, and oneDNN's
        # reorder would raise from inside torch: the weight stays dense and still runs
        assert layer.packing() is None and torch.equal(layer.weight, weight)
        assert torch.equal(layer(x), F.linear(x, weight, bias))
        return
    assert layer.packing() == ("native" if native else "onednn")
    assert layer.weight is None and layer.packed_bytes() == weight.numel() * weight.element_size()
    if native:
        _check_against_float(layer(x), x, weight, bias)


def test_native_linear_writes_float_logits_rounded_as_its_dtype(kernels):
    # float_out: the LM head's float32 logits in one pass, equal to the dtype's output
    # widened (what .float() of it gives), so sampling sees the same values
    for dtype in _linear_dtypes(kernels):
        torch.manual_seed(4)
        weight, x = torch.randn(170, 64).to(dtype), torch.randn(9, 64).to(dtype)
        packed = kernels.pack_linear(weight)
        got = kernels.linear(x, packed, None, 170, float_out=True)
        assert got.dtype == torch.float32
        assert torch.equal(got, kernels.linear(x, packed, None, 170).float())
        layer = Linear(64, 170, bias=False).to(dtype)
        layer.weight.data.copy_(weight)
        dense = layer.forward_float(x)
        layer.pack(kernels=kernels)
        assert torch.equal(layer.forward_float(x), got) and dense.dtype == torch.float32


def test_float_logits_past_the_streaming_size_equal_the_cached_writes(kernels):
    # Outputs past 4 MiB (an LM head's logits at a batch) are written around the caches:
    # the same values as the rows in small calls (written through them), in every whole
    # vector, the tail's partial one, and rows that start off a cache line (an odd
    # number of columns makes every other row misaligned)
    for dtype in _linear_dtypes(kernels):
        if dtype != torch.bfloat16:
            continue
        torch.manual_seed(6)
        n, rows = 16408, 72  # 72 x 16408 float32 = 4.7 MB; 8 rows 0.5 MB
        weight, x = torch.randn(n, 64).to(dtype), torch.randn(rows, 64).to(dtype)
        packed = kernels.pack_linear(weight)
        got = kernels.linear(x, packed, None, n, float_out=True)
        chunks = torch.cat([kernels.linear(x[i:i + 8], packed, None, n, float_out=True)
                            for i in range(0, rows, 8)])
        assert torch.equal(got, chunks)
        assert torch.equal(got, kernels.linear(x, packed, None, n).float())


@pytest.mark.parametrize("half,in_features,rows,bias", [(50, 64, 9, True), (16, 32, 600, False),
                                                        (1, 8, 13, True), (96, 97, 64, False)])
def test_paired_linear_writes_the_product_or_its_swiglu(kernels, half, in_features, rows, bias):
    # A [gate | up] weight packed paired: the plain output is the unpaired product; glu
    # is silu(gate) * up as silu_and_mul computes it from that product (bf16: rounded at
    # the same points; a half off the vector width takes silu_and_mul's scalar tail, whose
    # exp may land one bf16 step away).
    for dtype in _linear_dtypes(kernels):
        torch.manual_seed(half + rows)
        weight = (torch.randn(2 * half, in_features) * in_features ** -0.5).to(dtype)
        b = torch.randn(2 * half).to(dtype) if bias else None
        x = torch.randn(rows, in_features).to(dtype)
        paired = kernels.pack_linear(weight, paired=True)
        product = kernels.linear(x, paired, b, 2 * half, paired=True)
        assert torch.equal(product, kernels.linear(x, kernels.pack_linear(weight), b, 2 * half))
        _check_against_float(product, x, weight, b)
        got = kernels.linear(x, paired, b, 2 * half, paired=True, glu=True)
        want = kernels.silu_and_mul(product)
        assert got.shape == (rows, half) and got.dtype == dtype
        if dtype == torch.bfloat16 and half % 16 == 0:
            assert torch.equal(got, want)
        else:
            err = (got.float() - want.float()).abs()
            assert (err <= want.float().abs() * 2 ** -7 + 1e-5).all(), err.max()


def test_paired_linear_splits_rows_and_writes_float_logits(kernels):
    # two threads over a single pair: the rows are split; float_out of a paired product
    # is its widened values
    with _torch_threads(2):
        for dtype in _linear_dtypes(kernels):
            torch.manual_seed(6)
            weight, x = torch.randn(32, 24).to(dtype), torch.randn(70, 24).to(dtype)
            b = torch.randn(32).to(dtype)
            paired = kernels.pack_linear(weight, paired=True)
            product = kernels.linear(x, paired, b, 32, paired=True)
            assert torch.equal(product, kernels.linear(x, kernels.pack_linear(weight), b, 32))
            assert torch.equal(kernels.linear(x, paired, b, 32, paired=True, float_out=True),
                               product.float())
            glu = kernels.linear(x, paired, b, 32, paired=True, glu=True)
            if dtype == torch.bfloat16:
                assert torch.equal(glu, kernels.silu_and_mul(product))
            else:
                torch.testing.assert_close(glu, kernels.silu_and_mul(product), rtol=1e-5,
                                           atol=1e-6)


def test_paired_linear_refuses_what_it_cannot_run(kernels):
    with pytest.raises(RuntimeError, match="even row count, got 7"):
        kernels.pack_linear(torch.randn(7, 8), paired=True)
    paired = kernels.pack_linear(torch.randn(8, 8), paired=True)
    with pytest.raises(RuntimeError, match="glu needs a weight packed paired"):
        kernels.linear(torch.randn(2, 8), paired, None, 8, glu=True)
    with pytest.raises(RuntimeError, match="float_out and glu"):
        kernels.linear(torch.randn(2, 8), paired, None, 8, float_out=True, paired=True,
                       glu=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_glu_halves_layer_fuses_its_activation_only_when_native(kernels, dtype):
    torch.manual_seed(5)
    layer = Linear(32, 2 * 48, bias=False).to(dtype)
    layer.glu_halves = True
    weight = layer.weight.detach().clone()
    x = torch.randn(5, 32).to(dtype)
    gate, up = F.linear(x.float(), weight.float()).to(dtype).split(48, dim=-1)
    want = (F.silu(gate.float()).to(dtype).float() * up.float())
    assert not layer.fuses_glu
    with pytest.raises(RuntimeError, match="forward_glu needs"):
        layer.forward_glu(x)
    layer.pack(kernels=kernels)
    if str(dtype).removeprefix("torch.") not in kernels.linear_dtypes():
        assert not layer.fuses_glu  # oneDNN's packing: the plain product only
        pytest.skip(f"this build has no native {dtype} linear on this CPU: only checked "
                    "that the layer falls back to oneDNN's plain product")
    assert layer.fuses_glu
    _check_against_float(layer(x), x, weight, None)  # the [gate | up] product still
    assert torch.equal(layer.forward_float(x), layer(x).float())
    torch.testing.assert_close(layer.forward_glu(x).float(), want,
                               rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
