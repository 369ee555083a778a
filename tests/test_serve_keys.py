"""`flotilla serve`'s keys out of argv and the Serve config (issue 62, item 1, part):
key files read into the variables the replicas read, a warning when the API is open to
the network, and no key in AppArgs' repr."""
import argparse

import pytest

from deployments.cli import parse_command_line
from deployments.config import AppArgs
from deployments.serve_keys import KEY_ENV, load_key_files, open_to_the_network


@pytest.fixture
def clean_env(monkeypatch):
    for env in KEY_ENV.values():
        monkeypatch.delenv(env, raising=False)
    return monkeypatch


def test_key_files_go_into_the_variables_the_replicas_read(tmp_path, clean_env):
    (tmp_path / "api").write_text("k-123\nignored\n")
    (tmp_path / "admin").write_text("  adm-9  \n")
    args, _, _ = parse_command_line(["serve", "--model", "mock", "--api-key-file",
                                     str(tmp_path / "api"), "--admin-key-file",
                                     str(tmp_path / "admin")])
    load_key_files(args, own_ray=True)
    import os
    assert os.environ["FLOTILLA_API_KEY"] == "k-123"
    assert os.environ["FLOTILLA_ADMIN_KEY"] == "adm-9"
    assert AppArgs(model="mock").keys() == ("k-123", "adm-9")  # what a replica reads


@pytest.mark.parametrize("setup, error", [
    ({"api_key": "flag", "api_key_file": "FILE"}, "both given"),
    ({"api_key_file": "FILE", "own_ray": False}, "RAY_ADDRESS"),
    ({"api_key_file": "MISSING"}, "No such file"),
    ({"api_key_file": "EMPTY"}, "is empty"),
])
def test_a_key_file_that_cannot_be_used_is_refused(tmp_path, clean_env, setup, error):
    (tmp_path / "FILE").write_text("k\n")
    (tmp_path / "EMPTY").write_text("\n")
    own_ray = setup.pop("own_ray", True)
    args = argparse.Namespace(**{k: str(tmp_path / v) if k.endswith("_file") else v
                                 for k, v in setup.items()})
    with pytest.raises(ValueError, match=error):
        load_key_files(args, own_ray=own_ray)
    import os
    assert "FLOTILLA_API_KEY" not in os.environ


def test_serving_beyond_loopback_without_a_key_is_flagged(clean_env):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        assert not open_to_the_network(host, None), host
    for host in ("0.0.0.0", "10.1.2.3", "::", "my-host.example"):
        assert open_to_the_network(host, None), host
        assert not open_to_the_network(host, "k"), host
    clean_env.setenv("FLOTILLA_API_KEY", "from-env")
    assert not open_to_the_network("0.0.0.0", None)


def test_keys_stay_out_of_the_app_args_repr():
    args = AppArgs(model="mock", api_key="sk-visible-nowhere", admin_key="adm-hidden")
    assert "sk-visible-nowhere" not in repr(args) and "adm-hidden" not in repr(args)
    assert "sk-visible-nowhere" not in str(args)
