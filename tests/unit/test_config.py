"""Settings: defaults < config file < HOTLORA_* environment < flags; EngineConfig from ServerConfig;
the compile fingerprint derived from the options the graphs depend on; hotlora.json read once."""

import json

import pytest

from hotlora.config import (
    EngineConfig, ModelDefaultsError, RequestLimits, ServerConfig, StepCache, read_model_defaults,
)


def test_layers_apply_in_order(tmp_path, monkeypatch):
    config_file = tmp_path / "serve.toml"
    config_file.write_text('[server]\nbatch_size = 3\ntarget_rank = 32\nmax_scale = 2.5\n'
                           '[store]\nram_budget_bytes = 1000\n')
    monkeypatch.setenv("HOTLORA_TARGET_RANK", "48")
    monkeypatch.setenv("HOTLORA_RAM_MAX_ENTRIES", "7")
    server, store = ServerConfig.load(config_file, store_flags={"ram_budget_bytes": 2000}, batch_size=None, port=9000)
    assert server.batch_size == 3  # file (a None flag does not override)
    assert server.target_rank == 48  # env over file
    assert server.port == 9000  # flag
    assert server.max_scale == 2.5
    assert (store.ram_budget_bytes, store.ram_max_entries) == (2000, 7)  # flag over file; env


def test_unknown_settings_are_refused(tmp_path):
    config_file = tmp_path / "serve.toml"
    config_file.write_text("[server]\nbatch_sise = 3\n")
    with pytest.raises(ValueError, match="unknown setting 'batch_sise'"):
        ServerConfig.load(config_file)


def test_the_server_produces_the_engine_config():
    server = ServerConfig(slots="a,b", target_rank=8, batch_size=2, step_cache="dbcache", step_cache_threshold=0.3,
                          rank_buckets="2,4", max_scale=3.0, max_work=1000)
    engine = server.engine_config()
    assert engine.slots == ("a", "b") and engine.target_rank == 8 and engine.rank_buckets == (2, 4)
    assert engine.step_cache == StepCache("dbcache", 0.3)
    assert engine.limits == RequestLimits(max_scale=3.0, max_work=1000)


def test_the_fingerprint_follows_what_the_graphs_depend_on():
    base = EngineConfig(target_rank=8)
    same = base.fingerprint("m", "flux", size=[32, 32])
    assert EngineConfig(target_rank=8, limits=RequestLimits(max_scale=1.0)).fingerprint("m", "flux", size=[32, 32]) == same
    assert EngineConfig(target_rank=16).fingerprint("m", "flux", size=[32, 32]) != same
    assert base.fingerprint("m", "flux", size=[64, 32]) != same
    assert EngineConfig(target_rank=8, mixed=True).fingerprint("m", "flux", size=[32, 32]) != same


def test_engine_config_refuses_impossible_combinations():
    with pytest.raises(ValueError, match="batch_size"):
        EngineConfig(batch_size=0)
    with pytest.raises(ValueError, match="rank buckets"):
        EngineConfig(mixed=True, rank_buckets=(4,))


def test_model_defaults_are_read_in_one_place(tmp_path):
    assert read_model_defaults(tmp_path) == {}
    assert read_model_defaults("org/hub-id") == {}
    (tmp_path / "hotlora.json").write_text(json.dumps({"model_id": "x/y", "height": 32}))
    assert read_model_defaults(tmp_path) == {"model_id": "x/y", "height": 32}
    (tmp_path / "hotlora.json").write_text("{nope")
    with pytest.raises(ModelDefaultsError, match="unreadable serving defaults"):
        read_model_defaults(tmp_path)
