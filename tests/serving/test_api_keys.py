"""``tercet serve``'s API keys from a file (a mounted Secret) or the environment, never only
from the command line, where every local user reads them (``/proc/PID/cmdline``)."""

import logging

import msgspec
import pytest

from serving.cli import main, parser, topology_from
from serving.runtime.topology import TopologyError


def serve_args(*flags):
    return parser().parse_args(["serve", "--model", "tiny", *flags])


def keys_of(topology):
    return topology.server.api_key, topology.server.admin_api_key


def test_keys_from_files_lose_the_final_newline_only(tmp_path):
    (tmp_path / "api_key").write_text("s3cret-key\n")  # what `echo KEY > file` or a Secret holds
    (tmp_path / "admin").write_text("admin-key")
    args = serve_args("--api-key-file", str(tmp_path / "api_key"), "--admin-api-key-file", str(tmp_path / "admin"))
    assert keys_of(topology_from(args, {})) == ("s3cret-key", "admin-key")


def test_keys_from_the_environment():
    env = {"TERCET_API_KEY": "from-env", "TERCET_ADMIN_API_KEY": "admin-from-env"}
    assert keys_of(topology_from(serve_args(), env)) == ("from-env", "admin-from-env")
    assert keys_of(topology_from(serve_args(), {})) == (None, None)
    assert keys_of(topology_from(serve_args(), {"TERCET_API_KEY": ""})) == (None, None)  # unset in effect


def test_a_file_wins_over_the_environment_and_a_flag_over_both(tmp_path, caplog):
    (tmp_path / "key").write_text("from-file\n")
    env = {"TERCET_API_KEY": "from-env"}
    assert keys_of(topology_from(serve_args("--api-key-file", str(tmp_path / "key")), env))[0] == "from-file"
    with caplog.at_level(logging.WARNING, logger="serving.cli"):
        assert keys_of(topology_from(serve_args("--api-key", "on-the-line"), env))[0] == "on-the-line"
    assert "readable by every local user" in caplog.text and "on-the-line" not in caplog.text


@pytest.mark.parametrize("content", ["", "\n", " padded \n", "two\nlines\n", "tab\there"])
def test_an_empty_or_odd_key_file_is_refused(tmp_path, content):
    (tmp_path / "key").write_text(content)
    with pytest.raises(TopologyError, match="--api-key-file .*key: the key is empty"):
        topology_from(serve_args("--api-key-file", str(tmp_path / "key")), {})


def test_a_flag_and_a_file_for_one_key_are_refused(tmp_path):
    (tmp_path / "key").write_text("k")
    with pytest.raises(TopologyError, match="give one"):
        topology_from(serve_args("--api-key", "k", "--api-key-file", str(tmp_path / "key")), {})


def test_a_missing_key_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["serve", "--model", "tiny", "--api-key-file", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tercet: --api-key-file: cannot read") and "No such file" in err and err.count("\n") == 1


def test_server_info_masks_the_keys_and_a_custom_actors_arguments(tmp_path):
    from serving.http.admin import without_secrets

    (tmp_path / "key").write_text("s3cret-key\n")
    topology = topology_from(serve_args("--api-key-file", str(tmp_path / "key")), {"TERCET_ADMIN_API_KEY": "adm1n-k3y"})
    data = msgspec.to_builtins(msgspec.structs.replace(topology, actors=msgspec.structs.replace(
        topology.actors, scheduler=msgspec.structs.replace(topology.actors.scheduler, args={"token": "t0k3n"}))))
    shown = without_secrets(data)
    text = msgspec.json.encode(shown)
    assert b"s3cret-key" not in text and b"adm1n-k3y" not in text and b"t0k3n" not in text
    assert shown["server"]["api_key"] == shown["actors"]["scheduler"]["args"] == "***"
    assert shown["actors"]["detokenizer"]["args"] == {}  # (nothing to hide: shown as it is)
    assert shown["model"] == data["model"]
