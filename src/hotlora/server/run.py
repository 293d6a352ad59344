"""Wiring for ``hotlora serve``: config -> serving (worker and store) -> app -> uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

from hotlora.engine.worker import Worker
from hotlora.errors import HotloraError
from hotlora.settings import ServerConfig, StoreConfig

log = logging.getLogger(__name__)


def prepare_tiny_model(config: ServerConfig, store_config: StoreConfig) -> tuple[ServerConfig, StoreConfig]:
    """No ``--model``: serve the built-in tiny model of the default family (built once under the
    cache directory), with its sample adapters readable and listed in a catalog."""
    if config.model is not None:
        return config, store_config
    from hotlora.families import DEFAULT_FAMILY
    from hotlora.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(store_config.tiny_model_dir(DEFAULT_FAMILY), DEFAULT_FAMILY)
    log.info("serving the built-in tiny model %s (sample adapters in %s)", tiny, tiny / "adapters")
    store_config = store_config.replace(local_roots=(*store_config.local_roots, tiny / "adapters"),
                                        catalog=store_config.catalog or str(tiny / "adapters" / "catalog.toml"))
    return config.replace(model=str(tiny)), store_config


class Serving:
    """One served model: the worker that runs (and rebuilds) its engine, and the adapter store the
    service fetches through. The store is its alone: built once, with the first engine (it needs the
    model's family), it serves every rebuilt one, so the caches outlive engine faults. No engine
    holds it: the service hands each request's fetched adapters to ``Engine.prepare``."""

    def __init__(self, config: StoreConfig | None = None, *, worker: Worker | None = None, store=None):
        self.config = config  # the store's settings
        self.worker = worker
        self.store = store  # None until the first engine is built
        self.on_fetch = None  # the store's hook: seconds of each source fetch (metrics)
        self.next_engine_process = None  # what the next engine start takes (``SpawnedAhead``): see build_serving

    def discard_spare(self) -> None:
        """End the spare engine process (the server is stopping)."""
        spare, self.next_engine_process = self.next_engine_process, None
        if spare is not None:
            spare.discard()

    def open_store(self, engine) -> None:
        """The store for ``engine``'s model, built (and its catalog pre-fetched) the first time."""
        if self.store is None:
            from hotlora.adapters.store import AdapterStore

            self.store = AdapterStore(self.config, engine.family, denoiser_config=engine.denoiser_config)
            self.store.on_fetch = self.on_fetch
            if self.store.catalog:
                log.info("pre-fetching %d catalog adapters", len(self.store.catalog))
                failures = self.store.precache_catalog()
                if failures:
                    log.warning("catalog entries that failed: %s", ", ".join(failures))


def check_memory(config: ServerConfig) -> tuple:
    """The engine's memory plan (``hotlora plan``), logged; ``DoesNotFit`` (with the plan) when it
    exceeds ``config.memory``, else the CUDA device's total memory or, on a CPU, the RAM available
    now. Runs before anything is loaded. Returns (the plan (None: ``memory = off``, or no plan),
    whether to keep a spare engine process): the spare (``engine_spare_process``) is planned beside
    the engine, and where the engine fits only without it the server runs without one."""
    spare = want_spare = bool(config.engine_process and config.engine_spare_process)
    if str(config.memory).lower() == "off":
        return None, spare
    import torch

    from hotlora.engine.device import default_device
    from hotlora.engine.plan import parse_bytes, this_machine
    from hotlora.errors import DoesNotFit

    engine_config = config.engine_config()
    device = engine_config.device or default_device()
    if config.memory:
        budget, name = parse_bytes(config.memory), f"memory {config.memory}"
    try:  # a device torch cannot name is the engine's error to give (at load), not the planner's
        if not config.memory:
            budget, name = this_machine(torch.device(device).type, device)
        plan, spare = plan_serving(config.model, engine_config, spare, budget=budget, budget_name=name, device=device)
    except Exception as exc:  # the planner's own limits (a layout it cannot read) must not stop a server
        log.warning("no memory plan for %s (%s: %s); starting without the check", config.model,
                    type(exc).__name__, exc)
        return None, spare
    if plan.fits is False:
        raise DoesNotFit(plan)
    # Fits, but perhaps only with adapters smaller than the target rank (the verdict says "TIGHT"),
    # or without the spare.
    tight = (plan.budget is not None and plan.peak_bytes > plan.budget) or spare != want_spare
    (log.warning if tight else log.info)("%s", plan.text())
    return plan, spare


def plan_serving(model, engine_config, spare: bool, **budget) -> tuple:
    """A server's memory plan (``plan_memory``'s ``budget``, ``budget_name``, ``device``): the engine
    and, where it fits beside it, the spare engine process. Returns (the plan, whether the spare is
    in it)."""
    from hotlora.engine.plan import format_bytes, plan_memory

    plan = plan_memory(model, engine_config, spare_process=spare, **budget)
    if spare and plan.fits is False:
        alone = plan_memory(model, engine_config, **budget)
        if alone.fits is not False:
            alone.notes.append(f"no spare engine process: the engine fits only without one "
                               f"({format_bytes(plan.static_bytes - alone.static_bytes)}); an engine process "
                               "that dies is replaced by a new spawn, its imports ~4 s on 2 cores")
            return alone, False
    return plan, spare


def build_serving(config: ServerConfig, store_config: StoreConfig, ahead=None) -> Serving:
    """The worker, whose engines (the first and any rebuilt one) are served from one adapter store.
    The memory plan is checked first (``check_memory``): an engine that cannot fit is never loaded.
    ``ahead``: the first engine process, spawned before (``SpawnedAhead``). Each engine process, once
    warm, gets a spare (``engine_spare_process``, where the plan has room for it): the one that
    replaces it if it dies, its imports done."""
    from hotlora import Engine

    _, spare = check_memory(config)
    engine_config = config.engine_config()
    serving = Serving(store_config)
    serving.next_engine_process = ahead

    def make_engine():
        log.info("loading %s (slots %s, target rank %d, batch %s, compile %s, mixed batches %s, %s)", config.model,
                 ",".join(config.slots), config.target_rank, config.batch_size, config.compile, config.mixed,
                 "in an engine process" if config.engine_process else "in this process")
        if config.engine_process:
            from hotlora.engine.process import EngineProcess, SpawnedAhead

            taken, serving.next_engine_process = serving.next_engine_process, None
            engine = EngineProcess.start(config.model, engine_config, stall_timeout_s=config.engine_stall_timeout_s,
                                         held_bytes=config.engine_held_adapter_bytes, ahead=taken)
        else:
            engine = Engine.from_pretrained(config.model, engine_config)
        serving.open_store(engine)
        if spare:  # last: its imports delay no start
            serving.next_engine_process = SpawnedAhead(str(config.model), config.compile)
        return engine

    worker = serving.worker = Worker(make_engine, max_queue=config.max_queue,
                                     max_batch_delay_s=config.max_batch_delay_s,
                                     max_rebuild_attempts=config.max_rebuild_attempts)
    # A cold fetch is a worker event (its on_event feeds the metrics) like the engine's own.
    serving.on_fetch = lambda seconds: worker.on_event("adapter_fetched", {"seconds": seconds})
    return serving


def serve(config: ServerConfig, store_config: StoreConfig, ahead=None) -> None:
    """``ahead``: the engine process ``hotlora serve`` spawned as it started (``SpawnedAhead``)."""
    import uvicorn

    from hotlora.server.app import create_app
    from hotlora.server.auth import keyring_for

    keyring_for(config)  # no keys where keys are required: refuse now, before a model is built or loaded
    config, store_config = prepare_tiny_model(config, store_config)
    check_served(config.model)
    serving = build_serving(config, store_config, ahead)
    app = create_app(serving, config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                           timeout_graceful_shutdown=int(config.drain_timeout_s)))
    app.state.on_start_failed = lambda: setattr(server, "should_exit", True)
    log.info("listening on http://%s:%d (ready once /readyz says so)", config.host, config.port)
    try:
        server.run()
    finally:
        serving.discard_spare()
    if serving.worker.failed and serving.worker.failed.startswith("start-up failed"):
        raise StartupFailed(serving.worker.failed)


class StartupFailed(HotloraError):
    """``hotlora serve``: the engine could not start (the server stopped listening; exit status 1)."""


def check_served(model) -> None:
    """A local model whose pipeline no family serves is refused before anything listens
    (UnservedModel); a hub id is read when it loads, and a failure there ends the server too."""
    from hotlora.families import family_of_model_index

    index = Path(str(model)) / "model_index.json"
    if index.is_file():
        family_of_model_index(index)
