"""The ingress's routing decisions and the Ray settings: pure functions, no Ray needed (moved from tests/ray)."""

import json
from pathlib import Path

import pytest

from hotlora.settings import ServerConfig, StoreConfig
from hotlora.scaleout.config import DeployConfigError, RayServeConfig
from hotlora.scaleout.routing import UnknownModel, route
from hotlora.errors import InvalidRequest


@pytest.fixture
def config(tmp_path):
    model = tmp_path / "flux-dev"
    model.mkdir()
    (model / "hotlora.json").write_text(json.dumps({"model_id": "org/flux", "base_model_aliases": ["flux-1"]}))
    return RayServeConfig.from_dict({"models": {
        "flux": {"model": str(model), "num_replicas": 2, "server": {"lora_header_slot": "face"}},
        "sdxl": {"model": "org/sdxl", "aliases": ["sdxl-base"], "autoscaling": {"min_replicas": 1, "max_replicas": 4}},
    }}, ServerConfig(), StoreConfig(cache_dir=tmp_path / "cache"))


def routed(config, path="/v1/generate", body=None, headers=None, query=None, method="POST"):
    raw = body if isinstance(body, bytes) else json.dumps(body or {"prompt": "x"}).encode()
    slots = {name: spec.server.lora_header_slot for name, spec in config.models.items()}
    return route(method, path, query or {}, headers or {}, raw, config.routing_table(), config.default_model, slots)


def test_routing_table_holds_every_name_a_model_answers_to(config):
    table = config.routing_table()
    assert {k for k, v in table.items() if v == "flux"} >= {"flux", "flux-dev", "org/flux", "flux-1"}
    assert {k for k, v in table.items() if v == "sdxl"} == {"sdxl", "sdxl-base", "org/sdxl"}
    assert config.default_model == "flux"


def test_model_from_path_body_header_query_else_default(config):
    assert routed(config, "/models/org/sdxl", b"a dog").deployment == "sdxl"
    assert routed(config, body={"prompt": "x", "model": "sdxl-base"}).deployment == "sdxl"
    assert routed(config, headers={"x-hotlora-model": "sdxl"}).deployment == "sdxl"
    assert routed(config, "/v1/adapters", b"", query={"model": "org/sdxl"}, method="GET").deployment == "sdxl"
    assert routed(config).deployment == "flux"
    with pytest.raises(UnknownModel, match="org/flux"):
        routed(config, body={"prompt": "x", "model": "someone/else"})


def test_the_model_field_is_taken_out_where_the_api_forbids_it(config):
    generate = routed(config, body={"prompt": "x", "model": "sdxl"})
    assert "model" not in json.loads(generate.body)
    openai = routed(config, "/v1/images/generations", {"prompt": "x", "model": "sdxl"})
    assert json.loads(openai.body)["model"] == "sdxl"  # the OpenAI API's own field


def test_the_identity_adapter_is_the_affinity_key(config):
    spec = {"prompt": "x", "model": "sdxl", "adapters": {"identity": {"ref": "s3://u/42.safetensors", "scale": 0.5},
                                                        "style": "watercolor"}}
    assert routed(config, body=spec).identity == "s3://u/42.safetensors"
    assert routed(config, body={**spec, "adapters": {"style": "watercolor"}}).identity is None
    # The flux deployment's identity slot is named "face"; the inference API's `lora` header fills it.
    assert routed(config, body={"prompt": "x", "adapters": {"face": "u7"}}).identity == "u7"
    assert routed(config, "/", b"a dog", headers={"lora": "hf://u/8"}).identity == "hf://u/8"
    hf_body = {"inputs": "a dog", "parameters": {"adapters": {"face": "u9"}}}
    assert routed(config, "/models/flux", hf_body, headers={"content-type": "application/json"}).identity == "u9"


def test_a_models_path_naming_a_hub_lora_goes_to_the_model_its_card_names(config):
    """The Hugging Face inference API's ``/models/{LoRA repository}``: routed by the card's
    ``base_model`` (full id or last part against every name a model answers to), the repository the
    affinity key (a ``lora`` header wins); unknown or baseless repositories are 404s naming why."""
    cards = {"someone/sdxl-style": "stabilityai/sdxl-base", "someone/flux-face": "org/flux",
             "someone/sd3-thing": "stabilityai/stable-diffusion-3.5-large", "someone/no-card": None}
    slots = {name: spec.server.lora_header_slot for name, spec in config.models.items()}

    def hub_routed(path, headers=None, table=None):
        return route("POST", path, {}, headers or {}, b"a dog", table or config.routing_table(), config.default_model,
                     slots, hub_base_model=cards.get)

    sdxl = hub_routed("/models/someone/sdxl-style")
    assert (sdxl.deployment, sdxl.identity, sdxl.path) == ("sdxl", "hf://someone/sdxl-style", "/models/someone/sdxl-style")
    # A served model's name (a deployment name or alias the replica's model may not answer to) goes on as "/".
    assert hub_routed("/models/sdxl-base").path == "/" and routed(config, "/v1/generate").path == "/v1/generate"
    assert hub_routed("/models/someone/flux-face").deployment == "flux"
    assert hub_routed("/models/someone/flux-face", headers={"lora": "u1"}).identity == "u1"
    assert hub_routed("/models/org/sdxl").identity is None  # a served model's own id: no adapter
    with pytest.raises(UnknownModel, match="no model here serves"):
        hub_routed("/models/someone/sd3-thing")
    with pytest.raises(UnknownModel, match="declares a base model"):
        hub_routed("/models/someone/no-card")
    twice = {**config.routing_table(), "stabilityai/sdxl-base": "sdxl-copy"}  # two deployments of one base
    with pytest.raises(UnknownModel, match="several models serve"):
        route("POST", "/models/someone/sdxl-style", {}, {}, b"a dog", twice, "flux",
              {**slots, "sdxl-copy": "identity"}, hub_base_model=cards.get)
    with pytest.raises(UnknownModel, match="no model 'someone/x' is served"):  # no resolver: as before
        routed(config, "/models/someone/x", b"a dog")


def test_malformed_requests_are_refused_at_the_edge(config):
    with pytest.raises(InvalidRequest, match="not JSON"):
        routed(config, body=b"{oops")
    with pytest.raises(InvalidRequest, match="num_images"):
        routed(config, body={"prompt": "x", "num_images": "many"})
    with pytest.raises(InvalidRequest, match="JSON object"):
        routed(config, "/v1/images/generations", b"[1, 2]")
    assert routed(config, "/", b"{a raw prompt in braces").body == b"{a raw prompt in braces"  # the replica decides


def test_serve_options_carry_replicas_or_autoscaling(config):
    flux, sdxl = config.models["flux"].serve_options, config.models["sdxl"].serve_options
    assert flux["num_replicas"] == 2 and "autoscaling_config" not in flux and flux["name"] == "model-flux"
    assert sdxl["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4} and "num_replicas" not in sdxl
    assert flux["max_ongoing_requests"] == ServerConfig().max_queue


def test_bad_settings_are_refused(tmp_path):
    server, store = ServerConfig(model="m"), StoreConfig(cache_dir=tmp_path)
    with pytest.raises(DeployConfigError, match="claimed by both"):
        RayServeConfig.from_dict({"models": {"a": {"aliases": ["x/y"]}, "b": {"aliases": ["x/y"]}}}, server, store)
    # Two directories named alike: neither gets the shared name, both keep their own.
    twins = RayServeConfig.from_dict({"models": {"a": {"model": "/p/model"}, "b": {"model": "/q/model"}}}, server, store)
    assert "model" not in twins.routing_table() and twins.routing_table()["/q/model"] == "b"
    with pytest.raises(DeployConfigError, match="unknown"):
        RayServeConfig.from_dict({"models": {"a": {"replicas": 2}}}, server, store)
    with pytest.raises(DeployConfigError, match="default_model"):
        RayServeConfig.from_dict({"default_model": "zz"}, server, store)
    single = RayServeConfig.from_dict({}, server, store)  # no [ray.models]: the one --model, one replica
    assert list(single.models) == ["default"] and single.models["default"].server.model == "m"


def test_a_config_file_layers_ray_tables_over_the_server_settings(tmp_path):
    path = Path(tmp_path / "serve.toml")
    path.write_text('[server]\ntarget_rank = 32\n[ray]\nmax_attempts = 5\n'
                    '[ray.models.flux]\nmodel = "org/flux"\nserver = { batch_size = 2 }\n'
                    'store = { ram_budget_bytes = 1024 }\n[ray.models.flux.autoscaling]\nmax_replicas = 3\n')
    server, store = ServerConfig.load(path)
    config = RayServeConfig.load(path, server, store)
    flux = config.models["flux"]
    assert (config.max_attempts, flux.server.target_rank, flux.server.batch_size) == (5, 32, 2)
    assert flux.store.ram_budget_bytes == 1024 and flux.autoscaling == {"max_replicas": 3}


def test_a_public_ray_ingress_needs_keys_and_its_replicas_know_they_are_public(tmp_path):
    from hotlora.server.auth import AuthConfigError

    models = {"models": {"flux": {"model": "org/flux"}}}
    store = StoreConfig(cache_dir=tmp_path / "cache")
    with pytest.raises(AuthConfigError, match="needs API keys"):
        RayServeConfig.from_dict({**models, "host": "0.0.0.0"}, ServerConfig(), store)
    keyed = ServerConfig(api_keys="sha256:" + "ab" * 32 + " name=ops")
    config = RayServeConfig.from_dict({**models, "host": "0.0.0.0"}, keyed, store)
    assert config.models["flux"].server.host == "0.0.0.0"  # the replicas' apps require keys too
    assert RayServeConfig.from_dict(models, ServerConfig(), store).models["flux"].server.host == "127.0.0.1"


def test_jobs_are_refused_at_the_edge_not_lost_to_another_replica(config):
    """A job lives on the replica that took it; Serve would route its poll to any replica of the model."""
    from hotlora.scaleout.routing import JobsNotRouted

    for method, path, headers in (("POST", "/v1/generate", {"prefer": "respond-async"}),
                                  ("POST", "/v1/generate", {"prefer": "wait=10, Respond-Async"}),
                                  ("POST", "/v1/videos", {}), ("GET", "/v1/videos", {}),
                                  ("GET", "/v1/videos/video_1/content", {}), ("GET", "/v1/jobs/job_1", {}),
                                  ("DELETE", "/v1/jobs/job_1", {})):
        with pytest.raises(JobsNotRouted, match="not served through the Ray ingress: each replica keeps its own"):
            routed(config, path, headers=headers, method=method)
    assert issubclass(JobsNotRouted, InvalidRequest)  # a 422 in hotlora's or OpenAI's error shape
    assert routed(config, headers={"prefer": "return=minimal"}).deployment == "flux"  # other preferences pass
    assert routed(config, "/v1/jobsite", b"", method="GET").deployment == "flux"  # only the job resources
