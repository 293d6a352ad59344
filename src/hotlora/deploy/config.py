"""Settings of the Ray Serve application: which base models run, how many replicas, how requests find them.

A config file (the same one ``hotlora serve --config`` reads) may carry a ``[ray]`` table::

    [ray]
    default_model = "flux-dev"      # where a request that names no model goes (default: the only / first one)
    max_attempts = 3                # a request whose replica died is sent again, at most this many times
    adapter_bytes_estimate = 268435456

    [ray.models.flux-dev]           # one Serve deployment per base model; the key is its name
    model = "/models/FLUX.1-dev"    # what `hotlora serve --model` takes
    aliases = ["black-forest-labs/FLUX.1-dev"]
    num_replicas = 2                # or an [ray.models.flux-dev.autoscaling] table (Serve's autoscaling_config)
    server = { target_rank = 64 }   # ServerConfig overrides for this model's engines
    store = { ram_budget_bytes = 8589934592 }
    ray_actor_options = { num_gpus = 1 }

With no ``[ray.models]`` table, the one model of ``[server]`` / ``--model`` is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from hotlora.config import MiB, ModelDefaultsError, ServerConfig, StoreConfig, read_config_file, read_model_defaults
from hotlora.errors import HotloraError
from hotlora.server.auth import keyring_for  # torch-free, like everything the ingress imports



class DeployConfigError(HotloraError):
    """The [ray] settings do not describe a servable application (found at start-up, not per request)."""


@dataclass
class ModelDeployment:
    """One base model: one Serve deployment whose replicas each own one warm worker."""

    name: str
    server: ServerConfig
    store: StoreConfig
    aliases: tuple[str, ...] = ()
    num_replicas: int | str = 1  # an int, or "auto" when `autoscaling` is given
    autoscaling: dict | None = None  # Serve's autoscaling_config, passed through untouched
    # Serve's LRU of identity adapters per replica. None: as many as fit in the RAM cache next to
    # the pinned catalog (computed on each replica once its catalog is loaded).
    max_adapters_per_replica: int | None = None
    ray_actor_options: dict = field(default_factory=dict)
    max_ongoing_requests: int | None = None  # None: the worker queue bound (max_queue)

    def declared_ids(self) -> list[str]:
        """The names the operator gave this model: the deployment name and its aliases."""
        return [self.name, *self.aliases]

    def derived_ids(self) -> list[str]:
        """The names the model itself answers to: its path, its directory name, and the ``model_id`` /
        ``base_model_aliases`` of its hotlora.json (the names adapters declare as their base model)."""
        model = self.server.model
        if not model:
            return []
        defaults = _model_defaults(model)
        ids = [model, Path(model).name, defaults.get("model_id"), *defaults.get("base_model_aliases", [])]
        return list(dict.fromkeys(i for i in ids if i))

    @property
    def serve_options(self) -> dict:
        """Options for ``Deployment.options``: replicas or autoscaling, actor resources, concurrency."""
        options = {"name": f"model-{self.name}", "ray_actor_options": dict(self.ray_actor_options),
                   "max_ongoing_requests": self.max_ongoing_requests or self.server.max_queue}
        if self.autoscaling:
            options["autoscaling_config"] = dict(self.autoscaling)
        else:
            options["num_replicas"] = self.num_replicas
        return options


@dataclass
class RayServeConfig:
    models: dict[str, ModelDeployment]
    default_model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_attempts: int = 3  # tries per request when a replica dies under it
    retry_backoff_s: float = 0.5
    request_timeout_s: float = 600.0  # the ingress gives up on a replica's answer after this
    adapter_bytes_estimate: int = 256 * MiB  # a typical identity adapter, to size the affinity LRU
    ingress_options: dict = field(default_factory=lambda: {"num_cpus": 0})

    def __post_init__(self):
        if not self.models:
            raise DeployConfigError("the Ray application needs at least one model")
        if self.default_model is None:
            self.default_model = next(iter(self.models))
        if self.default_model not in self.models:
            raise DeployConfigError(f"default_model {self.default_model!r} is not one of {sorted(self.models)}")
        self.routing_table()  # refuse an ambiguous table now, not on the first request
        # Missing keys on a public address: refused now, not in every replica.
        for spec in self.models.values():
            keyring_for(spec.server)

    def routing_table(self) -> dict[str, str]:
        """model id -> deployment name. A declared id claimed by two models is refused (a request must
        not reach a model by accident); a derived id two models share (two directories both named
        ``model``) is left out, and those models are reached by their declared ids."""
        table: dict[str, str] = {}
        for name, spec in self.models.items():
            for model_id in spec.declared_ids():
                owner = table.setdefault(model_id, name)
                if owner != name:
                    raise DeployConfigError(f"model id {model_id!r} is claimed by both {owner!r} and {name!r}")
        derived: dict[str, set[str]] = {}
        for name, spec in self.models.items():
            for model_id in spec.derived_ids():
                derived.setdefault(model_id, set()).add(name)
        for model_id, owners in derived.items():
            if model_id not in table and len(owners) == 1:
                table[model_id] = owners.pop()
        return table

    @classmethod
    def load(cls, config_file: str | Path | None, server: ServerConfig, store: StoreConfig) -> "RayServeConfig":
        """``server``/``store`` are the already layered ``hotlora serve`` settings; the ``[ray]`` table of
        ``config_file`` adds models and routing. Each model's tables override those settings."""
        data = (read_config_file(config_file) if config_file else {}).get("ray", {})
        return cls.from_dict(data, server, store)

    @classmethod
    def from_dict(cls, data: dict, server: ServerConfig, store: StoreConfig) -> "RayServeConfig":
        data = dict(data)
        models_data = data.pop("models", None) or {"default": {}}
        known = {f.name for f in fields(cls)} - {"models"}
        unknown = set(data) - known
        if unknown:
            raise DeployConfigError(f"unknown [ray] settings {sorted(unknown)}; known: {sorted(known)}")
        data.setdefault("host", server.host)
        data.setdefault("port", server.port)
        # The replicas' apps judge access (keys required off loopback) by the address clients reach:
        # the ingress's, not the [server] default.
        server = server.replace(host=data["host"])
        models = {name: _model_deployment(name, dict(spec), server, store) for name, spec in models_data.items()}
        return cls(models=models, **data)


def _model_deployment(name: str, spec: dict, server: ServerConfig, store: StoreConfig) -> ModelDeployment:
    server_overrides = dict(spec.pop("server", {}))
    if "model" in spec:
        server_overrides["model"] = spec.pop("model")
    store_overrides = dict(spec.pop("store", {}))
    known = {f.name for f in fields(ModelDeployment)} - {"name", "server", "store"}
    unknown = set(spec) - known
    if unknown:
        raise DeployConfigError(f"unknown settings {sorted(unknown)} for model {name!r}; known: {sorted(known)}")
    if "aliases" in spec:
        spec["aliases"] = tuple(spec["aliases"])
    return ModelDeployment(name=name, server=server.replace(**server_overrides),
                           store=store.replace(**store_overrides), **spec)


def _model_defaults(model: str) -> dict:
    try:
        return read_model_defaults(model)
    except ModelDefaultsError:
        return {}  # the engine reports an unreadable file when it loads the model
