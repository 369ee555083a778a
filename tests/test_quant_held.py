"""Every held weight implements engine.quant.held.HeldWeight (issue 63, point 2): the
same members, with the protocol's parameters in its order, so a Linear, the runner's
memory count and the decoder stack serve any of them without knowing its format."""
from __future__ import annotations

import inspect

import pytest

from engine.quant.fp8 import Fp8ScaledMM, Fp8Weight
from engine.quant.gguf_linear import GGUFWeight
from engine.quant.held import HeldWeight
from engine.quant.int8_w8a8 import Int8Weight


def _held_classes() -> list[type]:
    classes = [GGUFWeight, Int8Weight, Fp8Weight, Fp8ScaledMM]
    try:  # triton is optional on CPU
        from engine.model.triton_kernels.int4_linear import Int4Weight
    except ImportError:
        return classes
    return classes + [Int4Weight]


MEMBERS = [n for n, v in vars(HeldWeight).items()
           if not n.startswith("_") and (callable(v) or isinstance(v, property))]


def test_the_protocol_names_what_layers_use():
    assert sorted(MEMBERS) == ["describe", "matmul", "nbytes", "packing", "stack_segments"]


@pytest.mark.parametrize("cls", _held_classes(), ids=lambda c: c.__name__)
def test_each_held_weight_implements_the_protocol(cls):
    for name in MEMBERS:
        want, got = getattr(HeldWeight, name), getattr(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert callable(got) and not isinstance(got, property), f"{cls.__name__}.{name}"
        expected = inspect.signature(want).parameters
        actual = inspect.signature(got).parameters
        assert list(actual) == list(expected), f"{cls.__name__}.{name}{inspect.signature(got)}"
        for p in expected.values():  # the protocol's optional parameters stay optional
            if p.default is not inspect.Parameter.empty:
                assert actual[p.name].default is not inspect.Parameter.empty, \
                    f"{cls.__name__}.{name}: {p.name} has no default"


def _holder_classes() -> list[type]:
    from engine.quant.native_holder import NativeHolder
    try:  # triton is optional on CPU
        from engine.model.triton_kernels.weight_holder import TritonHolder
    except ImportError:
        return [NativeHolder]
    return [NativeHolder, TritonHolder]


@pytest.mark.parametrize("cls", _holder_classes(), ids=lambda c: c.__name__)
def test_each_holder_implements_the_holder_protocol(cls):
    """The loader (engine.quant.holding) asks any holder the same two questions."""
    from engine.quant.held import WeightHolder
    for name in ("hold_blocks", "hold_scaled"):
        want = list(inspect.signature(getattr(WeightHolder, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}"


def test_the_triton_holder_declines_what_its_kernels_do_not_multiply():
    """int8 W8A8, block-wise fp8, other GGUF types and the embedding are decoded on the
    GPU (None), fp8 per channel is held for torch._scaled_mm."""
    pytest.importorskip("triton")
    import torch
    from engine.model.triton_kernels.weight_holder import TritonHolder
    from engine.quant.gguf_weights import GGUFBlocks
    from engine.quant.scaled_pieces import ScaledWeight
    holder = TritonHolder(torch.device("cpu"))
    int8 = ScaledWeight(torch.ones(32, 32, dtype=torch.int8), torch.ones(32), 0.0)
    assert holder.hold_scaled(int8) is None
    fp8 = torch.ones(32, 32).to(torch.float8_e4m3fn)
    assert isinstance(holder.hold_scaled(ScaledWeight(fp8, torch.ones(32), 0.0)), Fp8ScaledMM)
    assert holder.hold_scaled(ScaledWeight(fp8, torch.ones(32, 1), 0.0, block_k=32)) is None
    q8 = GGUFBlocks("Q8_0", torch.zeros(32, 34, dtype=torch.uint8), 32)
    assert holder.hold_blocks([(0, q8)], 32, embedding=False) is None
    q41 = GGUFBlocks("Q4_1", torch.zeros(32, 20, dtype=torch.uint8), 32)
    assert holder.hold_blocks([(0, q41)], 32, embedding=True) is None
