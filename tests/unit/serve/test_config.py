"""``ServerConfig`` in sections: every setting belongs to exactly one, and a front-end process
is started with the sections it needs and nothing about the model."""

import dataclasses

import pytest

from vqserve.serve.config import SECTIONS, ServerConfig, config_from_sections, frontend_settings


def test_every_setting_is_in_exactly_one_section():
    names = [field for fields in SECTIONS.values() for field in fields]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in dataclasses.fields(ServerConfig)}


def test_a_frontend_gets_grpc_engine_and_split_and_never_the_model():
    config = ServerConfig(model="/models/secret-name", expect_hash="sha256:" + "a" * 64, port=0,
                          metrics_port=9100, max_batch_size=8, auth_token="t", frontends=4)
    settings = frontend_settings(config, port=50123, socket_path="/run/x.sock")
    assert set(settings) == {"grpc", "engine", "split"}
    assert "secret-name" not in repr(settings) and "model" not in settings["engine"]
    assert settings["grpc"]["port"] == 50123 and settings["grpc"]["metrics_port"] == -1
    assert settings["split"] == {"frontends": 0, "executor_socket": "/run/x.sock", "arena_mb": 0}
    rebuilt = config_from_sections(settings)
    assert rebuilt.max_batch_size == 8 and rebuilt.auth_token == "t"
    assert rebuilt.model == ServerConfig().model  # never told: the default, unused there


def test_an_unknown_setting_in_a_section_is_refused():
    with pytest.raises(ValueError, match="unknown grpc settings: \\['model'\\]"):
        config_from_sections({"grpc": {"model": "x"}})
