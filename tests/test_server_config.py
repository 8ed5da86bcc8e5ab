"""`specdec serve`'s settings: one validated ServerConfig, refused before any model loads, and a
port another process holds is one error line (no model load, no uvicorn log)."""

import argparse
import socket

import pytest

from specdec.cli import main
from specdec.server.config import ServerConfig
from specdec.server.serve import add_serve_arguments, check_port_free


def _serve_args(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_config_from_the_command_line():
    config = ServerConfig.from_args(_serve_args("--model", "m", "--gamma", "4", "--max-running", "2", "--kv-memory", "1.5",
                                                "--shutdown-timeout", "7"))
    assert (config.gamma, config.max_running, config.kv_memory_gb, config.shutdown_timeout) == (4, 2, 1.5, 7.0)
    assert config.model_name == "m"  # --served-model-name defaults to --model
    assert ServerConfig.from_args(_serve_args("--served-model-name", "x")).model_name == "x"
    defaults = ServerConfig.from_args(_serve_args())
    assert (defaults.host, defaults.port, defaults.gamma, defaults.shutdown_timeout) == ("127.0.0.1", 8000, "auto", 30.0)
    assert "sekret" not in repr(ServerConfig(api_key="sekret"))  # never printed by a log line


@pytest.mark.parametrize("setting, message", [
    ({"max_running": 0}, "--max-running must be an integer >= 1, got 0"),
    ({"max_queue": -1}, "--max-queue must be an integer >= 0, got -1"),
    ({"max_model_len": 1}, "--max-model-len must be an integer >= 2, got 1"),
    ({"default_max_tokens": 0}, "--default-max-tokens must be an integer >= 1"),
    ({"max_prefill_tokens": 0}, "--max-prefill-tokens must be an integer >= 1"),
    ({"max_body_bytes": 0}, "--max-body-bytes must be an integer >= 1"),
    ({"kv_memory_gb": 0.0}, "--kv-memory must be a number of GB > 0, got 0.0"),
    ({"kv_memory_gb": float("nan")}, "--kv-memory must be a number of GB > 0, got nan"),
    ({"kv_memory_fraction": 1.5}, "--kv-memory-fraction must be in (0, 1], got 1.5"),
    ({"kv_memory_fraction": float("nan")}, "--kv-memory-fraction must be in (0, 1]"),
    ({"shutdown_timeout": -1.0}, "--shutdown-timeout must be a number of seconds >= 0"),
    ({"shutdown_timeout": float("inf")}, "--shutdown-timeout must be a number of seconds >= 0"),
    ({"port": 65536}, "--port must be an integer in [0, 65535], got 65536"),
    ({"gamma": "lots"}, "gamma must be 'auto' or an integer >= 0, got 'lots'"),
])
def test_each_bad_setting_is_refused_by_the_config(setting, message):
    with pytest.raises(ValueError) as error:
        ServerConfig(**setting)
    assert message in str(error.value)


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def test_bad_settings_are_one_line_before_any_model_loads(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # a load would create the model's cache entry here
    code, lines = _cli(capsys, "serve", "--max-running", "0", "--port", "0")
    assert code == 2 and lines == ["specdec: error: --max-running must be an integer >= 1, got 0"]
    code, lines = _cli(capsys, "serve", "--shutdown-timeout", "-5", "--port", "0")
    assert code == 2 and lines == ["specdec: error: --shutdown-timeout must be a number of seconds >= 0, got -5.0"]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def held_port():
    """A port another server holds: a real listening socket on loopback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys, tmp_path, monkeypatch, held_port):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    code, lines = _cli(capsys, "serve", "--port", str(held_port))
    assert code == 2
    assert lines == [f"specdec: error: port {held_port} is in use on 127.0.0.1: stop what holds it or choose another --port"]
    assert list(tmp_path.iterdir()) == []  # nothing loaded, nothing fetched


def test_port_check_follows_the_address_uvicorn_binds(held_port):
    with pytest.raises(ValueError, match=f"port {held_port} is in use"):
        check_port_free("localhost", held_port)  # resolves to 127.0.0.1 (and ::1): the held one is among them
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    check_port_free("127.0.0.1", free)  # free: no error, and the port is not kept
    check_port_free("127.0.0.1", free)
    with pytest.raises(ValueError, match="--host no-such-host.invalid: cannot resolve"):
        check_port_free("no-such-host.invalid", free)
