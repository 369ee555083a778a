"""One config source: every option reaches the CLI, `serve run key=value` and the app."""
import argparse
import dataclasses
import json

import msgspec
import pytest
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.scripts import convert_args_to_dict

from deployments.app import build_app
from deployments.cli import add_serve_parser
from deployments.config import AppArgs, flat_options, parse_app_args
from engine.cli import build_parser
from engine.config import EngineConfig
from engine.mock.config import MockConfig

# A value for each option that differs from its default and passes its checks, as
# `serve run` would pass it (text). Options of a plain kind get one by kind below.
SAMPLES = {
    "model": "mock", "dtype": "float32", "device": "cpu", "block_size": "32",
    "gpu_memory_utilization": "0.5", "placement_strategy": "PACK",
    "data_parallel_size": "2", "tensor_parallel_size": "2", "engine_num_cpus": "0.25",
    "ingress_autoscaling": json.dumps({"min_replicas": 1, "max_replicas": 2}),
    "engine_autoscaling": json.dumps({"min_replicas": 1, "max_replicas": 3}),
    "max_body_bytes": "4096", "mock_output_chunk_size": "4",
    "tool_call_parser": "llama3_json", "reasoning_parser": "qwen3",
    "response_store_max": "500", "response_store_ttl_s": "120.0",
    "response_store_max_bytes": "1048576", "max_request_timeout_s": "900.0",
    "stream_interval_s": "0.02",
    "chat_template": "{{ messages }}",
    "generation_config": "vllm", "override_generation_config": '{"temperature": 0.5}',
    "lora_modules": json.dumps({"ad": "/adapters/ad"}), "scheduling_policy": "priority",
    "routing": "round_robin", "attention_backend": "torch", "load_format": "dummy",
    "kv_cache_dtype": "fp8",
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
    # agrees with kv_offloading_size's sample (0.125 GiB), which fills in the rest
    "kv_transfer_config": '{"kv_role": "kv_both", "engine_id": "e1"}',
    "kv_offloading_backend": "native",
}
ONLY_THE_DEFAULT = {"kv_offloading_backend"}  # its one served value is its default
BY_KIND = {int: "7", float: "0.125", str: "text"}


def _sample(opt) -> str:
    if opt.kind is bool:  # the other value
        return "false" if opt.default else "true"
    return SAMPLES.get(opt.name, BY_KIND.get(opt.kind))


def _flat_value(args: AppArgs, name: str):
    if name in {f.name for f in dataclasses.fields(EngineConfig)}:
        value = getattr(args.engine, name)
        return msgspec.to_builtins(value) if isinstance(value, msgspec.Struct) else value
    if name.startswith("mock_") and hasattr(args.mock, name[5:]):
        return getattr(args.mock, name[5:])
    value = getattr(args, name)
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _expected(raw: str, kind: type):
    if kind is bool:
        return raw == "true"
    if kind is dict:
        return json.loads(raw)
    return kind(raw)


def _serve_parser() -> tuple[argparse.ArgumentParser, list]:
    parser, sub = build_parser()
    return parser, add_serve_parser(sub)


def test_every_app_option_works_through_serve_run_key_value():
    """`serve run deployments.app:build_app name=value` for every option at once: each
    value lands where it belongs and the app builds."""
    options = flat_options()
    pairs = tuple(f"{o.name}={_sample(o)}" for o in options)
    raw = convert_args_to_dict(pairs)
    app = call_user_app_builder_with_args_if_necessary(build_app, raw)
    assert app is not None
    args = parse_app_args(raw)
    for o in options:
        got = _flat_value(args, o.name)
        want = _expected(_sample(o), o.kind)
        if o.kind is dict:
            assert {k: got[k] for k in want} == want, o.name
        else:
            assert got == want and (got != o.default or o.name in ONLY_THE_DEFAULT), o.name


def test_every_app_option_has_a_serve_flag_with_the_same_effect():
    parser, options = _serve_parser()
    argv = ["serve"]
    for o in options:
        if o.kind is bool:
            argv.append(o.flag if _sample(o) == "true" else "--no-" + o.flag[2:])
        else:
            argv += [o.flag, _sample(o)]
    from engine.options import given
    from_cli = parse_app_args(given(parser.parse_args(argv), options))
    from_serve_run = parse_app_args(convert_args_to_dict(
        tuple(f"{o.name}={_sample(o)}" for o in options)))
    assert from_cli == from_serve_run


def test_serve_flags_use_vllm_names_and_say_what_they_do():
    parser, options = _serve_parser()
    text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-model-len",
                 "--tensor-parallel-size", "--data-parallel-size", "--engine-num-gpus",
                 "--num-threads", "--mock-itl-s", "--mock-ttft-s", "--served-model-name"):
        assert flag in text, flag
    assert all(o.help for o in options), [o.name for o in options if not o.help]


def test_unset_flags_keep_the_declared_defaults():
    parser, options = _serve_parser()
    from engine.options import given
    assert given(parser.parse_args(["serve"]), options) == {}
    assert parse_app_args({}) == AppArgs()


@pytest.mark.parametrize("command", ["generate", "serve-engine"])
def test_engine_subcommands_carry_every_engine_option(command):
    parser, _ = _serve_parser()
    text = parser._subparsers._group_actions[0].choices[command].format_help()
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in text, (command, f.name)


def test_mock_engine_subcommand_carries_every_mock_option():
    parser, _ = _serve_parser()
    text = parser._subparsers._group_actions[0].choices["mock-engine"].format_help()
    for f in dataclasses.fields(MockConfig):
        if "help" in f.metadata:
            assert "--" + f.name.replace("_", "-") in text, f.name
    args = parser.parse_args(["mock-engine", "--address", "tcp://127.0.0.1:1", "--itl-s",
                              "0.5", "--vocab-size", "100"])
    from engine.mock.serve import config_from_args
    config = config_from_args(args, 3)
    assert (config.itl_s, config.vocab_size, config.engine_index) == (0.5, 100, 3)


def test_bad_values_name_their_option():
    with pytest.raises(ValueError, match="engine: max_num_seqs must be >= 1"):
        parse_app_args({"max_num_seqs": "0"})
    with pytest.raises(ValueError, match="mock: mock engine: latencies must be >= 0"):
        parse_app_args({"model": "mock", "mock_itl_s": "-1"})
    with pytest.raises(ValueError, match="no_such_option: Extra inputs"):
        parse_app_args({"no_such_option": 1})
    with pytest.raises(ValueError, match="engine_autoscaling: not valid JSON"):
        parse_app_args({"model": "mock", "engine_autoscaling": "{"})


def test_reasoning_parser_names_a_known_parser():
    """vLLM's --reasoning-parser names are taken; others are refused naming the known
    ones, by `serve run key=value` and `flotilla serve` alike (exit 2)."""
    from deployments.apis.common.reasoning import REASONING_PARSERS
    assert parse_app_args({}).reasoning_parser is None  # off unless asked for
    for name in ("qwen3", "deepseek_r1"):
        assert parse_app_args({"reasoning_parser": name}).reasoning_parser == name
    with pytest.raises(ValueError, match="unknown reasoning_parser 'granite'; known: "
                       + ", ".join(REASONING_PARSERS)):
        parse_app_args({"reasoning_parser": "granite"})
    parser, options = _serve_parser()
    from engine.options import given
    args = given(parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"]), options)
    assert parse_app_args(args).reasoning_parser == "deepseek_r1"


def test_app_args_round_trip_through_the_serve_config():
    """Replicas rebuild AppArgs from the dumped dict Serve stores: nothing changes."""
    args = parse_app_args({"model": "mock", "max_num_seqs": 8, "mock_itl_s": 0.01,
                           "data_parallel_size": 2})
    assert AppArgs.model_validate(args.model_dump(mode="json")) == args
    assert args.engine_config(1).seed == args.engine.seed + 1
    mock = args.mock_config(1, vocab_size=100)
    assert (mock.itl_s, mock.max_num_seqs, mock.engine_index) == (0.01, 8, 1)


def test_a_mock_engine_asks_for_almost_no_cpu():
    """`flotilla serve --model mock --data-parallel-size 2` fits a 2-core machine; real
    engines keep asking for a whole CPU."""
    mock = parse_app_args({"model": "mock", "data_parallel_size": 2})
    mock.check_fits({"CPU": 2})
    assert mock.engine_cpus < 0.1
    real = parse_app_args({"model": "default", "data_parallel_size": 2})
    assert real.engine_cpus == 1.0
    with pytest.raises(ValueError, match="need 2.5 CPUs"):
        real.check_fits({"CPU": 2})
    assert parse_app_args({"model": "mock", "engine_num_cpus": 1}).engine_cpus == 1.0


def test_flotilla_serve_gives_a_local_engine_every_core():
    from deployments.cli import fit_to_machine
    one = parse_app_args({"model": "default"})
    fitted, line = fit_to_machine(one, {}, {"CPU": 2})
    assert (fitted.engine_cpus, fitted.ingress_num_cpus) == (2.0, 0.0)
    fitted.check_fits({"CPU": 2})
    assert "gets 2 CPUs (torch threads 2)" in line
    two = parse_app_args({"model": "default", "data_parallel_size": 2})
    fitted, _ = fit_to_machine(two, {"data_parallel_size": 2}, {"CPU": 2})
    assert fitted.engine_cpus == 1.0
    fitted.check_fits({"CPU": 2})  # refused before: 2 engines + the ingress needed 2.5
    mine = parse_app_args({"model": "default", "engine_num_cpus": 1, "ingress_num_cpus": 0.5})
    assert fit_to_machine(mine, {"engine_num_cpus": 1, "ingress_num_cpus": 0.5},
                          {"CPU": 2}) == (mine, "")
    mock = parse_app_args({"model": "mock"})
    assert fit_to_machine(mock, {}, {"CPU": 2}) == (mock, "")


@pytest.mark.parametrize("values,want", [
    # vLLM's documented forms (docs: "LoRA Adapters", serving with --lora-modules)
    (["sql-lora=/models/sql-lora"], {"sql-lora": "/models/sql-lora"}),
    (["a1=/p/a1", "a2=/p/a2"], {"a1": "/p/a1", "a2": "/p/a2"}),
    (['{"name": "sql-lora", "path": "/models/sql", "base_model_name": "meta-llama/Llama-2-7b"}'],
     {"sql-lora": "/models/sql"}),
    (['{"name": "x", "path": "/p/x"}', "y=/p/y"], {"x": "/p/x", "y": "/p/y"}),
    # Flotilla's (and its chart's) form: one object, name -> path
    (['{"a1": "/p/a1", "a2": "/p/a2"}'], {"a1": "/p/a1", "a2": "/p/a2"}),
])
def test_lora_modules_takes_vllms_syntax(values, want):
    """`flotilla serve --lora-modules a1=/path` (vLLM's form) failed with "not valid
    JSON" (issue 41, item 4)."""
    from engine.options import given
    parser, options = _serve_parser()
    args = given(parser.parse_args(["serve", "--enable-lora", "--lora-modules", *values]),
                 options)
    assert args["lora_modules"] == want
    assert parse_app_args(args).engine.lora_modules == want


@pytest.mark.parametrize("value", ["no-path", "=/p", '{"name": "x"', '{"x": 1}'])
def test_a_bad_lora_modules_value_exits_2_naming_the_flag(value, capsys):
    parser, _ = _serve_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve", "--lora-modules", value])
    assert exit_.value.code == 2
    assert "--lora-modules" in capsys.readouterr().err
