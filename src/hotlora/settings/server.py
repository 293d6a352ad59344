"""``hotlora serve``'s settings. ``ServerConfig`` declares what only the server has (address, queue,
access, bounds on bodies and fetches) and takes every engine option from ``EngineConfig``'s own
fields, flattened: ``limits.max_scale`` is ``max_scale``, ``step_cache.threshold`` is
``step_cache_threshold`` and ``step_cache`` itself names the backend (None: off). Nothing is
declared twice, so a new engine option is a server setting, an ``HOTLORA_*`` variable, a config
file key and a flag at once."""

from __future__ import annotations

from pathlib import Path

from pydantic import create_model, field_validator, model_validator

from hotlora.settings.base import Settings
from hotlora.settings.engine import EngineConfig, RequestLimits, StepCache
from hotlora.settings.fields import declared, setting
from hotlora.settings.store import GiB, MiB, StoreConfig

# The nested engine groups and the prefix of their flattened names.
NESTED = {"limits": (RequestLimits, ""), "step_cache": (StepCache, "step_cache_")}
# Server defaults that differ from a library user's on purpose: a server restarts, and a compile
# it has done once should not cost it again (the engine alone writes nowhere unless asked).
SERVER_DEFAULTS = {"compile_cache_dir": ".cache/hotlora/compile"}


_ITS_OWN = object()


def _forwarded(info, name: str, kind=None, default=_ITS_OWN) -> tuple[str, tuple]:
    """``(server name, (type, field))``: the engine field's type, help, choices and parse, the
    server's default where it has its own."""
    meta, text = declared(info), info.description or ""
    if name in SERVER_DEFAULTS or default is not _ITS_OWN or info.default_factory is None:
        default = SERVER_DEFAULTS.get(name, info.default if default is _ITS_OWN else default)
        field = setting(default, text, choices=meta.choices, parse=meta.parse)
    else:
        field = setting(help=text, choices=meta.choices, parse=meta.parse, factory=info.default_factory)
    return name, (kind or info.annotation, field)


def engine_fields() -> list[tuple[str, tuple]]:
    """``(server name, (type, field))`` for every engine option, in ``EngineConfig``'s order."""
    out = []
    for name, info in EngineConfig.model_fields.items():
        if name not in NESTED:
            out.append(_forwarded(info, name))
            continue
        group, prefix = NESTED[name]
        for inner, g in group.model_fields.items():
            if group is StepCache and inner == "backend":  # the switch: no backend, no step cache
                out.append(_forwarded(g, "step_cache", g.annotation | None, default=None))
            else:
                out.append(_forwarded(g, prefix + inner))
    return out


# A base class made from those fields (pydantic's create_model: the fields are data, not copied source).
EngineSettings = create_model("EngineSettings", __base__=Settings, __module__=__name__, **dict(engine_fields()))
ENGINE_SETTINGS = tuple(name for name, _ in engine_fields())


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
    # The same egress policy as adapter fetches (allowed_hosts, allow_http): public addresses only.
    input_image_fetch_deadline_s: float = setting(30.0, "seconds for fetching one input image by URL: connect, "
                                                        "headers and body together")
    max_prefetch_inflight: int = setting(64, "adapter fetches prefetches may have running (429 beyond)")
    # So one client cannot take every place from the others.
    max_prefetch_per_client: int = setting(48, "of those, what one client (API key, else peer address) may have")
    # They hold no admission slot while they wait: a slow source does not turn others away.
    max_fetching_per_client: int = setting(32, "requests one client may have waiting for their adapters' "
                                               "fetches (429 beyond)")
    # Decoding is CPU work on the server's threads: a small share keeps one client from taking them all.
    max_decoding_per_client: int = setting(4, "requests one client may have fetching or decoding input images "
                                              "(429 beyond)")
    max_rebuild_attempts: int = setting(5, "consecutive failed engine rebuilds before the worker gives up (503s)")
    # engine/process.py: a crash below Python (segfault, abort, OOM kill) costs an engine restart,
    # not the server; off: the engine runs on a thread of the server's process (Ray replicas do).
    engine_process: bool = setting(True, "run the engine in its own process, restarted when it dies")
    # A restart after an engine death then waits for no imports (torch, diffusers: ~4 s on 2 cores);
    # the spare is spawned once an engine is warm, so it never competes with a start.
    engine_spare_process: bool = setting(True, "keep a spare engine process with its imports done (~0.4 GB of "
                                               "host memory, counted by the memory plan: none where the engine fits only "
                                               "without it), which replaces an engine process that dies")
    engine_stall_timeout_s: float = setting(600.0, "an engine process that finishes no denoising step (or decode) "
                                                   "for this long is killed and restarted")
    # A request whose adapter the child holds sends only its key; one it does not, the tensors.
    engine_held_adapter_bytes: int = setting(2 * GiB, "adapters the engine process keeps after their first request, "
                                                      "least recently used dropped beyond")
    lora_header_slot: str = setting("identity", "the slot the inference API's `lora` header fills")
    enable_fault_injection: bool = setting(False, "POST /admin/fault: for tests of the rebuild path only")
    # server/auth.py; off is logged loudly when not on loopback.
    auth: str = setting("auto", "API keys: auto (required unless bound to loopback with none configured), "
                                "on, or off", choices=("auto", "on", "off"))
    api_keys_file: str | None = setting(None, "file of API key hashes, one `sha256:<hex> name=.. scopes=.. "
                                              "sources=..` line per key (`hotlora keys new` makes them); "
                                              "or the lines themselves in HOTLORA_API_KEYS (no flag for those)")
    # No flag: a flag's value is readable by every local user (`ps`, /proc/<pid>/cmdline), and these
    # lines name every key, its scopes and sources. The environment or a config file only.
    api_keys: str | None = setting(None, "the same lines (';' or newline between them): HOTLORA_API_KEYS or "
                                         "a config file only", flag=False)
    # Starlette's TrustedHostMiddleware: DNS rebinding.
    allowed_host_headers: tuple[str, ...] = setting((), "Host header names answered (default: loopback names "
                                                        "while keys are not required on loopback, else any)")
    cors_origins: tuple[str, ...] = setting((), "browser origins other than the server's own allowed to call "
                                                "it (CORS; default none)")
    # server/tracing.py; needs the `otel` extra. Off: nothing of OpenTelemetry is imported.
    otlp_endpoint: str | None = setting(None, "OpenTelemetry collector's OTLP/HTTP address (e.g. "
                                              "http://collector:4318): one trace per generation; default off")

    # server/jobs.py: jobs (``Prefer: respond-async``) outlive their request; records and results on disk.
    jobs_dir: str = setting(".cache/hotlora/jobs", "where jobs' records and results are kept (a restart "
                                                   "answers unfinished ones as failed)")
    job_retention_s: float = setting(3600.0, "how long a finished job and its result are kept when the job "
                                             "asks for no retention_s")
    job_max_retention_s: float = setting(86400.0, "the longest retention_s a job may ask for (422 beyond)")
    # The oldest finished jobs are evicted first; one result alone over the bound fails its job.
    jobs_max_bytes: int = setting(2 * GiB, "jobs' results kept on disk, all together")
    max_jobs_per_client: int = setting(16, "unfinished jobs one client (API key, else peer address) may have "
                                           "(429 beyond)")
    # server/webhooks.py: Standard Webhooks signatures. No secret, no webhooks (a job asking for one is a
    # 422); destinations under the store's egress policy for client URLs (allowed_hosts, allow_http).
    # No flag: a flag's value is readable by every local user.
    webhook_secret: str | None = setting(None, "the Standard Webhooks signing secret (whsec_<base64>): "
                                               "HOTLORA_WEBHOOK_SECRET or a config file only; unset: no webhooks",
                                         flag=False)
    webhook_max_attempts: int = setting(5, "deliveries tried per webhook (exponential backoff between them)")
    webhook_backoff_s: float = setting(2.0, "the wait before a webhook's second attempt; doubled after each")
    webhook_timeout_s: float = setting(10.0, "seconds one webhook delivery may take")

    def engine_config(self) -> EngineConfig:
        """The engine's options, regrouped as ``EngineConfig`` nests them."""
        options = {name: getattr(self, name) for name in EngineConfig.model_fields if name not in NESTED}
        limits = RequestLimits(**{name: getattr(self, name) for name in RequestLimits.model_fields})
        step_cache = None
        if self.step_cache:
            step_cache = StepCache(self.step_cache, **{name: getattr(self, "step_cache_" + name)
                                                       for name in StepCache.model_fields if name != "backend"})
        return EngineConfig(**options, limits=limits, step_cache=step_cache)

    @classmethod
    def load(cls, config_file: str | Path | None = None, store_flags: dict | None = None,
             **flags) -> tuple["ServerConfig", StoreConfig]:
        """Both settings of ``hotlora serve``, each layered (``Settings.layered``): flags >
        ``HOTLORA_*`` > the file's ``[server]`` / ``[store]`` table > defaults; a None flag was not given."""
        server = cls.layered(config_file, "server", **flags)
        return server, StoreConfig.load(config_file, **(store_flags or {}))

    @field_validator("auth", mode="before")
    @classmethod
    def _auth_words(cls, value):
        if isinstance(value, bool):  # `auth = false` in a TOML file
            return "on" if value else "off"
        return value

    @field_validator("allowed_host_headers", "cors_origins")
    @classmethod
    def _no_empty(cls, value):
        return tuple(p for p in value if p)

    @model_validator(mode="after")
    def _refuse_impossible(self) -> "ServerConfig":
        if self.auth not in ("auto", "on", "off"):
            raise ValueError(f"auth must be auto, on or off, got {self.auth!r}")
        if self.job_retention_s > self.job_max_retention_s:
            raise ValueError(f"job_retention_s ({self.job_retention_s}) exceeds job_max_retention_s "
                             f"({self.job_max_retention_s})")
        if self.webhook_secret is not None:
            from standardwebhooks import Webhook

            try:
                Webhook(self.webhook_secret)
            except Exception:  # the library's own errors (bad base64, empty): never echo the secret
                raise ValueError("webhook_secret is not a Standard Webhooks secret (whsec_<base64>)") from None
        self.engine_config()  # an impossible engine is refused now, not when the model loads
        return self
