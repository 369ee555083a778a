"""AWQ and GPTQ int4 checkpoints (issue 42), read into Q4_1 blocks: the blocks decode to
the checkpoint's own weights, and the engine on tiny checkpoints (tests/int4_helpers.py)
matches transformers on the decoded weights in float32 (greedy tokens but for near ties,
logprobs within the GGUF kernels' int8 rounding of activations), with GPTQ's act-order,
on the decoder stack and the module path, under TP=2 and with LoRA."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from engine.errors import UnsupportedQuantizationError
from engine.quant.gguf_weights import GGUFBlocks
from engine.quant.int4_groups import iter_int4_weights, read_scheme
from tests.conftest import build_tiny_model
from tests.gguf_helpers import check_against, check_tp2_equals_one_rank
from tests.int4_helpers import write_int4

KINDS = [("awq", False), ("gptq", False), ("gptq", True)]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny_tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("int4") / "hf", "llama", tiny_tokenizer_dir)


@functools.cache
def _checkpoint(hf, method, act_order):
    return write_int4(hf, hf.parent / f"{method}{'-act' if act_order else ''}", method,
                      act_order=act_order)


@functools.cache
def _reference(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path.with_name(path.name + "-decoded")),
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("method, act_order", KINDS)
def test_blocks_decode_to_the_checkpoint_s_weights(tiny_hf, method, act_order):
    """Every weight read as Q4_1 blocks (columns in act-order's order where it applies)
    decodes to (q - z) * s, but for the half rounding of -z * s (<= 0.4 % of a step)."""
    _check_blocks_decode(_checkpoint(tiny_hf, method, act_order), method, act_order)


def _check_blocks_decode(path, method: str, act_order: bool) -> None:
    import json
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    want = load_file(str(path.with_name(path.name + "-decoded") / "model.safetensors"))
    weights = dict(iter_int4_weights(load_file(str(path / "model.safetensors")).items(),
                                     read_scheme(method, qc, "tiny")))
    checked = 0
    for name, value in weights.items():
        if not isinstance(value, GGUFBlocks):
            continue
        got = value.dequantize()
        order = weights.get(name.replace(".weight", ".input_order"))
        if act_order and got.shape[1] > qc["group_size"]:
            assert order is not None, name
            got = got[:, torch.argsort(order)]
        else:  # one group holds every column: any order of them is the same weight
            assert order is None, name
        step = (want[name].amax(1) - want[name].amin(1)).max() / 15  # the largest scale
        assert (got - want[name]).abs().max() <= 15 * 2 ** -12 * step * 1.01, name
        checked += 1
    assert checked == 2 * 7


@pytest.mark.parametrize("method, act_order", KINDS)
@pytest.mark.parametrize("stack", ["1", "0"])
def test_engine_on_int4_matches_the_decoded_weights(tiny_hf, monkeypatch, method, act_order,
                                                    stack):
    monkeypatch.setenv("FLOTILLA_DECODER_STACK", stack)
    path = _checkpoint(tiny_hf, method, act_order)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, block_size=8)
    engine = llm.llm_engine.engine_core
    assert engine.quantization == method
    model = engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.packing() == "gguf:Q4_1" and qkv.weight is None
    assert (qkv.input_order is not None) == act_order
    # the stack holds the layers unless act-order gathers x's columns first
    assert (model.stack is not None) == (stack == "1" and not act_order)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (40, 5, 33)]
    ref = _reference(path)
    check_against(llm, ref, prompts)
    out = check_against(llm, ref, [prompts[0][:32] + [7, 8, 9]])
    assert out[0].num_cached_tokens > 0


@pytest.mark.parametrize("method, act_order", KINDS)
def test_group_size_128_matches_the_decoded_weights(tmp_path_factory, tiny_tokenizer_dir,
                                                    method, act_order):
    """The group size checkpoints ship with (128 input columns a scale and zero): a tiny
    model wide enough for it (hidden 128, intermediate 256). Each group is read as four
    32-weight blocks sharing its scale and zero: they decode to the checkpoint's weights,
    and the engine runs them against those weights. This wider random model's logprobs
    move further under the activations' int8 rounding (0.2 measured, at group 32 too),
    hence the wider bounds than the narrow model's."""
    import json
    root = tmp_path_factory.mktemp("int4-g128")
    hf = build_tiny_model(root / "hf", "llama", tiny_tokenizer_dir, hidden_size=128,
                          intermediate_size=256)
    path = write_int4(hf, root / f"{method}{'-act' if act_order else ''}", method, group=128,
                      act_order=act_order)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 128
    _check_blocks_decode(path, method, act_order)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, block_size=8)
    qkv = llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.packing() == "gguf:Q4_1" and qkv.weight is None
    rng = np.random.default_rng(11)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (40, 5, 33)]
    check_against(llm, _reference(path), prompts, tolerance=0.3, tie=0.25)


def test_int4_under_tensor_parallelism_equals_one_rank(tiny_hf):
    """Both formats are Q4_1 blocks once read (the test of the blocks' values covers GPTQ
    against AWQ), so one format covers each rank's rows and block columns."""
    path = _checkpoint(tiny_hf, "awq", False)
    check_tp2_equals_one_rank(path)


def test_act_order_under_tensor_parallelism_is_refused(tiny_hf):
    with pytest.raises(UnsupportedQuantizationError, match="act-order"):
        LLM(str(_checkpoint(tiny_hf, "gptq", True)), dtype="float32", tensor_parallel_size=2)


def test_lora_on_an_act_order_gptq_base_matches_peft(tiny_hf, tmp_path):
    from engine.lora.request import LoRARequest
    from tests.test_lora import ALL, adapter_id, make_adapter
    path = _checkpoint(tiny_hf, "gptq", True)
    model = make_adapter(path.with_name(path.name + "-decoded"), tmp_path / "ad", 8, ALL,
                         seed=3).eval()
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("ad", adapter_id("ad"), str(tmp_path / "ad"))
    check_against(llm, model, [list(range(300, 320)), list(range(900, 905))],
                  exact_share=0.5, lora_request=lora)


def test_without_the_kernels_int4_is_decoded_in_the_input_s_order(tiny_hf, monkeypatch):
    import engine.executor.model_runner
    monkeypatch.setattr(engine.executor.model_runner, "cpu_kernels", lambda: None)
    monkeypatch.setattr(engine.executor.model_runner, "native_enabled", lambda: False)
    path = _checkpoint(tiny_hf, "gptq", True)
    llm = LLM(str(path), dtype="float32", block_size=8)
    assert llm.llm_engine.engine_core.runner.model.layers[0].self_attn.qkv_proj.packing() is None
    # no int8 activations: what differs is Q4_1's half m = -z * s (0.007 measured)
    check_against(llm, _reference(path), [list(range(100, 120))], tolerance=0.02)


@pytest.mark.parametrize("method, change, named", [
    ("awq", {"bits": 8}, "8-bit"), ("awq", {"version": "gemv"}, "version 'gemv'"),
    ("gptq", {"group_size": 48}, "group size 48"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
])
def test_other_int4_schemes_are_refused_by_name(method, change, named):
    base = {"bits": 4, "group_size": 128}
    with pytest.raises(UnsupportedQuantizationError, match=named):
        read_scheme(method, {**base, **change}, "m")


def test_a_config_that_says_int4_over_float_weights_is_refused(tiny_hf, tmp_path):
    import json
    import shutil

    from engine.errors import UnsupportedModelError
    shutil.copytree(tiny_hf, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="holds no qweight"):
        LLM(str(tmp_path / "m"), dtype="float32")


@pytest.mark.parametrize("method, act_order", [("awq", False), ("gptq", True)])
def test_on_the_triton_backend_int4_runs_the_triton_kernel(tiny_hf, method, act_order):
    """The Triton backend (interpreted here, compiled on a GPU) holds the Q4_1 blocks for
    engine/model/triton_kernels/int4_linear.py; no activation rounding, so the match is
    the decoded weights' but for Q4_1's half m."""
    from engine.model.triton_kernels import availability
    if availability(torch.device("cpu")) is not None:
        pytest.skip(f"Triton kernels: {availability(torch.device('cpu'))}")
    path = _checkpoint(tiny_hf, method, act_order)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", device="cpu",
              block_size=8)
    runner = llm.llm_engine.engine_core.runner
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert qkv.packing() == "int4-triton" and qkv.weight is None
    assert runner.memory_usage()["weights_bytes"] < sum(
        p.numel() * 4 for p in _reference(path).parameters())
    check_against(llm, _reference(path), [list(range(100, 120)), list(range(700, 706))],
                  tolerance=0.02)


def test_the_quantization_option_takes_vllm_s_names_for_the_format(tiny_hf):
    path = _checkpoint(tiny_hf, "awq", False)
    llm = LLM(str(path), dtype="float32", quantization="awq_marlin", block_size=8)
    assert llm.llm_engine.engine_core.quantization == "awq"
    with pytest.raises(UnsupportedQuantizationError, match="quantized as 'awq'"):
        LLM(str(path), dtype="float32", quantization="gptq_marlin")
