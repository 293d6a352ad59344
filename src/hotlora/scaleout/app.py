"""Assemble and run the Ray Serve application: one deployment per base model behind one ingress."""

from __future__ import annotations

import logging
from dataclasses import replace

from hotlora.settings import ServerConfig
from hotlora.scaleout.config import RayServeConfig
from hotlora.scaleout.ingress import Ingress
from hotlora.scaleout.replica import ModelReplica

log = logging.getLogger(__name__)
APP_NAME = "hotlora"


def build_app(config: RayServeConfig):
    """The Serve application (``serve.run`` it, or name this module in a Serve config file)."""
    models = {name: ModelReplica.options(**spec.serve_options).bind(spec, config.adapter_bytes_estimate)
              for name, spec in config.models.items()}
    return Ingress.options(ray_actor_options=dict(config.ingress_options)).bind(models, config)


def with_tiny_model(config: RayServeConfig) -> RayServeConfig:
    """A model with no ``model`` set serves the built-in tiny Flux model, as ``hotlora serve`` does."""
    from hotlora.server.run import prepare_tiny_model

    models = {}
    for name, spec in config.models.items():
        server, store = prepare_tiny_model(spec.server, spec.store)
        models[name] = replace(spec, server=server, store=store)
    return replace(config, models=models)


def app_builder(args: dict):
    """Serve's application-builder hook, for ``serve run`` / ``serve deploy`` with a Serve config file::

        applications:
          - name: hotlora
            import_path: hotlora.scaleout.app:app_builder
            args: {config: /etc/hotlora/serve.toml}
    """
    server, store = ServerConfig.load(args.get("config"))
    return build_app(with_tiny_model(RayServeConfig.load(args.get("config"), server, store)))


def run(config: RayServeConfig, *, blocking: bool = True):
    """``hotlora serve --ray``: join the cluster in RAY_ADDRESS (else start a local one), listen on
    ``config.host:config.port`` and serve until interrupted."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    serve.start(http_options={"host": config.host, "port": config.port})
    config = with_tiny_model(config)
    log.info("deploying %s on Ray Serve; listening on http://%s:%d", ", ".join(config.models), config.host, config.port)
    try:
        return serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=blocking)
    except KeyboardInterrupt:  # Ctrl-C: replicas drain their queues (ModelReplica.__del__), then exit
        log.info("shutting down the Ray application")
        serve.shutdown()
