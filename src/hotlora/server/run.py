"""Wiring for ``hotlora serve``: config -> store -> worker -> app -> uvicorn."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from hotlora.config import RequestLimits, ServerConfig, StoreConfig
from hotlora.engine.worker import Worker

log = logging.getLogger(__name__)


def prepare_tiny_model(config: ServerConfig, store_config: StoreConfig) -> tuple[ServerConfig, StoreConfig]:
    """No ``--model``: serve the built-in tiny Flux model (built once under the cache directory),
    with its sample adapters readable and listed in a catalog."""
    if config.model is not None:
        return config, store_config
    from hotlora.testing import save_tiny_model

    tiny = Path(store_config.cache_dir) / "tiny-flux"
    if not (tiny / "model_index.json").is_file():
        log.info("no --model given: building the tiny offline Flux model in %s", tiny)
        save_tiny_model(tiny, "flux")
    log.info("serving the built-in tiny model %s (sample adapters in %s)", tiny, tiny / "adapters")
    store_config = replace(store_config, local_roots=(*store_config.local_roots, tiny / "adapters"),
                           catalog=store_config.catalog or str(tiny / "adapters" / "catalog.toml"))
    return replace(config, model=str(tiny)), store_config


def build_worker(config: ServerConfig, store_config: StoreConfig) -> Worker:
    """A worker whose engines (the first and any rebuilt one) share one adapter store."""
    from hotlora import Engine
    from hotlora.engine.stepcache import StepCache

    shared: dict = {}

    def make_engine() -> Engine:
        first = "store" not in shared
        log.info("loading %s (slots %s, target rank %d, batch %d, compile %s, mixed batches %s)", config.model,
                 ",".join(config.slots), config.target_rank, config.batch_size, config.compile, config.mixed)
        engine = Engine.from_pretrained(
            config.model, slots=config.slots, target_rank=config.target_rank, target_modules=config.target_modules,
            batch_size=config.batch_size, compile=config.compile, height=config.height, width=config.width,
            store=shared.get("store", store_config), mixed=config.mixed,
            attention_backend=config.attention_backend, compile_cache_dir=config.compile_cache_dir,
            step_cache=StepCache(config.step_cache, config.step_cache_threshold) if config.step_cache else None,
            rank_buckets=config.rank_buckets, limits=request_limits(config),
        )
        shared["store"] = engine.store
        if first and engine.store.catalog:
            log.info("pre-fetching %d catalog adapters", len(engine.store.catalog))
            failures = engine.store.precache_catalog()
            if failures:
                log.warning("catalog entries that failed: %s", ", ".join(failures))
        return engine

    return Worker(make_engine, max_queue=config.max_queue, max_batch_delay_s=config.max_batch_delay_s,
                  max_rebuild_attempts=config.max_rebuild_attempts)


def request_limits(config: ServerConfig) -> RequestLimits:
    return RequestLimits(max_scale=config.max_scale, max_work=config.max_work)


def serve(config: ServerConfig, store_config: StoreConfig) -> None:
    import uvicorn

    from hotlora.server.app import create_app

    config, store_config = prepare_tiny_model(config, store_config)
    app = create_app(build_worker(config, store_config), config)
    log.info("listening on http://%s:%d (ready once /readyz says so)", config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=int(config.drain_timeout_s))
