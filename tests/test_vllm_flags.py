"""`flotilla serve` reads vLLM's documented command lines for the flags the two share,
and refuses vLLM flags it lacks by name (issue 41, item 4)."""
import shlex

import pytest

from deployments.cli import parse_command_line
from deployments.vllm_flags import ALWAYS_ON, HINTS, SHORT_ALIASES, VLLM_SERVE_FLAGS
from engine.options import given

# Command lines as vLLM's documentation gives them (quickstart, OpenAI-compatible
# server, distributed serving, LoRA, tool calling, generation config, engine args),
# with `vllm serve` replaced by `flotilla serve`, and what each must set.
DOC_LINES = [
    ("serve ./model.Q4_K_M.gguf -q gguf", {"model": "./model.Q4_K_M.gguf", "quantization": "gguf"}),
    ("serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
     {"model": "NousResearch/Meta-Llama-3-8B-Instruct", "dtype": "auto",
      "api_key": "token-abc123"}),
    ("serve Qwen/Qwen2.5-1.5B-Instruct", {"model": "Qwen/Qwen2.5-1.5B-Instruct"}),
    ("serve facebook/opt-13b --tensor-parallel-size 4", {"tensor_parallel_size": 4}),
    ("serve facebook/opt-13b -tp 4", {"tensor_parallel_size": 4}),
    ("serve facebook/opt-13b -tp=2 -dp 2",
     {"tensor_parallel_size": 2, "data_parallel_size": 2}),
    ("serve Qwen/Qwen2.5-7B --data-parallel-size 4", {"data_parallel_size": 4}),
    ("serve meta-llama/Llama-2-7b-hf --enable-lora --lora-modules "
     "sql-lora=/root/.cache/huggingface/hub/models--yard1--llama-2-7b-sql-lora-test",
     {"enable_lora": True, "lora_modules": {
         "sql-lora": "/root/.cache/huggingface/hub/models--yard1--llama-2-7b-sql-lora-test"}}),
    ("serve m --enable-lora --max-loras 4 --max-lora-rank 64 --max-cpu-loras 8",
     {"max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": 8}),
    ("serve m --chat-template ./path-to-chat-template.jinja",
     {"chat_template": "./path-to-chat-template.jinja"}),
    ("serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser "
     "llama3_json --chat-template examples/tool_chat_template_llama3.1_json.jinja",
     {"tool_call_parser": "llama3_json",
      "chat_template": "examples/tool_chat_template_llama3.1_json.jinja"}),
    ("serve NousResearch/Hermes-2-Pro-Llama-3-8B --enable-auto-tool-choice "
     "--tool-call-parser hermes", {"tool_call_parser": "hermes"}),
    ("serve Qwen/Qwen3-8B --reasoning-parser qwen3", {"reasoning_parser": "qwen3"}),
    ("serve deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --reasoning-parser deepseek_r1",
     {"reasoning_parser": "deepseek_r1"}),
    ("serve m --generation-config vllm", {"generation_config": "vllm"}),
    ("serve m --generation-config auto --override-generation-config "
     "'{\"temperature\": 0.5, \"top_p\": 0.9}'",
     {"generation_config": "auto",
      "override_generation_config": {"temperature": 0.5, "top_p": 0.9}}),
    ("serve m --max-model-len 8192 --gpu-memory-utilization 0.9 --max-num-seqs 256 "
     "--max-num-batched-tokens 8192",
     {"max_model_len": 8192, "gpu_memory_utilization": 0.9, "max_num_seqs": 256,
      "max_num_batched_tokens": 8192}),
    ("serve m --max-model-len 32k --max-num-batched-tokens 2K --kv-cache-memory-bytes 1G",
     {"max_model_len": 32000, "max_num_batched_tokens": 2048,
      "kv_cache_memory_bytes": 2 ** 30}),
    ("serve m --enable-prefix-caching --block-size 16 --seed 0 --enforce-eager",
     {"enable_prefix_caching": True, "block_size": 16, "seed": 0, "enforce_eager": True}),
    ("serve m --no-enable-prefix-caching", {"enable_prefix_caching": False}),
    ("serve m --enable-chunked-prefill --max-num-batched-tokens 2048",
     {"max_num_batched_tokens": 2048}),
    ("serve m --served-model-name my-model --max-logprobs 20",
     {"served_model_name": "my-model", "max_logprobs": 20}),
    ("serve m --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
     "\"prompt_lookup_max\": 4}'",
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5,
                             "prompt_lookup_max": 4}}),
    ("serve m -sc '{\"method\": \"suffix\"}'", {"speculative_config": {"method": "suffix"}}),
    ("serve m --kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", "
     "\"kv_role\": \"kv_both\"}' --kv-offloading-backend native",
     {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
      "kv_offloading_backend": "native"}),
    ("serve m --kv-offloading-size 4", {"kv_offloading_size": 4.0}),
    ("serve m --scheduling-policy priority --load-format dummy",
     {"scheduling_policy": "priority", "load_format": "dummy"}),
]


@pytest.mark.parametrize("line,want", DOC_LINES, ids=[w[0][:48] for w in DOC_LINES])
def test_vllms_documented_command_lines_parse(line, want):
    args, options, _ = parse_command_line(shlex.split(line))
    got = given(args, options)
    assert {k: got.get(k) for k in want} == want


def test_the_host_and_port_flags_are_vllms():
    args, _, _ = parse_command_line(shlex.split("serve m --host 0.0.0.0 --port 8001"))
    assert (args.host, args.port) == ("0.0.0.0", 8001)


@pytest.mark.parametrize("line,named", [
    ("serve m --pipeline-parallel-size 2", "--pipeline-parallel-size"),
    ("serve m -pp 2 --port 8000", "--pipeline-parallel-size"),
    ("serve m --kv-sharing-fast-prefill", "--kv-sharing-fast-prefill"),
    ("serve m --trust-remote-code", "--trust-remote-code"),
    ("serve m --cpu-offload-gb 4", "--cpu-offload-gb"),
])
def test_a_vllm_flag_flotilla_lacks_exits_2_naming_it(line, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_command_line(shlex.split(line))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{named} is a vllm serve flag that flotilla serve does not support" in err
    assert HINTS.get(named, "Flotilla does not implement it") in err
    assert "unrecognized" not in err  # the flag's values are not reported as strays


def test_other_unknown_arguments_are_still_unrecognized(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_command_line(["serve", "m", "--frobnicate", "--cpu-offload-gb", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-offload-gb is a vllm serve flag" in err
    assert "unrecognized arguments: --frobnicate" in err


def test_an_unknown_reasoning_parser_exits_2_naming_the_known_ones(capsys, monkeypatch):
    from deployments import cli
    monkeypatch.setenv("RAY_ADDRESS", "unused")  # the check runs before Ray is touched
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "m", "--reasoning-parser", "granite"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown reasoning_parser 'granite'; known: deepseek_r1, qwen3" in err
    assert "does not support" not in err  # --reasoning-parser is a flotilla serve flag


def test_the_model_given_twice_differently_is_refused(capsys):
    args, _, _ = parse_command_line(["serve", "m", "--model", "m"])
    assert args.model == "m"
    with pytest.raises(SystemExit) as exit_:
        parse_command_line(["serve", "a", "--model", "b"])
    assert exit_.value.code == 2 and "given twice" in capsys.readouterr().err


def test_the_vllm_flag_list_is_vllms_and_every_shared_flag_is_in_it():
    """The list is vllm serve's own (0.32.0); every flotilla serve flag that vLLM also
    has is a real vLLM flag, so the refusal never names one of ours."""
    assert len(VLLM_SERVE_FLAGS) > 150
    assert {"--tensor-parallel-size", "--lora-modules", "--chat-template",
            "--override-generation-config", "--max-model-len"} <= VLLM_SERVE_FLAGS
    assert set(SHORT_ALIASES.values()) <= VLLM_SERVE_FLAGS
    assert set(HINTS) | set(ALWAYS_ON) <= VLLM_SERVE_FLAGS
