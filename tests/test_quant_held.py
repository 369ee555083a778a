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
