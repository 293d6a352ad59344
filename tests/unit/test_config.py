"""Settings: defaults < config file < HOTLORA_* environment < flags; EngineConfig from ServerConfig;
the compile fingerprint derived from the options the graphs depend on; hotlora.json read once."""

import json

import pytest

from hotlora.settings import (
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


# Computed before config.py was folded into settings (commit 81f3542): a compiled engine's cache folder and chunk record
# are keyed by these strings, so a refactor that changes one byte silently throws every cache away.
PINNED_DEFAULT = (
    '{"adapter_mode": "slots", "attention": "sdpa", "bank_entries": null, "base_quantization": "none", '
    '"batch_size": "auto", "compile": true, "dtype": "torch.float32", "dynamic_sizes": false, "family": "flux", '
    '"fused_restore": "auto", "max_batch_size": 6, "mixed": false, "model": "tiny/flux", "rank_buckets": [0, 4], '
    '"sizes": [[32, 32]], "slots": ["identity", "style"], "step_cache": null, "target_modules": null, '
    '"target_rank": 16}')
PINNED_CHANGED = (
    '{"adapter_mode": "slots", "attention": "sdpa", "bank_entries": null, "base_quantization": "int8_weight_only", '
    '"batch_size": 3, "compile": true, "dtype": "torch.bfloat16", "dynamic_sizes": true, "family": "sdxl", '
    '"fused_restore": "auto", "max_batch_size": 6, "mixed": false, "model": "some/model", "rank_buckets": [0, 8], '
    '"sizes": [[64, 32], [32, 32]], "slots": ["a", "b", "c"], '
    '"step_cache": "StepCache(backend=\'fbcache\', threshold=0.2, warmup_steps=4, compute_blocks=1)", '
    '"target_modules": ["to_q", "to_k"], "target_rank": 32}')


def test_the_fingerprint_strings_are_pinned():
    assert EngineConfig().fingerprint("tiny/flux", "flux", sizes=((32, 32),), dynamic_sizes=False, attention="sdpa",
                                      dtype="torch.float32") == PINNED_DEFAULT
    changed = EngineConfig(slots=("a", "b", "c"), target_rank=32, batch_size=3, rank_buckets=(0, 8),
                           step_cache=StepCache(backend="fbcache", threshold=0.2), target_modules=("to_q", "to_k"),
                           base_quantization="int8_weight_only")
    assert changed.fingerprint("some/model", "sdxl", sizes=((64, 32), (32, 32)), dynamic_sizes=True,
                               attention="sdpa", dtype="torch.bfloat16") == PINNED_CHANGED


def test_engine_config_refuses_impossible_combinations():
    with pytest.raises(ValueError, match="batch_size"):
        EngineConfig(batch_size=0)
    with pytest.raises(ValueError, match="rank buckets"):
        EngineConfig(mixed=True, rank_buckets=(4,))
    with pytest.raises(ValueError, match="auto mode .* no mixed batches"):
        EngineConfig(adapter_mode="auto", mixed=True)
    with pytest.raises(ValueError, match="auto mode merges"):
        EngineConfig(adapter_mode="auto", base_quantization="int8_weight_only")
    assert EngineConfig(adapter_mode="auto", rank_buckets=(4,)).rank_buckets == (4,)  # the slots' buckets: allowed
    assert ServerConfig(adapter_mode="auto", fused_min_kept=0.9).engine_config().adapter_mode == "auto"


def test_model_defaults_are_read_in_one_place(tmp_path):
    assert read_model_defaults(tmp_path) == {}
    assert read_model_defaults("org/hub-id") == {}
    (tmp_path / "hotlora.json").write_text(json.dumps({"model_id": "x/y", "height": 32}))
    assert read_model_defaults(tmp_path) == {"model_id": "x/y", "height": 32}
    (tmp_path / "hotlora.json").write_text("{nope")
    with pytest.raises(ModelDefaultsError, match="unreadable serving defaults"):
        read_model_defaults(tmp_path)


# Every field, from each layer, through the functions `hotlora serve` uses, to the object that
# consumes it: the EngineConfig the engine is built with, the store's config, the worker, the server.

import os  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from hotlora.cli import build_parser, serve_settings  # noqa: E402
from hotlora.settings import SettingsError, StoreConfig  # noqa: E402
from hotlora.settings.fields import bare, declared, default_of  # noqa: E402
from hotlora.settings.server import ENGINE_SETTINGS  # noqa: E402

SPECIAL = {  # (text, typed) where the sample from the type would not do
    "sizes": ("64x32,32x32", ((32, 64), (32, 32))),
    "tasks": ("image-to-image,inpaint", ("text-to-image", "image-to-image", "inpaint")),
    "batch_size": ("3", 3),
    "target_modules": ("to_q|to_k", "to_q|to_k"),  # text is one regex
    "dtype": ("float16", "float16"),
    "compile_cache_dir": ("/cc", "/cc"),
    "local_roots": (f"/a{os.pathsep}/b", (Path("/a"), Path("/b"))),
    "cache_dir": ("/c", Path("/c")),
    "fused_min_kept": ("0.5", 0.5),  # a fraction: default + 0.5 would leave 0..1
    "input_image_background": ("0,0,0", (0, 0, 0)),  # R,G,B: three values 0-255
}
STORE = list(StoreConfig.model_fields)
SETTINGS = ([(ServerConfig, name, info) for name, info in ServerConfig.model_fields.items()]
            + [(StoreConfig, name, info) for name, info in StoreConfig.model_fields.items()])
NEEDS = {"step_cache_threshold", "step_cache_warmup_steps", "step_cache_compute_blocks"}  # only with a backend
WORKER = {"max_queue", "max_batch_delay_s", "max_rebuild_attempts"}  # the worker's own bounds


def sample(name, info):
    if name in SPECIAL:
        return SPECIAL[name]
    kind, default = bare(info.annotation), default_of(info)
    if declared(info).choices:
        pick = next(c for c in declared(info).choices if c != default)
        return pick, pick
    if kind is bool:
        return str(not default).lower(), not default
    if kind is int:
        return str((default or 0) + 3), (default or 0) + 3
    if kind is float:
        return str(default + 0.5), default + 0.5
    if kind == tuple[int, ...]:
        return "4,8", (4, 8)
    if kind == tuple[str, ...]:
        return "p,q", ("p", "q")
    assert kind is str, f"no sample for {name}: {kind}"
    return f"x-{name}", f"x-{name}"


class Built(Exception):
    """Raised by the stand-in for Engine.from_pretrained with the config the engine would be built with."""


def engine_built_by(server, store, monkeypatch) -> tuple:
    """(the worker, the EngineConfig): `hotlora serve`'s own wiring (server/run.py), with the model load
    replaced by a capture."""
    from hotlora import Engine
    from hotlora.server.run import build_serving

    def capture(model, config=None, **options):
        raise Built(model, config, options)

    monkeypatch.setattr(Engine, "from_pretrained", capture)
    # The engine process builds it the same way in its child: captured before anything is spawned.
    from hotlora.engine.process import EngineProcess

    monkeypatch.setattr(EngineProcess, "start", lambda model, config, **_: capture(model, config))
    worker = build_serving(server, store).worker
    with pytest.raises(Built) as built:
        worker._factory()  # what the worker calls to build (and rebuild) its engine
    model, config, options = built.value.args
    assert model == server.model and options == {}
    return worker, config


def landed(server, store, name, monkeypatch):
    """Where a setting ends up: the store, the engine's config (nested groups included), the worker,
    the server."""
    if name in STORE:
        return getattr(store, name)
    if name not in ENGINE_SETTINGS:
        return getattr(engine_built_by(server, store, monkeypatch)[0] if name in WORKER else server, name)
    engine = engine_built_by(server, store, monkeypatch)[1]
    if name == "step_cache":
        return engine.step_cache.backend
    if name.startswith("step_cache_"):
        return getattr(engine.step_cache, name.removeprefix("step_cache_"))
    if name in RequestLimits.model_fields:
        return getattr(engine.limits, name)
    return getattr(engine, name)


def plain(value):
    """A typed value as a YAML file writes it: lists for tuples, text for paths."""
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def settings_from(argv):
    return serve_settings(build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("HOTLORA_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("cls, name, info", SETTINGS, ids=[name for _, name, _ in SETTINGS])
def test_every_setting_reaches_its_consumer_from_env_file_and_flag(cls, name, info, clean_env, tmp_path):
    text, typed = sample(name, info)
    assert typed != default_of(info), f"the sample for {name} must differ from its default"
    extra = {"step_cache": "dbcache"} if name in NEEDS else {}
    section = "store" if cls is StoreConfig else "server"

    for key, value in {**extra, name: text}.items():
        clean_env.setenv("HOTLORA_" + key.upper(), value)
    assert landed(*settings_from([]), name, clean_env) == typed, "from HOTLORA_*"
    for key in (*extra, name):
        clean_env.delenv("HOTLORA_" + key.upper())

    as_yaml = plain(typed)
    for suffix, dump in ((".yaml", yaml.safe_dump), (".toml", _toml)):
        config_file = tmp_path / ("serve" + suffix)
        config_file.write_text(dump({section: {name: as_yaml}, "server": {**extra}}
                                    if section == "store" else {section: {**extra, name: as_yaml}}))
        assert landed(*settings_from(["--config", str(config_file)]), name, clean_env) == typed, f"from {suffix}"

    flag = "--" + name.replace("_", "-")
    if not declared(info).flag:  # a secret (api_keys): its flag refuses, argv shows in `ps`
        with pytest.raises(SystemExit):
            settings_from([flag, text])
        return
    argv = ([flag if typed else "--no-" + flag[2:]] if isinstance(typed, bool) else [flag, text])
    argv += [a for key, v in extra.items() for a in ("--" + key.replace("_", "-"), v)]
    assert landed(*settings_from(argv), name, clean_env) == typed, "from the flag"


def _toml(tables: dict) -> str:
    """The few value types the samples hold, as TOML (tomllib reads; it does not write)."""
    def value(v):
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)  # a JSON string, integer or float is a TOML one
    return "".join(f"[{table}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items())
                   for table, body in tables.items())


def test_serve_help_lists_every_setting_and_the_old_flags_still_parse(clean_env):
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for _, name, info in SETTINGS:
        if not declared(info).flag:  # a secret: its flag is hidden from --help (and refuses)
            continue
        assert "--" + name.replace("_", "-") in text, name
        assert info.description and info.description.split()[0] in text, f"{name}: its description is its help"
    server, store = settings_from(["--no-compile", "--mixed", "--adapter-root", "/a", "--adapter-root", "/b",
                                   "--slots", "a,b", "--sizes", "64x32", "--no-text-encoder-lora", "--port", "9"])
    assert (server.compile, server.mixed, server.slots, server.sizes, server.text_encoder_lora, server.port) == \
        (False, True, ("a", "b"), ((32, 64),), False, 9)
    assert store.local_roots == (Path("/a"), Path("/b"))


def test_flag_over_env_over_file_for_engine_options(clean_env, tmp_path):
    config_file = tmp_path / "serve.toml"
    config_file.write_text('[server]\nmax_steps = 10\nfused_restore = "host"\nmax_pixels = 100\n')
    clean_env.setenv("HOTLORA_MAX_STEPS", "20")
    clean_env.setenv("HOTLORA_FUSED_RESTORE", "device")
    engine = settings_from(["--config", str(config_file), "--max-steps", "30"])[0].engine_config()
    assert (engine.limits.max_steps, engine.fused_restore, engine.limits.max_pixels) == (30, "device", 100)


def test_bad_text_is_refused_with_the_setting_named(clean_env):
    clean_env.setenv("HOTLORA_PORT", "eighty")
    with pytest.raises(SettingsError, match="port must be an integer"):
        settings_from([])
    clean_env.delenv("HOTLORA_PORT")
    clean_env.setenv("HOTLORA_SIZES", "64x")
    with pytest.raises(SettingsError, match="WIDTHxHEIGHT"):
        settings_from([])


def test_settings_built_in_code_read_nothing_from_outside(clean_env):
    """A library user's EngineConfig (and a StoreConfig or ServerConfig built in code) holds its
    arguments over its defaults: the environment reaches only what `hotlora serve` layers."""
    clean_env.setenv("HOTLORA_TARGET_RANK", "48")
    clean_env.setenv("HOTLORA_RAM_BUDGET_BYTES", "7")
    assert EngineConfig().target_rank == 16 and ServerConfig().target_rank == 16
    assert StoreConfig().ram_budget_bytes == StoreConfig.default("ram_budget_bytes")
    assert ServerConfig.load()[0].target_rank == 48 and StoreConfig.from_env().ram_budget_bytes == 7


def test_engine_config_is_frozen_and_replace_validates():
    config = EngineConfig(target_rank=8)
    with pytest.raises(ValueError):
        config.target_rank = 4
    assert config.replace(batch_size="2").batch_size == 2 and config.replace() is config
    with pytest.raises(SettingsError, match="unknown setting 'batch_sise'"):
        config.replace(batch_sise=2)
    with pytest.raises(SettingsError, match="rank buckets"):
        config.replace(mixed=True, rank_buckets=(4,))
    assert StepCache("fbcache", 0.3) == StepCache(backend="fbcache", threshold=0.3) and not StepCache("fbcache").fullgraph
