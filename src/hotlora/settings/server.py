"""``hotlora serve``'s settings. ``ServerConfig`` declares what only the server has (address, queue,
access, bounds on bodies and fetches) and takes every engine option from ``EngineConfig``'s own
fields, flattened: ``limits.max_scale`` is ``max_scale``, ``step_cache.threshold`` is
``step_cache_threshold`` and ``step_cache`` itself names the backend (None: off). Nothing is
declared twice, so a new engine option is a server setting, an ``HOTLORA_*`` variable, a config
file key and a flag at once."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path

from hotlora.settings.engine import EngineConfig, RequestLimits, StepCache
from hotlora.settings.fields import hints, layered, normalize, setting
from hotlora.settings.files import read_config_file
from hotlora.settings.store import MiB, StoreConfig

# The nested engine groups and the prefix of their flattened names.
NESTED = {"limits": (RequestLimits, ""), "step_cache": (StepCache, "step_cache_")}
# Server defaults that differ from a library user's on purpose: a server restarts, and a compile
# it has done once should not cost it again (the engine alone writes nowhere unless asked).
SERVER_DEFAULTS = {"compile_cache_dir": ".cache/hotlora/compile"}


def _forwarded(f, name: str, kind, default=MISSING):
    default = f.default if default is MISSING else default
    return name, kind, field(default=SERVER_DEFAULTS.get(name, default), metadata=f.metadata)


def engine_fields() -> list[tuple]:
    """``(server name, type, field)`` for every engine option, in ``EngineConfig``'s order."""
    out = []
    for f in fields(EngineConfig):
        if f.name not in NESTED:
            out.append(_forwarded(f, f.name, hints(EngineConfig)[f.name]))
            continue
        group, prefix = NESTED[f.name]
        for g in fields(group):
            if group is StepCache and g.name == "backend":  # the switch: no backend, no step cache
                out.append(_forwarded(g, "step_cache", hints(group)[g.name] | None, default=None))
            else:
                out.append(_forwarded(g, prefix + g.name, hints(group)[g.name]))
    return out


# A base class made from those fields (make_dataclass: the fields are data, not copied source).
EngineSettings = make_dataclass("EngineSettings", engine_fields())
EngineSettings.__module__ = __name__
ENGINE_SETTINGS = tuple(name for name, _, _ in engine_fields())


@dataclass
class ServerConfig(EngineSettings):
    """``hotlora serve``: defaults < config file ``[server]`` < ``HOTLORA_*`` env < command-line flags.
    The engine's options are inherited from ``EngineSettings`` (above); these are the server's own."""

    model: str | None = setting(None, "local model directory or hub id (default: the built-in tiny Flux model)")
    # Checked at start-up against the engine's memory plan (hotlora.engine.plan; `hotlora plan`).
    memory: str | None = setting(None, "the memory the engine must fit in, e.g. 24GiB or 80GB; checked at start-up "
                                       "against its memory plan, which refuses to start beyond it (default: the "
                                       "CUDA device's total memory, or the RAM available on a CPU; off: no check)")
    max_batch_delay_s: float = setting(0.02, "how long a mixed batch waits for companions")
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port to bind")
    max_queue: int = setting(16, "requests admitted at once, queued or being resolved (429 beyond)")
    request_timeout_s: float = setting(600.0, "a request's deadline when it sets no timeout_s (504 after)")
    drain_timeout_s: float = setting(120.0, "how long shutdown waits for queued and running work")
    max_body_bytes: int = setting(1 * MiB, "HTTP request bodies (prompts and references, never weights; 413)")
    max_prefetch_inflight: int = setting(64, "adapter fetches prefetches may have running (429 beyond)")
    # So one client cannot take every place from the others.
    max_prefetch_per_client: int = setting(48, "of those, what one client (API key, else peer address) may have")
    # They hold no admission slot while they wait: a slow source does not turn others away.
    max_fetching_per_client: int = setting(32, "requests one client may have waiting for their adapters' "
                                               "fetches (429 beyond)")
    max_rebuild_attempts: int = setting(5, "consecutive failed engine rebuilds before the worker gives up (503s)")
    lora_header_slot: str = setting("identity", "the slot the inference API's `lora` header fills")
    enable_fault_injection: bool = setting(False, "POST /admin/fault: for tests of the rebuild path only")
    # server/auth.py; off is logged loudly when not on loopback.
    auth: str = setting("auto", "API keys: auto (required unless bound to loopback with none configured), "
                                "on, or off", choices=("auto", "on", "off"))
    api_keys_file: str | None = setting(None, "file of API key hashes, one `sha256:<hex> name=.. scopes=.. "
                                              "sources=..` line per key (`hotlora keys new` makes them)")
    api_keys: str | None = setting(None, "the same lines (';' or newline between them), e.g. HOTLORA_API_KEYS")
    # Starlette's TrustedHostMiddleware: DNS rebinding.
    allowed_host_headers: tuple[str, ...] = setting((), "Host header names answered (default: loopback names "
                                                        "while keys are not required on loopback, else any)")
    cors_origins: tuple[str, ...] = setting((), "browser origins other than the server's own allowed to call "
                                                "it (CORS; default none)")

    def engine_config(self) -> EngineConfig:
        """The engine's options, regrouped as ``EngineConfig`` nests them."""
        options = {f.name: getattr(self, f.name) for f in fields(EngineConfig) if f.name not in NESTED}
        limits = RequestLimits(**{g.name: getattr(self, g.name) for g in fields(RequestLimits)})
        step_cache = None
        if self.step_cache:
            step_cache = StepCache(self.step_cache, **{g.name: getattr(self, "step_cache_" + g.name)
                                                       for g in fields(StepCache) if g.name != "backend"})
        return EngineConfig(**options, limits=limits, step_cache=step_cache)

    @classmethod
    def load(cls, config_file: str | Path | None = None, store_flags: dict | None = None,
             **flags) -> tuple["ServerConfig", StoreConfig]:
        """Both settings of ``hotlora serve``, layered: a None flag was not given."""
        file_data = read_config_file(config_file) if config_file else {}
        server = cls(**layered(cls, file_data.get("server"), flags))
        store = StoreConfig.from_env(file_data.get("store"),
                                     **{k: v for k, v in (store_flags or {}).items() if v is not None})
        return server, store

    def __post_init__(self):
        if isinstance(self.auth, bool):  # `auth = false` in a TOML file
            self.auth = "on" if self.auth else "off"
        normalize(self)
        self.allowed_host_headers = tuple(p for p in self.allowed_host_headers if p)
        self.cors_origins = tuple(p for p in self.cors_origins if p)
        if self.auth not in ("auto", "on", "off"):
            raise ValueError(f"auth must be auto, on or off, got {self.auth!r}")
        engine = self.engine_config()  # an impossible engine is refused now, not when the model loads
        for name in ("slots", "rank_buckets", "sizes", "batch_size"):  # as the engine normalised them
            setattr(self, name, getattr(engine, name))
