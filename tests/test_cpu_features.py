"""What the engine reads of the CPU (engine/cpu_features.py): flags held to the x86 level
FLOTILLA_KERNELS_MARCH names, and bf16 refused with a clear error on a CPU without native
bf16 dot products (Zen 3 and other AVX2-only parts), never a RuntimeError from inside
oneDNN. The hold makes any x86 host answer as an AVX2 one, so these run everywhere."""
from __future__ import annotations

import platform

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu_features import _proc_flags, cpu_flags, cpu_has_native_bf16
from engine.errors import InvalidRequestError

X86 = platform.machine() == "x86_64"


@pytest.fixture
def held_to_avx2(monkeypatch):
    monkeypatch.setenv("FLOTILLA_KERNELS_MARCH", "x86-64-v3")


@pytest.mark.skipif(not X86, reason="x86-64 levels only mean something on x86-64")
def test_flags_held_to_x86_64_v3_keep_avx2_and_drop_what_lies_past_it(held_to_avx2):
    real = _proc_flags()
    held = cpu_flags()
    assert held <= real
    assert not {f for f in held if f.startswith(("avx512", "amx", "avx_"))}
    assert {"avx2", "fma", "f16c"} & real <= held  # what x86-64-v3 has stays
    assert not cpu_has_native_bf16()


@pytest.mark.skipif(not X86, reason="x86-64 levels only mean something on x86-64")
def test_flags_held_to_the_x86_64_baseline_drop_avx(monkeypatch):
    monkeypatch.setenv("FLOTILLA_KERNELS_MARCH", "x86-64")
    held = cpu_flags()
    assert not {f for f in held if f.startswith(("avx", "fma", "ssse3", "sse4"))}
    assert {"sse2"} & _proc_flags() <= held


def test_native_and_unknown_targets_hold_nothing(monkeypatch):
    monkeypatch.delenv("FLOTILLA_KERNELS_MARCH", raising=False)
    assert cpu_flags() == _proc_flags()
    monkeypatch.setenv("FLOTILLA_KERNELS_MARCH", "znver3")  # a named CPU: its own flags
    assert cpu_flags() == _proc_flags()


@pytest.mark.skipif(not X86, reason="x86-64 levels only mean something on x86-64")
def test_bf16_is_refused_on_a_cpu_without_native_bf16_naming_the_features(held_to_avx2):
    config = EngineConfig(model="unused", dtype="bfloat16")
    with pytest.raises(InvalidRequestError, match="avx512_bf16 or amx_bf16") as info:
        config.torch_dtype(torch.device("cpu"))
    assert "--dtype float32" in str(info.value)
    # auto takes float32 there, and float32 is always served
    assert EngineConfig(model="unused").torch_dtype(torch.device("cpu")) == torch.float32
    assert EngineConfig(model="unused", dtype="float32").torch_dtype(
        torch.device("cpu")) == torch.float32


@pytest.mark.skipif(not X86, reason="x86-64 levels only mean something on x86-64")
def test_an_engine_asked_for_bf16_on_such_a_cpu_refuses_to_start(held_to_avx2, tiny_llama):
    from engine import LLM
    with pytest.raises(InvalidRequestError, match="native bf16"):
        LLM(str(tiny_llama), dtype="bfloat16")


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16")
def test_bf16_is_served_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("FLOTILLA_KERNELS_MARCH", raising=False)
    config = EngineConfig(model="unused", dtype="bfloat16")
    assert config.torch_dtype(torch.device("cpu")) == torch.bfloat16
    assert EngineConfig(model="unused").torch_dtype(torch.device("cpu")) == torch.bfloat16
