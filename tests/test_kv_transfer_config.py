"""vLLM's --kv-transfer-config as an engine option (issue 64, point 1): parsed from the
JSON the CLI gives or a dict, vLLM's defaults, and every field or value not served
refused by name; the --kv-offloading-size shorthand as vLLM applies it."""
import dataclasses
import json
import pickle
import shlex
import uuid

import pytest

from deployments.cli import parse_command_line
from deployments.config import AppArgs, parse_app_args
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_transfer.config import (KVTransferConfig, kv_transfer_from_options,
                                       parse_kv_transfer_config, served_connector_names)
from engine.options import given

OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}


def test_parsed_from_json_and_from_a_dict_with_vllms_defaults():
    from_json = parse_kv_transfer_config(json.dumps({**OFFLOAD, "engine_id": "e1"}))
    from_dict = parse_kv_transfer_config({**OFFLOAD, "engine_id": "e1"})
    assert from_json == from_dict
    assert (from_dict.kv_connector, from_dict.kv_role) == ("OffloadingConnector", "kv_both")
    assert from_dict.kv_load_failure_policy == "fail"
    assert (from_dict.kv_port, from_dict.kv_buffer_device) == (14579, "cpu")
    assert from_dict.kv_connector_extra_config == {}
    assert from_dict.kv_connector_module_path is None
    assert from_dict.enable_permute_local_kv is False
    assert parse_kv_transfer_config(None) is None
    assert parse_kv_transfer_config(from_dict) is from_dict


def test_an_engine_id_is_drawn_when_none_is_given():
    drawn = [parse_kv_transfer_config(OFFLOAD).engine_id,
             parse_kv_transfer_config({**OFFLOAD, "engine_id": None}).engine_id]
    assert all(uuid.UUID(d) for d in drawn) and drawn[0] != drawn[1]
    assert parse_kv_transfer_config({**OFFLOAD, "engine_id": "mine"}).engine_id == "mine"


@pytest.mark.parametrize("role,producer,consumer", [
    ("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)])
def test_roles(role, producer, consumer):
    config = parse_kv_transfer_config({**OFFLOAD, "kv_role": role})
    assert (config.is_producer, config.is_consumer) == (producer, consumer)


@pytest.mark.parametrize("value,named", [
    ({**OFFLOAD, "kv_buffer_size": 1e9}, ["unknown key(s) kv_buffer_size",
                                          "accepted: kv_connector, kv_role"]),
    ({**OFFLOAD, "kv_role": "kv_server"}, ["kv_role must be one of", "'kv_server'"]),
    ({**OFFLOAD, "kv_load_failure_policy": "retry"},
     ["kv_load_failure_policy must be fail or recompute", "'retry'"]),
    ({**OFFLOAD, "kv_connector_module_path": "my.module"},
     ["kv_connector_module_path", "arbitrary modules is not supported",
      "Flotilla's connectors: ", "OffloadingConnector"]),
    ({**OFFLOAD, "enable_permute_local_kv": True}, ["enable_permute_local_kv"]),
    ({**OFFLOAD, "kv_buffer_device": "xpu"}, ["kv_buffer_device must be cpu or cuda",
                                              "'xpu'"]),
    ({**OFFLOAD, "kv_port": "14579"}, ["kv_port", "Expected `int`, got `str`"]),
    ({**OFFLOAD, "kv_port": 0}, ["kv_port must be a port number"]),
    ({**OFFLOAD, "kv_connector_extra_config": []}, ["kv_connector_extra_config"]),
    ({**OFFLOAD, "kv_connector": "FancyConnector"},
     ["unknown kv_connector 'FancyConnector'", "served: ", "OffloadingConnector"]),
    ({**OFFLOAD, "kv_connector": "NixlConnector"},
     ["'NixlConnector' is vLLM's, not served here", "GPU-cluster", "served: "]),
    ({**OFFLOAD, "kv_connector": "LMCacheConnectorV1"}, ["'LMCacheConnectorV1' is vLLM's"]),
    ({"kv_connector": "OffloadingConnector"}, ["kv_role is required", "kv_both"]),
    ({"kv_role": "kv_both"}, ["needs a kv_connector", "OffloadingConnector"]),
    ('{"kv_connector": "OffloadingConnector",', ["not valid JSON"]),
    ("[1]", ["must be a JSON object, got list"]),
])
def test_what_is_not_served_is_refused_by_name(value, named):
    with pytest.raises(InvalidRequestError) as refused:
        parse_kv_transfer_config(value)
    for words in named:
        assert words in str(refused.value), (words, str(refused.value))


def test_a_config_built_directly_is_checked_too():
    with pytest.raises(InvalidRequestError, match="'NixlConnector' is vLLM's"):
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    with pytest.raises(InvalidRequestError, match="kv_connector_module_path"):
        KVTransferConfig(**OFFLOAD, kv_connector_module_path="my.module")


def test_the_served_list_names_the_offloading_connector():
    assert "OffloadingConnector" in served_connector_names()


def test_the_engine_config_holds_the_parsed_config_and_refuses_at_construction():
    config = EngineConfig(kv_transfer_config=json.dumps(OFFLOAD))
    assert isinstance(config.kv_transfer_config, KVTransferConfig)
    assert EngineConfig().kv_transfer_config is None
    with pytest.raises(InvalidRequestError, match="unknown key"):
        EngineConfig(kv_transfer_config={**OFFLOAD, "kv_ip": "10.0.0.1"})


@pytest.mark.parametrize("size,cpu_bytes", [(4, 4 << 30), (0.5, 1 << 29)])
def test_the_offloading_shorthand_is_vllms_offloading_connector(size, cpu_bytes):
    config = EngineConfig(kv_offloading_size=size).kv_transfer_config
    assert (config.kv_connector, config.kv_role) == ("OffloadingConnector", "kv_both")
    assert config.kv_connector_extra_config == {"cpu_bytes_to_use": cpu_bytes}


def test_the_shorthand_beside_a_config_fills_it_as_vllm_does():
    """vLLM writes the shorthand's connector, role and bytes into a kv_transfer_config
    given beside it; keys it leaves alone are kept."""
    config = kv_transfer_from_options(
        {"kv_role": "kv_both", "kv_load_failure_policy": "recompute",
         "kv_connector_extra_config": {"block_bytes": 1}}, 1.0)
    assert config.kv_connector == "OffloadingConnector"
    assert config.kv_load_failure_policy == "recompute"
    assert config.kv_connector_extra_config == {"block_bytes": 1, "cpu_bytes_to_use": 1 << 30}


@pytest.mark.parametrize("value,named", [
    ({"kv_connector": "TcpConnector", "kv_role": "kv_both"}, "kv_connector"),
    ({**OFFLOAD, "kv_role": "kv_producer"}, "kv_role"),
    ({**OFFLOAD, "kv_connector_extra_config": {"cpu_bytes_to_use": 5}}, "cpu_bytes_to_use"),
])
def test_the_shorthand_and_a_config_that_disagree_are_refused(value, named):
    """Where vLLM would overwrite what the config says, both options are refused."""
    with pytest.raises(InvalidRequestError, match=f"kv_offloading_size sets "
                       f"kv_transfer_config's {named}.*give one or the other"):
        EngineConfig(kv_offloading_size=1, kv_transfer_config=value)


@pytest.mark.parametrize("kwargs,named", [
    ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"},
     "lmcache is not served: LMCache's engine does not run on a CPU engine here"),
    ({"kv_offloading_backend": "disk"}, "kv_offloading_backend must be native, got 'disk'"),
    ({"kv_offloading_size": 0}, "kv_offloading_size must be > 0"),
    ({"kv_offloading_size": -1.5}, "kv_offloading_size must be > 0"),
])
def test_shorthand_values_not_served_are_refused(kwargs, named):
    with pytest.raises(InvalidRequestError, match=named):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"kv_transfer_config": OFFLOAD},
                                    {"kv_offloading_size": 2.0}])
def test_every_copy_of_an_engine_config_keeps_its_kv_config(kwargs):
    """The engine_id is drawn once: asdict (the TP workers, LLM), replace (a DP rank's
    seed), pickle (Ray) and the Serve config's JSON all carry the same config."""
    config = EngineConfig(**kwargs)
    assert EngineConfig(**dataclasses.asdict(config)) == config
    assert dataclasses.replace(config, seed=5).kv_transfer_config == config.kv_transfer_config
    assert pickle.loads(pickle.dumps(config)) == config
    app = parse_app_args({"model": "mock", **kwargs})
    dumped = app.model_dump(mode="json")
    assert dumped["engine"]["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
    assert AppArgs.model_validate(json.loads(json.dumps(dumped))) == app


def test_the_cli_flags_reach_the_engine_config():
    line = ("serve ./m --kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", "
            "\"kv_role\": \"kv_consumer\", \"kv_load_failure_policy\": \"recompute\"}'")
    args, options, _ = parse_command_line(shlex.split(line))
    engine = parse_app_args(given(args, options)).engine
    assert engine.model == "./m"
    assert engine.kv_transfer_config.is_consumer
    assert engine.kv_transfer_config.kv_load_failure_policy == "recompute"
    args, options, _ = parse_command_line(shlex.split("serve ./m --kv-offloading-size 4"))
    engine = parse_app_args(given(args, options)).engine
    assert engine.kv_transfer_config.kv_connector_extra_config == {"cpu_bytes_to_use": 4 << 30}


def test_the_engine_subcommands_take_the_flags_too():
    from engine.cli import _engine_config, build_parser
    parser, _ = build_parser()
    args = parser.parse_args(["serve-engine", "--address", "tcp://127.0.0.1:1",
                              "--kv-transfer-config", json.dumps(OFFLOAD)])
    assert _engine_config(args).kv_transfer_config.kv_role == "kv_both"


def test_a_refused_config_exits_2_naming_it(capsys, monkeypatch):
    from deployments import cli
    monkeypatch.setenv("RAY_ADDRESS", "unused")  # the check runs before Ray is touched
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "m", "--kv-transfer-config",
                  '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'])
    assert exit_.value.code == 2
    assert "'NixlConnector' is vLLM's, not served here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        parse_command_line(["serve", "m", "--kv-transfer-config", "{"])
    assert exit_.value.code == 2
    assert "--kv-transfer-config: not valid JSON" in capsys.readouterr().err
